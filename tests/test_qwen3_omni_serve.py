"""Qwen3-Omni on the real backend, the parts that need no server (issue 44 item 2): the deploy YAML (the release's
own, with the deploy's Talker settings and the CPU profile), the chat request, the connector's window rule, the
trace level, and the dry run. The server itself: tests/test_real_cpu_omni3_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from harness.config import load_deploy, load_prompts
from harness.families.qwen3_omni import serve
from harness.serve.deploy_args import VENDOR_DEPLOY_DIR
from harness.stream_metrics import stream_failure

from clikit import _cli_in

SHIPPED = yaml.safe_load((VENDOR_DEPLOY_DIR / serve.RELEASE_DEPLOY).read_text())


def test_the_cpu_stress_deploy_is_the_release_yaml_with_the_deploys_talker_and_the_cpu_profile():
    t = serve.translate(load_deploy("qwen3-omni-cpu-stress"), "cpu", speaking=True)
    assert t.cli_args == ("--deploy-config", "<deploy.yaml>") and t.stage_overrides == {}
    assert dict(t.env) == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    y = yaml.safe_load(t.deploy_yaml)
    assert (y["model_runner"], y["async_chunk"], "platforms" in y) == ("v1", True, False)
    assert y["connectors"] == SHIPPED["connectors"]  # the release's windows: 4, then 25 frames, 25 of left context
    thinker, talker, code2wav = y["stages"]
    assert {k: talker[k] for k in ("stage_id", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                                   "num_gpu_blocks_override", "block_size", "max_model_len", "enable_prefix_caching",
                                   "moe_backend", "input_connectors", "enforce_eager", "async_scheduling",
                                   "kv_cache_memory_bytes", "devices")} == {
        "stage_id": 1, "max_num_seqs": 4, "max_num_batched_tokens": 8, "enable_chunked_prefill": True,
        "num_gpu_blocks_override": 6, "block_size": 32, "max_model_len": 160, "enable_prefix_caching": False,
        "moe_backend": "auto", "input_connectors": {"from_stage_0": "connector_of_shared_memory"},
        "enforce_eager": True, "async_scheduling": False, "kv_cache_memory_bytes": 256 << 20, "devices": "1"}
    assert talker["default_sampling_params"] == SHIPPED["stages"][1]["default_sampling_params"]
    assert {k: thinker[k] for k in ("logits_processors", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
                                    "moe_backend", "devices")} == {
        "logits_processors": ["harness.serve.reply_forcer:ReplyForcer"], "max_num_seqs": 4, "max_model_len": 4096,
        "max_num_batched_tokens": 4096, "moe_backend": "auto", "devices": "0"}
    assert (code2wav["dtype"], code2wav["devices"], code2wav["max_num_seqs"], code2wav["enable_prefix_caching"]) == (
        "float32", "2", 1, False)
    assert not any("gpu_memory_utilization" in stage for stage in y["stages"])


def test_the_full_payload_twin_and_the_gpu_profile():
    """``-full-``: ``async_chunk: false``, otherwise the same deploy; on GPU the shipped MoE backend and memory
    fractions stay, the pinned Talker blocks keep their size, and a random checkpoint gets no reply forcer."""
    full = yaml.safe_load(serve.translate(load_deploy("qwen3-omni-cpu-full-stress"), "cpu", True).deploy_yaml)
    streamed = yaml.safe_load(serve.translate(load_deploy("qwen3-omni-cpu-stress"), "cpu", True).deploy_yaml)
    assert full["async_chunk"] is False and {**full, "async_chunk": True} == streamed
    gpu = yaml.safe_load(serve.translate(load_deploy("qwen3-omni-stress"), "gpu", False).deploy_yaml)
    thinker, talker, code2wav = gpu["stages"]
    assert (talker["moe_backend"], talker["num_gpu_blocks_override"], talker["block_size"]) == ("triton", 42, 16)
    assert (thinker["gpu_memory_utilization"], talker["gpu_memory_utilization"]) == (0.9, 0.6)
    assert "logits_processors" not in thinker and "kv_cache_memory_bytes" not in talker and "dtype" not in code2wav
    assert [s["devices"] for s in gpu["stages"]] == ["0", "1", "1"]  # the release's


def test_the_chat_request_forces_the_reply_and_takes_the_releases_code2wav_sampling():
    prompts = load_prompts("qwen3_omni_cpu")
    p = prompts.prompts[0]
    body = serve.request_body("/m", prompts, p, load_deploy("qwen3-omni-cpu-stress"), "omni-stress-o01-tea-ab",
                              speaking=True, stream=True)
    assert body["messages"][1]["content"][0]["text"] == "How do I make green tea?" and body["stream"] is True
    thinker, talker, code2wav = body["sampling_params_list"]
    assert thinker["extra_args"] == {"omni_stress_reply": p.reply}
    assert {k: talker[k] for k in ("temperature", "top_p", "top_k", "seed", "max_tokens")} == {
        "temperature": 0.9, "top_p": 1.0, "top_k": 50, "seed": 42, "max_tokens": 100}
    assert code2wav == {**SHIPPED["stages"][2]["default_sampling_params"], "detokenize": True}
    assert code2wav["max_tokens"] == 65536


def test_the_window_rule_and_the_decoders_trimmed_edge():
    rule = serve.chunk_rule()
    assert (rule.initial_frames, rule.chunk_frames, rule.left_context) == (4, 25, 25)
    assert rule.boundaries(74) == [4, 25, 25, 20]
    # the tiny checkpoint on 0.30.0: 74 frames streamed as 141,525 samples, 555 short of 74 x 1,920 (the
    # decoder's right edge): whole; one frame fewer is a lost frame
    assert stream_failure(141525, 74, serve.SAMPLES_PER_CODEC_FRAME, serve.STREAM_END_TRIM) is None
    assert stream_failure(141525 - 1920, 74, serve.SAMPLES_PER_CODEC_FRAME, serve.STREAM_END_TRIM) == (
        "truncated audio: 139605 samples, its 74 codec frames decode to 142080 (1.28906 frames missing)")
    assert serve.oracle([]) == ""


def test_a_dry_run_names_the_deploy_yaml_the_chunker_and_the_spans_level(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "omni_stress_tiny_model.json").write_text(json.dumps({"speaking": True}))
    r = _cli_in(tmp_path, "run", "--backend", "vllm-omni", "--family", "qwen3-omni", "--model", str(model),
                "--platform", "cpu", "--arm", "omni3-fix", "--deploy", "qwen3-omni-cpu-stress", "--prompts",
                "qwen3_omni_cpu", "--stream", "--dry-run", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "OMNI_STRESS_TRACE_LEVEL=spans" in out and "OMNI_STRESS_ARM=harness.families.qwen3_omni.fix:Qwen3OmniFixedTalker" in out
    assert ("OMNI_STRESS_CHUNKER=vllm_omni.model_executor.stage_input_processors.qwen3_omni:"
            "talker2code2wav_async_chunk") in out
    assert "OMNI_STRESS_TRACE_TARGET=vllm_omni.model_executor.models.qwen3_omni.qwen3_omni:" \
           "Qwen3OmniMoeForConditionalGeneration" in out
    assert "--deploy-config" in out and "#     moe_backend: auto" in out
    assert "POST http://127.0.0.1:$PORT/v1/chat/completions" in out
