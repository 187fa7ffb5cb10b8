"""Issue 45, item 1: the sim's runners and conform call every hook the release's runners call, in their order,
with their fallbacks (``harness.sim.hooks``), so a wrong hook that only one runner calls is caught there.

Pure resolution rules first, then the near-miss arms of ``tests.fixtures.tts_mutants`` through the runner,
then as a user runs and gates them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from harness.errors import UserError
from harness.sim import hooks


class _Both:
    def preprocess_decode_batch(self, *, input_ids, req_infos, input_embeds=None):
        return ("v1-hook", input_embeds)

    def preprocess_decode_batch_mrv2(self, *, input_ids, input_embeds, req_infos):
        return ("mrv2-hook", input_embeds)


class _V1Only:
    def preprocess_decode_batch(self, *, input_ids, req_infos):  # no input_embeds: MRV2 must not pass them
        return ("v1-hook", None)


class _Batch:
    def __init__(self):
        self.calls = []

    def preprocess_batch(self, *, req_ids, model_intermediate_buffer, device):
        self.calls.append(("v1", list(req_ids), sorted(model_intermediate_buffer)))

    def preprocess_batch_mrv2(self, *, req_infos, device):
        self.calls.append(("v2", [i["request_id"] for i in req_infos]))


def test_decode_hook_resolution_follows_each_runner():
    ids, emb = torch.tensor([5]), torch.ones(1, 4)
    assert hooks.decode_hook_name(_Both(), "v1") == "preprocess_decode_batch"
    assert hooks.decode_hook_name(_Both(), "v2") == "preprocess_decode_batch_mrv2"
    assert hooks.decode_hook_name(_V1Only(), "v2") == "preprocess_decode_batch"  # MRV2's fallback
    assert hooks.decode_hook_name(object(), "v1") is None and hooks.decode_hook_name(object(), "v2") is None
    # V1 never hands the hook the runner's embeddings; MRV2 does where the hook takes them
    assert hooks.decode_hook(_Both(), "v1")(input_ids=ids, input_embeds=emb, req_infos=[{}]) == ("v1-hook", None)
    name, got = hooks.decode_hook(_Both(), "v2")(input_ids=ids, input_embeds=emb, req_infos=[{}])
    assert name == "mrv2-hook" and got is emb
    assert hooks.decode_hook(_V1Only(), "v2")(input_ids=ids, input_embeds=emb, req_infos=[{}]) == ("v1-hook", None)


def test_prefill_batch_hook_per_runner():
    m = _Batch()
    buffers = {"a": {"request_id": "a"}, "b": {"request_id": "b"}, "c": {"request_id": "c"}}
    assert hooks.prefill_batch(m, "v1", ["b", "a"], buffers, ["a"], torch.device("cpu")) == "preprocess_batch"
    assert hooks.prefill_batch(m, "v2", ["b", "a"], buffers, ["a"], torch.device("cpu")) == "preprocess_batch_mrv2"
    assert hooks.prefill_batch(m, "v2", ["b"], buffers, [], torch.device("cpu")) == "preprocess_batch_mrv2"
    assert m.calls == [("v1", ["b", "a"], ["a", "b", "c"]), ("v2", ["a"])]  # MRV2: prefill buffers only, if any
    assert hooks.prefill_batch(object(), "v1", ["a"], buffers, ["a"], torch.device("cpu")) is None


def test_an_arm_on_a_path_the_sim_does_not_model_is_refused():
    from harness.sim.runner import SimRunner

    class FillsRows:
        preprocess_batch_fills_rows = True

    with pytest.raises(UserError, match=r"arm 'x': it sets preprocess_batch_fills_rows .* a path the sim does not "
                                        r"model"):
        SimRunner(FillsRows(), None, ("x", "d", 1), None)


def test_the_cli_refuses_such_an_arm_in_one_line(tmp_path: Path):
    from conftest import invoke_cli

    res = invoke_cli("run", "--asr", "none", "--quiet", "--out", str(tmp_path), "--run-id", "r", "--prompts", "qwen3_tts",
                     "--arm", "fills=tests.fixtures.tts_mutants:FillsRows", "--deploy", "qwen3-tts-reference",
                     "--sim-workers", "0")
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1, res.stderr
    assert "arm 'fills': it sets preprocess_batch_fills_rows" in lines[0] and "a path the sim does not model" in lines[0]


def test_the_release_hooks_are_compiled_with_its_preprocess():
    from harness.config import load_arms
    from harness.talkers import load_impl

    impl = load_impl(load_arms()["tts-0.30.0"])
    methods = impl.omni_stress_upstream.methods
    assert methods[:2] == ("preprocess", "preprocess_decode_batch")
    assert {"preprocess_decode_batch_mrv2", "preprocess_batch", "preprocess_batch_mrv2"} <= set(methods)


# --------------------------------------------------------------------------- near misses through the runner

def _drive_decodes(arm_target: str, deploy: str) -> tuple[list[int], list[int]]:
    """A prefill and four decodes of one request; the misaligned count of each span and the text id each
    decode position holds."""
    from types import SimpleNamespace

    from harness.config import ArmSpec, load_deploy, load_prompts
    from harness.family import get_family
    from harness.talkers import load_impl

    arm = ArmSpec(name="x", talker=arm_target, role="candidate", family="qwen3-tts", source="--arm")
    d = load_deploy(deploy)
    ps = load_prompts("qwen3_tts")
    cell = get_family("qwen3-tts").sim_cell(load_impl(arm), d, ps, 42, "words")
    runner = cell.runner_class(cell.model, cell.space, ("x", deploy, 1), cell.contract, d.talker.model_runner)
    out = cell.requests[0]
    runner.add_request(out, out.payload({}), 4096)
    P, gen, spans = out.P, [500, 501, 502, 503], []
    for i, (c, n) in enumerate([(0, P)] + [(P + k, 1) for k in range(4)]):
        req = SimpleNamespace(request_id=out.request_id, prompt_token_ids=out.talker_prompt_ids,
                              all_token_ids=out.talker_prompt_ids + gen[:max(0, c + n - P)],
                              sampling_params=SimpleNamespace(max_tokens=640, seed=42))
        runner.begin_step([(out.request_id, c, n)])
        spans.append(runner.call(req, c, n, i).span.misaligned)
    kv = runner.kv[out.request_id]
    return spans, [int(t) - out.text_first_id for t in kv._text_np[P:P + 4]]


def test_an_mrv2_fast_path_is_run_on_mrv2_only():
    target = "tests.fixtures.tts_mutants:MRV2StaleText"
    assert _drive_decodes(target, "qwen3-tts-stress") == ([0, 0, 0, 0, 0], [1, 2, 3, 4])  # V1: never called
    # MRV2 calls it for every decode: each position gets trailing_text[0] (text 1)
    assert _drive_decodes(target, "qwen3-tts-mrv2-stress") == ([0, 0, 1, 1, 1], [1, 1, 1, 1])


@pytest.mark.slow
def test_the_gate_catches_each_near_miss_on_the_runner_that_calls_its_hook(tmp_path: Path):
    """Both near misses as a user runs them: each fails on the runner that calls its hook and only there (the
    MRV2 fast path on the MRV2 deploys, V1's ``preprocess_batch`` on the V1 deploys); the fix passes all."""
    res = run_cli("run", "--asr", "none", "--quiet", "--out", str(tmp_path), "--run-id", "hooks",
                  "--prompts", "qwen3_tts", "--arm", "tts-fix",
                  "--arm", "stale=tests.fixtures.tts_mutants:MRV2StaleText",
                  "--arm", "first=tests.fixtures.tts_mutants:BatchPromptOfFirst",
                  "--deploy", "qwen3-tts-reference", "--deploy", "qwen3-tts-stress",
                  "--deploy", "qwen3-tts-mrv2-reference", "--deploy", "qwen3-tts-mrv2-stress")
    assert res.exit_code == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "hooks" / "requests.jsonl").read_text().splitlines()]
    mis: dict[tuple[str, str], int] = {}
    for r in rows:
        key = (r["arm"], r["deploy"])
        mis[key] = mis.get(key, 0) + r["events"]["misaligned_text_positions"]
    assert {k: v for k, v in mis.items() if k[0] == "tts-fix"} == {
        ("tts-fix", d): 0 for d in ("qwen3-tts-reference", "qwen3-tts-stress", "qwen3-tts-mrv2-reference",
                                     "qwen3-tts-mrv2-stress")}
    assert mis[("stale", "qwen3-tts-reference")] == mis[("stale", "qwen3-tts-stress")] == 0
    assert mis[("stale", "qwen3-tts-mrv2-reference")] > 0 and mis[("stale", "qwen3-tts-mrv2-stress")] > 0
    # V1 calls preprocess_batch; MRV2 calls preprocess_batch_mrv2 (the release's, which the arm left alone)
    assert mis[("first", "qwen3-tts-reference")] > 0 and mis[("first", "qwen3-tts-stress")] > 0
    assert mis[("first", "qwen3-tts-mrv2-reference")] == mis[("first", "qwen3-tts-mrv2-stress")] == 0
    gate = run_cli("gate", str(tmp_path / "hooks"))
    assert gate.exit_code == 1, gate.stdout[-3000:]
    verdict = [ln for ln in gate.stdout.splitlines() if "-> FAIL" in ln]
    assert len(verdict) == 1 and verdict[0].endswith(
        "-> FAIL (candidate-contract, candidate-reference-speaks, candidate-stress-matches-reference failed; "
        "arms stale (candidate), first (candidate)) (exit 1)"), verdict


# --------------------------------------------------------------------------- item 2: the code predictor's input

def test_the_past_hidden_state_is_checked_on_every_decode():
    """Right rows, wrong ``past_hidden``: the position is misaligned (the sim carries the Talker's hidden state
    per request and position, and the release's postprocess leaves the span's last one in the buffer)."""
    assert _drive_decodes("harness.families.qwen3_tts.fix:Qwen3TTSFixedTalker", "qwen3-tts-stress") == (
        [0, 0, 0, 0, 0], [1, 2, 3, 4])
    # zeros: every decode; the text rows are right
    assert _drive_decodes("tests.fixtures.tts_mutants:ZeroPastHidden", "qwen3-tts-stress") == (
        [0, 1, 1, 1, 1], [1, 2, 3, 4])
    # one call late: the first decode is right (nothing cached yet), every later one gets its predecessor's
    assert _drive_decodes("tests.fixtures.tts_mutants:PastHiddenOfLastCall", "qwen3-tts-mrv2-stress") == (
        [0, 0, 1, 1, 1], [1, 2, 3, 4])


def _misaligned_by_cell(run_dir: Path) -> dict[tuple[str, str], tuple[int, int]]:
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for line in (run_dir / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        t, e = out.get((r["arm"], r["deploy"]), (0, 0))
        out[(r["arm"], r["deploy"])] = (t + r["events"]["misaligned_text_positions"],
                                         e + r["events"]["misaligned_end_positions"])
    return out


@pytest.mark.slow
def test_the_gate_catches_a_wrong_code_predictor_input_in_both_mtp_families(tmp_path: Path):
    res = run_cli("run", "--asr", "none", "--quiet", "--out", str(tmp_path), "--run-id", "tts",
                  "--prompts", "qwen3_tts", "--arm", "tts-fix",
                  "--arm", "zero=tests.fixtures.tts_mutants:ZeroPastHidden",
                  "--arm", "late=tests.fixtures.tts_mutants:PastHiddenOfLastCall",
                  "--deploy", "qwen3-tts-reference", "--deploy", "qwen3-tts-stress")
    assert res.exit_code == 0, res.stdout[-2000:] + res.stderr[-2000:]
    mis = _misaligned_by_cell(tmp_path / "tts")
    assert mis[("tts-fix", "qwen3-tts-reference")] == mis[("tts-fix", "qwen3-tts-stress")] == (0, 0)
    for arm in ("zero", "late"):
        for deploy in ("qwen3-tts-reference", "qwen3-tts-stress"):
            text, end = mis[(arm, deploy)]
            assert text > 100 and end > 100, (arm, deploy, text, end)
    gate = run_cli("gate", str(tmp_path / "tts"))
    verdict = [ln for ln in gate.stdout.splitlines() if "-> FAIL" in ln]
    assert gate.exit_code == 1 and len(verdict) == 1, gate.stdout[-3000:]
    assert verdict[0].endswith("arms zero (candidate), late (candidate)) (exit 1)"), verdict
    res = run_cli("run", "--asr", "none", "--quiet", "--out", str(tmp_path), "--run-id", "omni3",
                  "--prompts", "qwen3_omni", "--arm", "omni3-fix",
                  "--arm", "stale=tests.fixtures.omni3_mutants:StalePastHidden", "--deploy", "qwen3-omni-reference")
    assert res.exit_code == 0, res.stdout[-2000:] + res.stderr[-2000:]
    mis = _misaligned_by_cell(tmp_path / "omni3")
    assert mis[("omni3-fix", "qwen3-omni-reference")] == (0, 0)
    assert sum(mis[("stale", "qwen3-omni-reference")]) > 100
