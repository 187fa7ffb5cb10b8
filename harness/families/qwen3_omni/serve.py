"""Qwen3-Omni on the real server (``--backend vllm-omni --family qwen3-omni``): what differs from Qwen2.5-Omni.

* **The deploy** (:func:`deploy_yaml`): 0.30.0's ``--stage-overrides`` cannot switch the runner, so the
  server gets a whole deploy YAML (``--deploy-config``), the release's own ``deploy/qwen3_omni_moe.yaml``
  (vendored for ``conform``) with only these changes: no ``platforms:`` section; ``model_runner: v1``; the
  deploy's ``async_chunk`` (``true``, the shipped streaming path: the Thinker streams its rows to the
  Talker and the Talker's connector sends Code2Wav windows of 4, then 25 frames with 25 frames of left
  context, the release's ``connectors:`` as shipped; ``false``, the full payload); the deploy's Talker
  scheduler and KV settings and the Thinker's and Code2Wav's ``max_num_seqs``; eager stages,
  ``async_scheduling: false`` (the sim's runner), prefix caching off. On CPU also: ``moe_backend: auto``
  (the shipped ``triton`` has no CPU kernel), the CPU profile of ``harness.serve.deploy_args`` (32-token
  KV blocks, the pinned Talker block count converted to them, fixed KV bytes per stage, a device id per
  stage, Code2Wav in float32, the thread variables), and the Thinker's ``max_model_len`` and budget 4,096
  (:data:`CPU_THINKER_TOKENS`). A speaking
  checkpoint's Thinker gets the reply forcer (``harness.serve.reply_forcer``) as its logits processor.
* **Requests**: the chat path of Qwen2.5-Omni (``harness.serve.client.build_body``: system and user turn,
  text and audio out, per-stage sampling, the reply for the forcer), Code2Wav's sampling the release's
  (``max_tokens`` 65,536, the shipped stage 2 ``default_sampling_params``).
* **Trace**: the Talker's ``talker_preprocess`` on ``Qwen3OmniMoeForConditionalGeneration`` (the family's
  ``trace_target``), lines filed by the chat tag, the codec ids read back by this family's speaking rules
  (:func:`oracle`); on the streaming path the connector's windows (:data:`CHUNKER`, ``harness.serve.chunk_trace``)
  are checked against the release's rule (:func:`chunk_rule`). The worker's contract check is Qwen2.5-Omni's
  rows (``harness.serve.worker_contract``), so this family traces at level ``spans`` (:func:`server_env`):
  what a wrong row does is heard in the oracle transcript, and the events come from each span's
  ``P``, ``c`` and ``n``.
"""

from __future__ import annotations

from typing import Any

from harness.physics import QWEN3_TTS_UPSAMPLE

THINKER, TALKER, CODE2WAV = 0, 1, 2
BY_TEXT = False  # trace lines name their request by the chat tag, as Qwen2.5-Omni's
# async_chunk: the release's Talker -> Code2Wav window builder, traced at the connector (harness.serve.chunk_trace)
CHUNKER = "vllm_omni.model_executor.stage_input_processors.qwen3_omni:talker2code2wav_async_chunk"
# Code2Wav's samples per codec frame (the 12.5 Hz codec at 24 kHz, as Qwen3-TTS's; the tiny checkpoint keeps the
# real upsampling, harness.families.qwen3_omni.tiny_model): a stream's audio length in frames
SAMPLES_PER_CODEC_FRAME = QWEN3_TTS_UPSAMPLE
# Code2Wav's valid convolutions trim a tail off each decode's right edge (the tiny checkpoint, which keeps the real
# upsampling: 555 samples); the next window's left context refills it (``chunked_decode_streaming``), but the
# last window's is never emitted, nor the full payload's. So a whole stream is up to one frame short of
# frames x 1,920; a lost frame is still more than that (``harness.stream_metrics.stream_failure``).
STREAM_END_TRIM = SAMPLES_PER_CODEC_FRAME - 1
CPU_MOE_BACKEND = "auto"  # the shipped "triton" has no CPU kernel; "auto" picks vLLM's CPU MoE
# the Thinker's max_model_len and budget on CPU: a system prompt, a user turn and a reply of the one-token-per-byte
# tiny tokenizer fit many times over; the shipped 32,768-token budget (the model's 65,536 positions) sizes CPU
# buffers for nothing
CPU_THINKER_TOKENS = 4096
TRACE_LEVEL = "spans"
RELEASE_DEPLOY = "qwen3_omni_moe.yaml"  # the release's deploy this family's YAML starts from  # the worker's contract check knows Qwen2.5-Omni's rows only (module docstring)

def release_deploy() -> dict[str, Any]:
    """The release's ``deploy/qwen3_omni_moe.yaml`` as shipped (vendored), a copy of its own."""
    from harness.serve.deploy_args import release_deploy as vendored

    return vendored(RELEASE_DEPLOY)


def deploy_yaml(deploy: Any, platform: str, speaking: bool) -> dict[str, Any]:
    """The whole deploy YAML the server is started with (module docstring)."""
    from harness.serve.deploy_args import talker_stage

    content = release_deploy()
    content.pop("platforms", None)
    content["model_runner"] = "v1"
    content["async_chunk"] = bool(deploy.async_chunk)
    stages = {int(stage["stage_id"]): stage for stage in content["stages"]}
    talker_cfg = deploy.talker
    thinker, talker, code2wav = stages[THINKER], stages[TALKER], stages[CODE2WAV]
    thinker["max_num_seqs"] = deploy.thinker.max_num_seqs
    code2wav["max_num_seqs"] = deploy.code2wav.max_num_seqs
    talker.update(talker_stage(talker_cfg))
    for stage in stages.values():
        stage["enforce_eager"] = True
        stage["async_scheduling"] = False
        if stage is not talker:  # the Talker's is the deploy's (talker_stage)
            stage["enable_prefix_caching"] = False
    if speaking:
        from harness.serve.deploy_args import REPLY_FORCER

        thinker["logits_processors"] = [REPLY_FORCER]
    if platform == "cpu":
        _cpu_profile(stages, talker_cfg)
    return content


def _cpu_profile(stages: dict[int, dict[str, Any]], talker_cfg: Any) -> None:
    """The CPU platform's changes (module docstring), in place."""
    from harness.serve.deploy_args import CPU_BLOCK_SIZE, CPU_KV_BYTES, cpu_stage_devices

    talker = stages[TALKER]
    blocks = talker.get("num_gpu_blocks_override")
    if blocks is not None:
        talker["num_gpu_blocks_override"] = -(-blocks * talker_cfg.block_size // CPU_BLOCK_SIZE)
    for stage_id, stage in stages.items():
        stage.pop("gpu_memory_utilization", None)
        if "moe_backend" in stage:
            stage["moe_backend"] = CPU_MOE_BACKEND
        stage["block_size"] = max(CPU_BLOCK_SIZE, -(-stage.get("block_size", CPU_BLOCK_SIZE) // CPU_BLOCK_SIZE)
                                  * CPU_BLOCK_SIZE)
        stage["kv_cache_memory_bytes"] = CPU_KV_BYTES[str(stage_id)]
        stage["devices"] = cpu_stage_devices(stage_id)
    stages[CODE2WAV]["dtype"] = "float32"
    stages[THINKER]["max_model_len"] = stages[THINKER]["max_num_batched_tokens"] = CPU_THINKER_TOKENS


def translate(deploy: Any, platform: str, speaking: bool = True) -> Any:
    """The deploy as ``vllm serve`` arguments: ``--deploy-config`` (``deploy_yaml``) and the platform's environment."""
    from harness.serve.deploy_args import yaml_translation

    return yaml_translation(deploy, platform, lambda: deploy_yaml(deploy, platform, speaking))


def request_body(model: str, prompts: Any, prompt: Any, deploy: Any, tag: str, speaking: bool,
                 stream: bool) -> dict[str, Any]:
    """The chat request (``client.build_body``) with the release's Code2Wav sampling."""
    from harness.serve.client import build_body

    body = build_body(model, prompts, prompt, deploy, tag, speaking, stream)
    shipped = {int(s["stage_id"]): s for s in release_deploy()["stages"]}[CODE2WAV]["default_sampling_params"]
    body["sampling_params_list"][CODE2WAV] = {**shipped, "detokenize": True}
    return body


def chunk_rule() -> Any:
    """The window rule the release's connector settings give (``harness.chunk_contract``): 4 frames, then 25,
    each window after the first resending up to 25 frames of left context."""
    from harness.chunk_contract import ChunkRule

    extra = release_deploy()["connectors"]["connector_of_shared_memory"]["extra"]
    return ChunkRule(chunk_frames=int(extra["codec_chunk_frames"]),
                     initial_frames=int(extra.get("initial_codec_chunk_frames") or 0),
                     left_context=int(extra["codec_left_context_frames"]))


def oracle(codes: list[int]) -> str:
    """The speaking tiny Qwen3-Omni's codec stream read back (``speaking.decode``)."""
    from harness.families.qwen3_omni.speaking import decode

    return decode(codes).text


def server_env() -> dict[str, str]:
    """The Talker worker traces at level ``spans`` (module docstring); the hook is ``talker_preprocess``, the
    trace plugin's default wrapper."""
    from harness.serve.trace_plugin import ENV_LEVEL

    return {ENV_LEVEL: TRACE_LEVEL}
