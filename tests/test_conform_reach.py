"""``omni-stress conform``'s reachability: which shipped deploy of the release reaches each failure.

Reads the vendored vLLM-Omni 0.30.0 deploy files (``harness/conform/vendor``, hashes pinned
below), forced schedules only, one request, 24 generated positions.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner

from harness.conform.adapter import VENDOR_DIR, Adapter, ConformRequest, fixed_tokens
from harness.conform.check import ModelResult, check_model
from harness.conform.models import MODELS
from harness.conform.reach import ModelDeploys, load_shipped, needs_of, resolve_deploy, targets

DEPLOYS = {
    "fish_qwen3_omni.yaml": "f040b6da8a2245e7f927e84469de4ffe23283a1365895f423fe6305f2841095e",
    "fish_qwen3_omni_2gpu.yaml": "2f37919f02a7362ea7339b7374674c4b918d08b9af19fca7138ebcc5242ab1da",
    "fish_qwen3_omni_high_concurrency_dual_gpu.yaml": "46336904b59fdc89c6afb28841b5ad108759b3a5e2058661b8cc57214bc8fa1c",
    "fish_qwen3_omni_high_concurrency_single_gpu.yaml": "74af7323ebb7ad95ce7004e16bb55376ab96517376042fc244e02ff70e15b6ab",
    "gepard.yaml": "361956ed9f78e8aa8704b2e1ccd71f4eabbf8a44d63bb72a6b708c5f451a09b4",
    "moss_tts.yaml": "d67c3dc4c43a3ed221fbd625d4e45f39360178fd551f9b9ea9324a551c7aca68",
    "moss_tts_80gb.yaml": "857bc4c86fc3570b78913ce545633e9eee63d8aed4b6ad02bb20a14305976ade",
    "moss_ttsd.yaml": "872bc25c1f49993268240ecbeaa18159dfb09ebcaf54afaea2ebd232616c9dea",
    "moss_sound_effect.yaml": "e5a7a272da1e826811a5b6c01770a02352be6ed113987ab023279751ed8cc309",
    "moss_voice_generator.yaml": "07360c0de89b4605b66023b14dd29ee7e40b349dbd337152d18b426033052888",
    "glm_tts.yaml": "8d0c5ffbb5fcc7ecd71ef125a2ee9dd778c037d45241d3e0ac6f4ac4bb9c4995",
    "qwen2_5_omni.yaml": "d251d8e66f80bdededeb5e6e6f8199a8c4f7c8ae79430ef67befbb0178946a6f",
    "qwen3_omni_moe.yaml": "df882aa6ccc28a998dace784977b6d1dbf6c3225eb50b29f5aee2b9981ddd898",
    "qwen3_omni_duplex.yaml": "75def35dbb839162f69c82172a4b658ccee2027767920d43454cc3a3f7750301",
    "qwen3_omni_moe_mori_intranode.yaml": "6c7aa8eb6b21557442220d67b7983f98dd4f9e7b8a19a19f58fd7a3e3d537c96",
    "qwen3_tts.yaml": "28426bce3af2cb7c3f750f592a7ca0f339e947c617b80c730585b882ae4d6e0f",
    "qwen3_tts_mrv2.yaml": "a8a53c790e576030d5ce0e0a79e574f418a9c27e206183030e1c77bb94e79d7e",
    "qwen3_tts_high_concurrency.yaml": "144fa42e39ce260594a8529af9e0cd1214ddbc51ad9cdf0c83019c2372c6c590",
    "qwen3_tts_high_concurrency_mrv2.yaml": "08861396a815376e505f4d495e3591a62ae10c9eccd8d74d9443292c77883a00",
    "qwen3_tts_high_concurrency_mrv2_b4.yaml": "aa90187d94b4f41d8fc351c2a2226a72cad5014624e53d829948bdbc83ca2627",
    "qwen3_tts_high_concurrency_mrv2_single_gpu.yaml":
        "f8a1312b5613c4a35dd65ee5af8ecc27978b861d20cb3d7a14249d4d046a7cd6",
    "minicpmo_4_5.yaml": "9099f1834161c9f10b6f309d8134e38838b5e054a9f8be7a62134b9cb67c75d6",
    "minicpmo_4_5_2gpu.yaml": "24c851ebe34df137c29203e5cc3d76487e2c7168a52414f606d1e324b58f22d8",
    "minicpmo_4_5_3gpu.yaml": "5ead9f4a0aba1a6e2efb347991b73ff0a04ee150999d095112f2840dc387392e",
    "minicpmo_4_5_3gpu_stage1_replicas.yaml": "b001dd3c994c28491d3db19dff2160ea2e3ac793010a7fe637485f145858adab",
    "minicpmo_4_5_4gpu_stage1_replicas.yaml": "3cd3b027e53470103cf4219a3746928ff5e41cb7f81fc89afab78a6df66ad78f",
    "minicpmo_4_5_8x4090.yaml": "c834b9012fb62aca38b989d7a4cb26153c8281d7d2b2b0ff4d8b4e3d7f7d0c48",
    "minicpmo_4_5_8x4090_stage1_replicas.yaml": "1a9cbfa46e6e4bf8183c7134e1a6e98a9b835574335e88e27242d2953d4c6cbd",
    "minicpmo_4_5_turn.yaml": "f2d1353a031cdd709e9b401f2dc2266b8dd4c63c4fca613addaa1e6fd03c3bdd",
}
GEN = 24
SHIPPED_TTS = ("fails under shipped deploy qwen3_tts.yaml (rocm, npu, xpu, musa), qwen3_tts_mrv2.yaml (rocm, npu, xpu, "
               "musa), qwen3_tts_high_concurrency.yaml (cuda, npu), qwen3_tts_high_concurrency_mrv2.yaml (npu, xpu, "
               "rocm, musa), qwen3_tts_high_concurrency_mrv2_b4.yaml (npu, xpu, rocm, musa), "
               "qwen3_tts_high_concurrency_mrv2_single_gpu.yaml (npu, xpu, rocm, musa)")


def _check(name: str, source: str = "0.30.0", **kw: Any) -> ModelResult:
    return check_model(MODELS[name](), source, (), requests=1, forced_generated=GEN, **kw)


def test_vendored_deploy_files_are_the_pinned_0_30_0_files() -> None:
    for name, sha in DEPLOYS.items():
        data = (VENDOR_DIR / "vllm_omni" / "deploy" / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha, name


def test_deploys_resolve_base_config_and_platform_runners() -> None:
    md = MODELS["qwen3-tts"]().deploys
    deploy, shas = resolve_deploy("0.30.0", "qwen3_tts_mrv2.yaml")
    assert shas == [DEPLOYS["qwen3_tts_mrv2.yaml"], DEPLOYS["qwen3_tts.yaml"]]  # base_config: qwen3_tts.yaml
    ts = targets(deploy, "qwen3_tts_mrv2.yaml", md)
    # MRV2 on cuda; every other platform names v1 (npu/xpu refuse v2 anyway)
    assert [(t.platform, t.runner) for t in ts] == [("cuda", "v2"), ("rocm", "v1"), ("npu", "v1"), ("xpu", "v1"),
                                                    ("musa", "v1")]
    assert ts[0].settings() == ("stage 0: max_num_batched_tokens 512, max_num_seqs 64, max_model_len 4096, "
                                "gpu_memory_utilization 0.3, model_runner v2, async_chunk true")
    assert ts[0].reach("chunking") == (True, "64 prompts of 9+ tokens exceed the 512-token budget")
    # the Qwen3-Omni thinker-only deploy has no Talker stage, so it is no target; mori leaves settings to vLLM
    q3 = load_shipped(MODELS["qwen3-omni"]().deploys, "0.30.0")
    mori = [t for t in q3.targets if t.deploy == "qwen3_omni_moe_mori_intranode.yaml"]
    assert [t.defaulted for t in mori] == [("max_num_batched_tokens", "max_num_seqs", "max_model_len")]
    assert {t.platform: t.budget for t in q3.targets if t.deploy == "qwen3_omni_moe.yaml"} == {
        "cuda": 32768, "musa": 32768, "npu": 8192, "rocm": 32768, "xpu": 32768}


def test_each_mechanism_against_the_shipped_settings() -> None:
    q25 = load_shipped(MODELS["qwen2.5-omni"]().deploys, "0.30.0").targets
    assert [t.platform for t in q25] == ["cuda", "npu", "xpu"]
    assert q25[0].reach("chunking") == (False, "1 x a prompt of at most max_model_len 32768 tokens never exceeds the "
                                               "32768-token budget")
    assert q25[0].reach("preemption") == (False, "max_num_seqs 1: no second request to make room for")
    assert q25[0].reach("specdec") == (False, "no speculative_config")
    mc = {(t.deploy, t.platform): t for t in load_shipped(MODELS["minicpmo-4.5"]().deploys, "0.30.0").targets}
    # CUDA caps the Talker's KV cache above 4 x 4096 tokens ("physical-preemption replay is unsupported"); NPU does not
    assert mc["minicpmo_4_5.yaml", "cuda"].reach("preemption") == (
        False, "kv_cache_memory_bytes 2147483648 holds 34952 tokens >= max_num_seqs x max_model_len = 16384")
    assert mc["minicpmo_4_5.yaml", "npu"].reach("preemption") == (
        True, "gpu_memory_utilization 0.15: the device decides; 4 x 4096 = 16384 tokens can outgrow it")
    # the stage-1-replica deploys lift the cap (kv_cache_memory_bytes: null on cuda)
    assert mc["minicpmo_4_5_3gpu_stage1_replicas.yaml", "cuda"].reach("preemption")[0] is True
    assert mc["minicpmo_4_5_8x4090.yaml", "cuda"].reach("preemption") == (
        False, "max_num_seqs 1: no second request to make room for")


def test_what_a_span_needs() -> None:
    def n(c: int, k: int, replay: int = 0) -> tuple[str, ...]:
        return needs_of({"P": 20, "c": c, "n": k, "replay": replay})

    assert n(0, 20) == () and n(20, 1) == ()  # the whole prompt, a one-token decode: every request
    assert n(10, 10) == ("chunking",) and n(19, 1) == ("chunking",) and n(0, 10) == ("chunking",)
    assert n(24, 3) == ("specdec",)  # a decode span of n > 1 outside a replay: a verify span
    assert n(0, 27, replay=1) == ("preemption",)
    assert n(18, 9, replay=1) == ("chunking", "preemption")


def test_verdicts_name_the_shipped_deploy_or_the_settings() -> None:
    q25 = _check("qwen2.5-omni")
    assert q25.reach_status == "only"
    assert q25.verdict == (
        "fails only with chunked prefill or preemption or speculative decoding (chunked prefill: prompts scheduled "
        "together longer than max_num_batched_tokens; preemption: max_num_seqs > 1 and a KV cache smaller than "
        "max_num_seqs x max_model_len tokens; speculative decoding: speculative_config on the stage)")
    assert q25.reach.note == (
        "qwen2_5_omni.yaml (cuda, npu, xpu): 1 x a prompt of at most max_model_len 32768 tokens never exceeds the "
        "32768-token budget\n  qwen2_5_omni.yaml (cuda, npu, xpu): no speculative_config\n  qwen2_5_omni.yaml (cuda, "
        "npu, xpu): max_num_seqs 1: no second request to make room for")
    assert q25.reach.cells["chunk"].text == "only with chunked prefill"
    assert q25.reach.cells["multi_decode"].text == "only from speculative decoding"
    assert q25.reach.cells["cross_replay"].text == "only with chunked prefill + preemption"
    tts = _check("qwen3-tts")
    # the replays fail under V1 (rocm, npu, ... and high_concurrency's cuda); MRV2 on cuda is not modelled here
    assert tts.reach_status == "shipped" and tts.verdict == SHIPPED_TTS
    assert tts.reach.cells["repeated_replay"].text == "reached by shipped deploy" + SHIPPED_TTS[len("fails under "
                                                                                                  "shipped deploy"):]
    assert tts.reach.cells["multi_decode"].text == "only from speculative decoding"
    mc = _check("minicpmo-4.5")
    assert mc.verdict == (
        "fails under shipped deploy minicpmo_4_5.yaml (npu), minicpmo_4_5_turn.yaml (npu), minicpmo_4_5_2gpu.yaml "
        "(cuda, npu), minicpmo_4_5_3gpu.yaml (cuda, npu), minicpmo_4_5_3gpu_stage1_replicas.yaml (cuda, npu), "
        "minicpmo_4_5_4gpu_stage1_replicas.yaml (cuda, npu)")
    q3 = _check("qwen3-omni")
    assert q3.reach_status == "only"
    assert q3.verdict.startswith("fails only with preemption or speculative decoding (preemption: ")
    # every shipped Qwen3-Omni deploy streams (async_chunk: true): the full-payload row is reached by none
    assert q3.verdict.endswith("; no shipped deploy runs async_chunk: false on the v1 runner (they run "
                               "async_chunk: true)")


# ----------------------------------------------------------------------------- a toy with its own deploy file


class _Stand:
    def __init__(self) -> None:
        self.table = torch.randn(4096, 8, generator=torch.Generator().manual_seed(1))
        self.talker = self

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


class _WrongOnVerifySpans:
    """Position-addressed rows, except a decode span of n > 1 (outside a replay) gets zeros."""

    def talker_preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **info: Any):
        c, n, P = info["_omni_num_computed_tokens"], input_ids.shape[0], info["_omni_prompt_len"]
        g = torch.Generator().manual_seed(len(info["request_id"]))
        rows = torch.randn(200, 8, generator=g)[c:c + n]
        return input_ids, (torch.zeros(n, 8) if c >= P and n > 1 and n < 5 else rows), {}


class _Toy(Adapter):
    upstream = False
    hidden = 8
    name = title = "toy"
    deploys = ModelDeploys(("toy.yaml",), stage=0, max_model_len=4096)

    def load(self, spec: str, base_dir: Any = None, wheel_dir: Any = None) -> tuple[Any, Any]:
        return _WrongOnVerifySpans, None

    def stand_in_class(self) -> type:
        return _Stand

    def requests(self, count: int, generated: int) -> list[ConformRequest]:
        return [ConformRequest("r0", [7] * 20, {}, fixed_tokens("r0", generated + 1, 4096))]


def _toy_tree(tmp_path: Path, stage: str) -> Path:
    (tmp_path / "vllm_omni" / "deploy").mkdir(parents=True)
    (tmp_path / "vllm_omni" / "deploy" / "toy.yaml").write_text(f"async_chunk: false\nstages:\n  - stage_id: 0\n{stage}")
    return tmp_path


def test_only_the_verify_span_fails_says_only_from_speculative_decoding(tmp_path: Path) -> None:
    tree = _toy_tree(tmp_path, "    max_num_seqs: 8\n    max_num_batched_tokens: 4096\n")
    r = check_model(_Toy(), str(tree), (), requests=1, forced_generated=GEN)
    assert {k for k, c in r.cells.items() if c.status != "conforms"} == {"multi_decode"}
    assert (r.reach_status, r.verdict) == ("only", "fails only from speculative decoding")
    from harness.conform.report import Matrix

    assert Matrix("x", (), [r]).exit_code == 0 and Matrix("x", (), [r], fail_on="any").exit_code == 1


def test_a_deploy_with_speculative_decoding_reaches_it(tmp_path: Path) -> None:
    tree = _toy_tree(tmp_path, "    speculative_config:\n      method: ngram\n      num_speculative_tokens: 2\n")
    r = check_model(_Toy(), str(tree), (), requests=1, forced_generated=GEN)
    assert (r.reach_status, r.verdict) == ("shipped", "fails under shipped deploy toy.yaml (cuda)")


def test_no_deploy_files_means_reach_unknown_and_counts_as_shipped() -> None:
    from harness.conform.report import Matrix

    fixture = Path(__file__).parent / "fixtures" / "upstream" / "vllm_omni_0_30_0_qwen2_5_omni.py"
    r = _check("qwen2.5-omni", str(fixture))
    assert r.reach_status == "unknown"
    assert r.verdict == f"fails (reachability unknown: vllm-omni:{fixture} is a single file: it holds no deploy files)"
    assert Matrix("x", (), [r]).exit_code == 1


def _cli(*args: str) -> Any:
    from harness.cli import main as cli_main

    if "--source" not in args:  # these tests check one release: 0.30.0 (the default checks 0.32.0rc1 too)
        args = (*args, "--source", "vllm-omni:0.30.0")
    return CliRunner().invoke(cli_main, ["conform", *args], catch_exceptions=False)


def test_cli_fail_on() -> None:
    small = ["--deploy", "none", "--requests", "1", "--generated", "24"]
    only = _cli("--model", "qwen2.5-omni", *small)
    assert only.exit_code == 0, only.output
    assert ("verdict: 1 of 1 models do not conform; only with changed settings: qwen2.5-omni (exit 0 with --fail-on "
            "shipped; --fail-on any counts them) (exit 0)") in only.output
    assert _cli("--model", "qwen2.5-omni", *small, "--fail-on", "any").exit_code == 1
    shipped = _cli("--model", "qwen3-tts", *small)
    assert shipped.exit_code == 1
    assert f"qwen3-tts: {SHIPPED_TTS} -- " in shipped.output
    assert "verdict: 1 of 1 models do not conform (2 of 2 rows, one per model and runner mode); under a shipped deploy: qwen3-tts (exit 1)" \
        in shipped.output
    assert _cli("--model", "qwen3-tts", *small, "--fail-on", "nope").exit_code == 2


def test_minicpmo_prompt_is_llm2tts_own_branch() -> None:
    from harness.conform.adapter import read_model_source
    from harness.conform.models.minicpmo import SIP_MEMBER, llm2tts_prompt

    f, lines = llm2tts_prompt(read_model_source("0.30.0", SIP_MEMBER))
    assert lines == "1044-1049"
    assert f([5] * 59, [[0.0]] * 59, False) == ([0] * 61, 61)  # offline: max(len(ids), len(hidden)) + 2
    assert f([5] * 3, [[0.0]] * 7, True) == ([0] * 8, 8)  # native duplex: + 1
    req = MODELS["minicpmo-4.5"]()
    req.load("0.30.0")
    r = req.requests(1, 16)[0]
    assert (r.P, r.payload["meta"]["next_stage_prompt_len"]) == (61, 61)


# ----------------------------------------------------------------------------- plugin arms

PLUGIN = '''
class Passthrough:
    """The release's own hook, reached through super(): the same cells as the release."""

    def preprocess(self, input_ids, input_embeds, **info):
        return super().preprocess(input_ids=input_ids, input_embeds=input_embeds, **info)


class NoHook:
    pass
'''


def test_plugin_arms_for_any_model(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "conform_plugin_mod.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    small = ["--deploy", "none", "--requests", "1", "--generated", "24"]
    fixed = _cli("--model", "qwen2.5-omni:harness.families.qwen2_5_omni.pr:FixedTalker", *small)  # the form run/gate take
    assert fixed.exit_code == 0, fixed.output
    assert "qwen2.5-omni:harness.families.qwen2_5_omni.pr:FixedTalker: conforms -- plugin arm harness.families.qwen2_5_omni.pr:FixedTalker" \
        in fixed.output
    up = _check("qwen3-tts")
    plug = check_model(__import__("harness.conform.models", fromlist=["resolve_model"]).resolve_model(
        "qwen3-tts:conform_plugin_mod:Passthrough")(), "0.30.0", (), requests=1, forced_generated=GEN)
    assert plug.model == "qwen3-tts:conform_plugin_mod:Passthrough"
    assert plug.provenance.what == "plugin arm conform_plugin_mod:Passthrough over " + up.provenance.what
    assert {k: c.detail for k, c in plug.cells.items()} == {k: c.detail for k, c in up.cells.items()}
    assert plug.verdict == SHIPPED_TTS  # the model's shipped deploys
    no_hook = _cli("--model", "qwen3-tts:conform_plugin_mod:NoHook", *small)
    assert no_hook.exit_code == 2
    assert ("could not check: --model qwen3-tts:conform_plugin_mod:NoHook: class 'NoHook' defines no preprocess "
            "method (the hook this model's runner calls)") in no_hook.output
    missing = _cli("--model", "qwen3-omni:no_such_module_xyz:X", *small)
    assert missing.exit_code == 2 and "cannot import module 'no_such_module_xyz'" in missing.output
    unknown = _cli("--model", "nope:conform_plugin_mod:Passthrough", *small)
    assert unknown.exit_code == 2 and "unknown model" in unknown.output


# ----------------------------------------------------------------------------- MRV2's buffer rules


def test_mrv2_rebuilds_the_buffer_on_resume_and_moves_qwen3_tts_failure_to_P() -> None:
    v2 = check_model(MODELS["qwen3-tts"](), "0.30.0", (), requests=1, forced_generated=GEN, runner="v2")
    P = 9  # the release's CustomVoice prompt (issue 45 item 5; was 21 = 9 + words // 4)
    assert v2.model == "qwen3-tts@mrv2"
    # a fresh buffer: the replayed prompt is right again, but the generated positions inside the replay span
    # get tts_pad where the reference gives trailing_text row 0 (V1 fails at position 0 instead)
    f = v2.cells["cross_replay"].first
    assert (f.position, f.c, f.n, f.got, f.want) == (P, P - 2, 9, "the tts_pad row",
                                                     "its id's embedding + trailing_text row 0")
    f = v2.cells["repeated_replay"].first
    assert (f.position, f.c, f.n, f.got) == (P, 0, P + 7, "the tts_pad row")
    assert v2.cells["chunk"].status == v2.cells["tail"].status == "conforms"
    # each row counts only the (deploy, platform)s that run its runner: MRV2 is CUDA's
    assert v2.verdict == ("fails under shipped deploy qwen3_tts.yaml (cuda), qwen3_tts_mrv2.yaml (cuda), "
                          "qwen3_tts_high_concurrency_mrv2.yaml (cuda), qwen3_tts_high_concurrency_mrv2_b4.yaml "
                          "(cuda), qwen3_tts_high_concurrency_mrv2_single_gpu.yaml (cuda)")
    v1 = _check("qwen3-tts")
    assert v1.model == "qwen3-tts" and v1.cells["cross_replay"].first.position == 0


def test_the_cli_checks_qwen3_tts_under_both_runners() -> None:
    out = _cli("--model", "qwen3-tts", "--deploy", "none", "--requests", "1", "--generated", "24")
    assert out.exit_code == 1
    assert "verdict: 1 of 1 models do not conform (2 of 2 rows, one per model and runner mode); under a shipped deploy: qwen3-tts (exit 1)" \
        in out.output


def test_mrv2_driver_resets_a_decode_counter_on_preemption() -> None:
    from harness.conform.driver import run_forced
    from harness.conform.schedules import forced_schedules

    class Counter:
        def talker_preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **info: Any):
            k = info.get("k", 0)
            return input_ids, torch.full((input_ids.shape[0], 8), float(k)), {"k": k + 1}

    toy = _Toy()
    req = toy.requests(1, GEN)[0]
    sched = next(s for s in forced_schedules(req.P, req.P + GEN) if s.name == "cross-replay")
    first_after = {}
    for kind in ("v1", "v2"):
        feeds = run_forced(toy, Counter, req, sched, kind)
        replayed = next(f for f in feeds if f.replay == 1)
        first_after[kind] = float(replayed.received[0, 0])
    # V1 keeps the buffer: the counter runs on (1 prefill + 6 decodes = 7); MRV2 rebuilt it from the payload: 0
    assert first_after == {"v1": 7.0, "v2": 0.0}


def test_qwen3_omni_async_chunk_decode_path() -> None:
    """``async_chunk: true`` (every shipped Qwen3-Omni deploy): the Talker decodes text from the streamed
    ``cached_decode`` rows, indexed by its own ``num_processed_tokens`` counter. One chunk arrives before each
    call after the first; a chunked prefill caches one more row than the unchunked one, so the first decode
    position reads Thinker token 35 where 34 belongs: the failure needs chunking (an earlier span of the run)."""
    from harness.conform.reach import needs_of

    r = check_model(MODELS["qwen3-omni"](), "0.30.0", (), requests=1, forced_generated=GEN, async_chunk=True)
    assert r.model == "qwen3-omni@async" and r.error is None
    P = 28
    f = r.cells["chunk"].first
    assert (f.position, f.c, f.n) == (P, P, 1)
    assert (f.got, f.want) == ("its id's embedding + the projected Thinker embedding of token 35",
                               "its id's embedding + the projected Thinker embedding of token 34")
    assert needs_of(r.cells["chunk"].trigger) == ("chunking",)
    assert r.reach.cells["chunk"].needs == ("chunking",)
    assert r.verdict.startswith("fails under shipped deploy qwen3_omni_moe.yaml (cuda, musa, npu, rocm, xpu), "
                                "qwen3_omni_duplex.yaml")
    # the full-payload row is the one no shipped deploy runs
    assert r.cells["multi_decode"].first.position == P + 4
    # a plain decode step that differs in a vLLM run takes its needs from the run's earlier spans
    assert needs_of({"P": P, "c": P + 3, "n": 1, "replay": 0, "vllm": 1, "history": [[0, 14, 0], [14, 14, 0]]}) \
        == ("chunking",)
    assert needs_of({"P": P, "c": 0, "n": P + 2, "replay": 1, "vllm": 1, "history": [[0, 14, 0]]}) \
        == ("preemption",)


def test_mrv2_with_async_chunk_is_not_modelled_on_the_prerelease() -> None:
    from harness.talkers.release import vendor_dir

    r = check_model(MODELS["qwen3-omni"](), str(vendor_dir("0.32.0rc1")), (), requests=1, forced_generated=GEN,
                    async_chunk=True)
    assert r.error is None and r.reach is not None
    assert r.reach.to_json()["cells"]["chunk"]["unmodelled"][0].startswith(
        "qwen3_omni_duplex_mrv2.yaml (cuda), qwen3_omni_moe_mrv2.yaml (cuda), qwen3_omni_moe_mrv2_h200.yaml (cuda) "
        "reach it with MRV2 with async_chunk: true")


def test_v1_leaves_stale_buffer_rows_for_models_that_are_not_multimodal() -> None:
    """V1 hands a model without multimodal support its persistent ``inputs_embeds`` rows: a row the hook does
    not fill keeps what an earlier step left at that buffer index (here the prefill's row 1), where MRV2 (and
    V1 for a multimodal model) starts from the ids' embeddings."""
    from harness.conform.driver import run_forced
    from harness.conform.schedules import forced_schedules

    class OneRowOnMultiDecode:
        def talker_preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **info: Any):
            c, n = info["_omni_num_computed_tokens"], input_ids.shape[0]
            rows = torch.stack([torch.full((8,), float(c + i)) for i in range(n)])
            return input_ids, rows[:1] if (n > 1 and c >= info["_omni_prompt_len"]) else rows, {}

    class Stale(_Toy):
        stale_rows = True

        def load(self, spec: str, base_dir: Any = None, wheel_dir: Any = None) -> tuple[Any, Any]:
            return OneRowOnMultiDecode, None

    toy = Stale()
    req = toy.requests(1, GEN)[0]
    sched = next(s for s in forced_schedules(req.P, req.P + GEN) if s.name == "multi-decode")
    got = {}
    for kind in ("v1", "v2"):
        span = next(f for f in run_forced(toy, OneRowOnMultiDecode, req, sched, kind) if f.n == 3)
        got[kind] = span.received[1]
    assert torch.equal(got["v1"], torch.full((8,), 1.0))  # prefill [0, P) wrote row 1 of the buffer: position 1's
    assert torch.equal(got["v2"], _Stand().table[req.tokens[req.P + 5]])  # MRV2: the id's embedding
    r = check_model(toy, "0.30.0", (), requests=1, forced_generated=GEN, runner="v1")
    f = r.cells["multi_decode"].first
    assert f.position == req.P + 5 and f.got.startswith(
        "the stale buffer row the span started with (V1's persistent inputs_embeds, never written for this "
        "position; left by an earlier step: the reference row of position 1)")
    assert "the stale rows of its persistent inputs_embeds buffer" in r.cells["row_count"].detail


def test_restart_after_preemption_is_its_own_verdict() -> None:
    """The #6179 class: after a preemption, a generated position re-receives a start row (what the preprocess
    gave one of the first generated positions). Qwen3-Omni's trailing_text queue and Qwen3-TTS under MRV2
    (buffer rebuilt) restart; Qwen3-TTS under V1 (its replayed prompt is wrong instead), Qwen3-Omni's streamed
    counter (it jumps ahead) and the fix do not."""
    q3 = _check("qwen3-omni")
    cell = q3.cells["restart"]
    assert cell.status == "differs" and cell.summary.startswith("restarts @")
    p = int(cell.summary.split("@")[1])
    assert p > 28 and "re-receives the start row of position 28" in cell.detail
    assert q3.restart_verdict.startswith(f"restarts after a preemption: generated position {p} re-receives a start "
                                         "row (the upstream #6179 class); only with")
    assert _check("qwen3-tts", runner="v2").cells["restart"].summary.startswith("restarts @")
    assert _check("qwen3-tts").restart_verdict == "no restart after a preemption"
    a = check_model(MODELS["qwen3-omni"](), "0.30.0", (), requests=1, forced_generated=GEN, async_chunk=True)
    assert a.cells["restart"].status == "conforms"
    assert check_model(MODELS["qwen2.5-omni:pr"](), "0.30.0", (), requests=1,
                       forced_generated=GEN).cells["restart"].summary == "no restart"
