"""Issue 30: the qwen3-tts family on the sim.

Unit tests drive the family's runner path with forced spans (a prefill, decodes, a preemption, the
replay) and check the row identity every position receives, for the release's own ``preprocess``
(vendored 0.30.0) under V1 and MRV2 and for the fix; the end-to-end tests run the CLI as a user does
(``omni-stress run --family qwen3-tts``) and gate the result.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import REPO, SMALL_PROMPTS, run_cli
from harness.config import load_arms, load_deploy, load_prompts
from harness.families.qwen3_tts.contract import PROMPT_LEN, TTSRowRef, expected_row
from harness.sim.codec import CODEC_BOS, CODEC_PAD
from harness.sim.rows import NONE


def test_contract_rows_of_a_four_token_text():
    rows = [expected_row(p, PROMPT_LEN, 4) for p in range(15)]
    assert rows == [
        TTSRowRef("role 0", "none"), TTSRowRef("role 1", "none"), TTSRowRef("role 2", "none"),
        TTSRowRef("tts_pad", "nothink"), TTSRowRef("tts_pad", "think_bos"), TTSRowRef("tts_pad", "think_eos"),
        TTSRowRef("tts_pad", "speaker"), TTSRowRef("tts_bos", "pad"), TTSRowRef("text 0", "bos"),
        TTSRowRef("text 1", "own id"), TTSRowRef("text 2", "own id"), TTSRowRef("text 3", "own id"),
        TTSRowRef("tts_eos", "own id"), TTSRowRef("tts_pad", "own id"), TTSRowRef("tts_pad", "own id"),
    ]
    with pytest.raises(ValueError, match="has 9 rows, got P=10"):
        expected_row(0, 10, 4)


# --------------------------------------------------------------------------- forced spans through the runner

def _cell(arm_name: str, deploy: str, prompts_n: int = 1):
    from harness.family import get_family
    from harness.talkers import load_impl

    arm = load_arms()[arm_name]
    d = load_deploy(deploy)
    ps = load_prompts("qwen3_tts")
    ps = replace(ps, prompts=ps.prompts[:prompts_n])
    cell = get_family(d.family).sim_cell(load_impl(arm), d, ps, 42, "words")
    runner = cell.runner_class(cell.model, cell.space, (arm_name, deploy, 1), cell.contract, d.talker.model_runner)
    out = cell.requests[0]
    runner.add_request(out, out.payload({}), 4096)
    return cell, runner, out


def _request(out, generated: list[int]):
    return SimpleNamespace(request_id=out.request_id, prompt_token_ids=out.talker_prompt_ids,
                           all_token_ids=out.talker_prompt_ids + generated,
                           sampling_params=SimpleNamespace(max_tokens=640, seed=42))


def _drive(arm_name: str, deploy: str) -> tuple[list[tuple[int, int]], dict, object]:
    """Prefill the prompt in one span, decode four positions, preempt, replay all 13 positions in one span,
    then decode position 13. Returns the (text id, codec id) each position 0..13 holds in the Talker's KV
    after the replay and the last decode, the spans' misaligned counts, and the request."""
    cell, runner, out = _cell(arm_name, deploy)
    P = out.P
    gen = [500, 501, 502, 503, 504]  # codec ids the Talker "sampled" (content codes)
    counts = {}
    req = _request(out, [])
    counts["prefill"] = runner.call(req, 0, P, 0).span
    for i in range(4):
        req = _request(out, gen[:i + 1])
        counts[f"decode {P + i}"] = runner.call(req, P + i, 1, 1 + i).span
    if load_deploy(deploy).talker.model_runner == "v2":
        runner.resumed(out, out.payload({}))
    req = _request(out, gen[:5])
    counts["replay"] = runner.call(req, 0, P + 4, 10).span
    counts["after"] = runner.call(req, P + 4, 1, 11).span
    kv = runner.kv[out.request_id]
    ids = list(zip(kv._text_np[:P + 5].tolist(), kv._codec_np[:P + 5].tolist()))
    return ids, counts, out


def test_the_release_on_v1_replays_the_prompt_as_tts_pad():
    ids, spans, out = _drive("tts-0.30.0", "qwen3-tts-stress")
    P, first = out.P, out.text_first_id
    pad = int(out.prompt_text_ids[3])  # tts_pad's identity (the prefix rows' text part)
    # the first pass was right: no misaligned position before the preemption
    assert spans["prefill"].misaligned == 0 and all(spans[f"decode {P + i}"].misaligned == 0 for i in range(4))
    # the replay slices the stored prompt from talker_prefill_offset (9, past its end): tts_pad rows, no codec
    assert ids[:P + 4] == [(pad, NONE)] * (P + 4)
    assert (spans["replay"].misaligned_text, spans["replay"].misaligned_end) == (P + 4, 0)
    # the text queue was not touched by the replay: position 13 gets trailing_text[4] (text 5), as it should
    assert ids[P + 4] == (first + 5, 504) and spans["after"].misaligned == 0


def test_the_release_on_mrv2_rebuilds_the_prompt_but_restarts_the_text():
    ids, spans, out = _drive("tts-0.30.0", "qwen3-tts-mrv2-stress")
    P, first = out.P, out.text_first_id
    pad = int(out.prompt_text_ids[3])
    expected_prompt = list(zip(out.prompt_text_ids.tolist(), out.prompt_codec_ids.tolist()))
    assert ids[:P] == expected_prompt  # the buffer was rebuilt: the prompt is sliced from 0 again
    assert ids[P:P + 4] == [(pad, NONE)] * 4  # the generated positions of the replay span: tts_pad, no codec
    assert (spans["replay"].misaligned_text, spans["replay"].misaligned_end) == (4, 0)
    # the rebuilt buffer's text offset is 0: position 13 gets trailing_text[0] (text 1) again, not text 5
    assert ids[P + 4] == (first + 1, 504) and spans["after"].misaligned_text == 1


@pytest.mark.parametrize("deploy", ["qwen3-tts-stress", "qwen3-tts-mrv2-stress"])
def test_the_fix_gives_every_position_its_own_row_after_a_replay(deploy):
    ids, spans, out = _drive("tts-fix", deploy)
    P, first = out.P, out.text_first_id
    expected_prompt = list(zip(out.prompt_text_ids.tolist(), out.prompt_codec_ids.tolist()))
    assert ids[:P] == expected_prompt
    assert ids[P:] == [(first + 1 + k, 500 + k) for k in range(5)]
    assert sum(s.misaligned for s in spans.values()) == 0
    # the prompt's start rows: tts_pad + speaker codec, tts_bos + codec PAD, text 0 + codec BOS
    assert [c for _t, c in expected_prompt[P - 2:]] == [CODEC_PAD, CODEC_BOS] and expected_prompt[P - 1][0] == first


def test_the_fix_conforms_where_the_release_does_not():
    """``omni-stress conform`` on the fix as a plugin over each vendored release, both runners."""
    res = run_cli("conform", "--model", "qwen3-tts:harness.families.qwen3_tts.fix:Qwen3TTSFixedTalker",
                  "--deploy", "none", "--requests", "2")
    assert res.exit_code == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert res.stdout.count("Qwen3TTSFixedTalker: conforms") == 2
    assert res.stdout.count("Qwen3TTSFixedTalker@mrv2: conforms") == 2
    assert "overall (exit 0)" in res.stdout


# --------------------------------------------------------------------------- the CLI, as a user runs it

EXPECTED_CELLS = {  # (arm, deploy): mean WER, requests over 0.5, non-zero-offset chunks, cross-boundary
    # replays, multi-position decode spans, misaligned text / end positions, preemptions, errors
    ("tts-0.30.0", "qwen3-tts-reference"): (0.011, 0, 0, 0, 0, 0, 0, 0, 0),
    ("tts-0.30.0", "qwen3-tts-stress"): (0.579, 12, 7, 23, 96, 1743, 1730, 24, 0),
    ("tts-0.30.0", "qwen3-tts-mrv2-reference"): (0.011, 0, 0, 0, 0, 0, 0, 0, 0),
    ("tts-0.30.0", "qwen3-tts-mrv2-stress"): (0.227, 2, 3, 8, 44, 516, 890, 8, 0),
    ("tts-fix", "qwen3-tts-reference"): (0.011, 0, 0, 0, 0, 0, 0, 0, 0),
    ("tts-fix", "qwen3-tts-stress"): (0.011, 0, 7, 24, 71, 0, 0, 24, 0),
    ("tts-fix", "qwen3-tts-mrv2-reference"): (0.011, 0, 0, 0, 0, 0, 0, 0, 0),
    ("tts-fix", "qwen3-tts-mrv2-stress"): (0.011, 0, 7, 24, 71, 0, 0, 24, 0),
}


@pytest.mark.slow
def test_run_family_qwen3_tts_shows_the_release_failing_and_the_fix_equal_to_its_reference(tmp_path):
    res = run_cli("run", "--family", "qwen3-tts", "--asr", "none", "--no-cache", "--out", str(tmp_path),
                  "--run-id", "tts")
    assert res.exit_code == 0, res.stderr[-3000:]
    run = tmp_path / "tts"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["family"] == "qwen3-tts"
    cells = json.loads((run / "summary.json").read_text())["cells"]
    got = {(c["arm"], c["deploy"]): (round(c["wer_mean"], 3), c["requests_over_threshold"], c["nonzero_offset_chunks"],
                                     c["cross_boundary_replays"], c["multi_position_decode_spans"],
                                     c["misaligned_text_positions"], c["misaligned_end_positions"], c["preemptions"],
                                     c["errors"]) for c in cells}
    assert got == EXPECTED_CELLS
    # the seed-style table on stdout, the fix's rows next to the release's
    table = [" ".join(line.split()) for line in res.stdout.splitlines()]
    assert "tts-0.30.0, qwen3-tts-stress deploy 0.579 12/16 7 23" in table
    assert "tts-fix, qwen3-tts-stress deploy 0.011 0/16 7 24" in table
    assert "tts-fix, qwen3-tts-mrv2-stress deploy 0.011 0/16 7 24" in table
    # the paired table by the deploys' declared pairs (issue 46: it appeared only for a deploy named "reference")
    paired = json.loads((run / "summary.json").read_text())["paired"]
    assert sorted({(p["arm"], p["deploy"], p["reference_deploy"]) for p in paired}) == sorted(
        (arm, f"qwen3-tts{k}-stress", f"qwen3-tts{k}-reference") for arm in ("tts-0.30.0", "tts-fix") for k in ("", "-mrv2"))
    assert len(paired) == 4 * 16
    page = (run / "report.html").read_text()  # the release's worst requests tinted, the fix's (equal) not
    assert page.count('<tr class="worst">') == 2 and page.count('<tr class="plays">') == 2
    gate = run_cli("gate", str(run))
    assert gate.exit_code == 0, gate.stdout[-3000:]
    assert gate.stdout.splitlines()[-1] == "gate: 18 passed, 0 failed, 10 skipped, 0 could not be evaluated -> pass (exit 0)"
    assert ("PASS   baseline-stress-shows-bug (expected failure): tts-0.30.0/qwen3-tts-mrv2-stress run 1 [baseline]"
            in gate.stdout)


@pytest.mark.slow
def test_the_gate_fails_the_release_as_a_candidate(tmp_path):
    res = run_cli("run", "--family", "qwen3-tts", "--arm", "upstream=vllm-omni:0.30.0", "--deploy", "qwen3-tts-reference",
                  "--deploy", "qwen3-tts-stress", "--asr", "none", "--quiet", "--no-cache", "--out", str(tmp_path),
                  "--run-id", "up")
    assert res.exit_code == 0, res.stderr[-3000:]
    gate = run_cli("gate", str(tmp_path / "up"))
    assert gate.exit_code == 1
    assert "FAIL   candidate-contract: upstream/qwen3-tts-stress run 1 [candidate]" in gate.stdout
    assert "FAIL  max_misaligned_text_positions: misaligned positions in the text region = 1743 > 0" in gate.stdout
    assert gate.stdout.splitlines()[-1].startswith("gate: ") and gate.stdout.splitlines()[-1].endswith(
        "-> FAIL (candidate-contract, candidate-stress-matches-reference failed; arm upstream (candidate)) (exit 1)")


def test_a_qwen3_tts_mrv2_deploy_on_the_real_backend_is_refused_in_one_line(tmp_path):
    res = run_cli("run", "--family", "qwen3-tts", "--backend", "vllm-omni", "--dry-run", "--out", str(tmp_path))
    assert res.exit_code == 2
    path = REPO / "deploy_configs" / "qwen3-tts-mrv2-reference.yaml"
    assert res.stderr.strip().splitlines() == [
        f"omni-stress: error: {path}: talker.model_runner: v2: MRV2 runs on CUDA only; the vllm-omni backend's CPU "
        "platform runs the V1 runner (run MRV2 deploys on --backend sim)"]


def test_a_model_runner_other_than_v1_or_v2_is_refused(tmp_path):
    from harness.errors import ConfigError

    text = (REPO / "deploy_configs" / "qwen3-tts-stress.yaml").read_text().replace("model_runner: v1", "model_runner: v3")
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_deploy(str(path))
    assert str(exc.value) == f"{path}: talker.model_runner: must be one of v1, v2, got 'v3'"


def test_a_tts_prompt_takes_text_and_refuses_user_reply(tmp_path):
    from harness.errors import ConfigError

    path = tmp_path / "tts.yaml"
    path.write_text("family: qwen3-tts\nprompts:\n  - id: a\n    text: Hello there.\n")
    ps = load_prompts(str(path))
    assert (ps.system_prompt, ps.prompts[0].reply, ps.prompts[0].user) == ("", "Hello there.", "Hello there.")
    path.write_text("family: qwen3-tts\nprompts:\n  - id: a\n    user: Hi\n    reply: Hello there.\n")
    with pytest.raises(ConfigError) as exc:
        load_prompts(str(path))
    assert "prompts[0].user" in str(exc.value) and "unknown" in str(exc.value)


def test_tts_prompt_errors_name_the_text_key_and_no_thinker(tmp_path):
    """Issue 47, case 5: the errors named ``prompts[i].reply`` (the file's key is ``text``) and "the Thinker
    limit of 80" (the family has no Thinker). Issue 45: a text has no 80-token cap; each deploy's
    max_model_len bounds it, before the run."""
    from harness.errors import ConfigError

    path = tmp_path / "tts.yaml"
    path.write_text("family: qwen3-tts\nprompts:\n  - id: a\n    text: " + " ".join(["word"] * 200) + "\n")
    assert len(load_prompts(str(path)).prompts[0].reply.split()) == 200  # past the Thinker's 80: loads
    deploy = tmp_path / "short.yaml"
    deploy.write_text((REPO / "deploy_configs" / "qwen3-tts-stress.yaml").read_text()
                      .replace("name: qwen3-tts-stress", "name: short").replace("max_model_len: 656", "max_model_len: 208")
                      .replace("num_gpu_blocks_override: 42", "num_gpu_blocks_override: 14")
                      .replace("max_tokens: 640", "max_tokens: 200"))
    res = run_cli("run", "--family", "qwen3-tts", "--prompts", str(path), "--deploy", str(deploy), "--arm", "tts-fix",
                  "--asr", "none", "--quiet", "--out", str(tmp_path / "r"))
    assert res.exit_code == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"omni-stress: error: {path}: prompts[0].text: 200 tokens after the 9 prompt rows need 209 positions, "
        f"over {deploy}: talker.max_model_len 208 (prompt 'a')")
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())  # refused before a run directory
    path.write_text("family: qwen3-tts\nprompts:\n  - id: a\n    text: It costs 3.5 now.\n")
    with pytest.raises(ConfigError) as exc:
        load_prompts(str(path))
    assert str(exc.value).startswith(f"{path}: prompts[0].text: number '3.5' is spoken by the sim as '3 5'")


def test_identities_are_numpy_ints():
    """The contract's prompt identities are int64 arrays (the runner compares them with ``np`` arrays)."""
    cell, _runner, out = _cell("tts-fix", "qwen3-tts-reference")
    assert out.prompt_text_ids.dtype == np.int64 and out.prompt_codec_ids.dtype == np.int64
    assert out.P == PROMPT_LEN and out.T == len(out.trailing_rows)


# --------------------------------------------------------------------------- conform beside the run

def _span(step, c, n, P=9, mis=0, **flags):
    return {"arm": "a", "deploy": "d", "request": "r1", "step": step, "c": c, "n": n, "P": P, "misaligned": mis,
            "cross_boundary": False, "multi_decode": False, "one_token_tail": False, "nonzero_offset": False,
            "error": None, **flags}


def test_cell_evidence_classifies_spans_and_finds_the_first_wrong_one():
    from harness.conform.beside import cell_evidence

    spans = [_span(0, 0, 5), _span(1, 5, 4, nonzero_offset=True), _span(2, 9, 1), _span(3, 10, 1),
             _span(9, 0, 11, mis=11, cross_boundary=True), _span(10, 11, 1, mis=1), _span(11, 12, 1),
             _span(12, 13, 3, mis=3, multi_decode=True)]
    ev = cell_evidence(reversed(spans))  # any order: sorted by step per request
    # the chunk and the decode steps after the chunked prefill (steps 2, 3), before the replay
    assert (ev["chunk"].spans, ev["chunk"].wrong, ev["chunk"].requests) == (3, 0, {})
    assert (ev["cross_replay"].spans, ev["cross_replay"].wrong, ev["cross_replay"].requests) == (1, 1, {"r1": (9, 0, 11)})
    # decode steps after the replay (steps 10, 11), not the ones before it (steps 2, 3: the chunk's)
    assert (ev["restart"].spans, ev["restart"].wrong, ev["restart"].requests) == (2, 1, {"r1": (10, 11, 1)})
    assert (ev["multi_decode"].spans, ev["multi_decode"].requests) == (1, {"r1": (12, 13, 3)})
    assert ev["tail"].spans == 0
    assert ev["restart"].describe({"r1": 0.5}) == ("2 spans, 1 misaligned; 1 requests, worst r1 (WER 0.500, first wrong "
                                                   "span step 10 c=11 n=1)")


def test_unchecked_spans_give_the_requests_wer_and_a_crashed_request_says_so():
    """A real run traced at ``spans`` (Qwen3-Omni's real server: no worker contract check) has spans whose rows
    were never checked (``misaligned`` None): the column says so and gives the requests' WER instead, and a
    request that ended in an error (no WER: the release's crash) is named as such; it used to raise TypeError."""
    from harness.conform.beside import cell_evidence

    spans = [_span(0, 0, 5, mis=None), _span(1, 5, 4, mis=None, nonzero_offset=True), _span(2, 9, 1, mis=None),
             {**_span(1, 5, 4, mis=None, nonzero_offset=True), "request": "r2"}]
    ev = cell_evidence(spans)
    assert (ev["chunk"].spans, ev["chunk"].wrong, ev["chunk"].requests) == (3, 0, {})
    assert ev["chunk"].unchecked == {"r1": (1, 5, 4), "r2": (1, 5, 4)}
    assert ev["chunk"].describe({"r1": 0.0, "r2": 0.25}) == (
        "3 spans, rows not checked; 2 requests, worst r2 (WER 0.250, first such span step 1 c=5 n=4)")
    assert ev["chunk"].describe({"r1": 0.0, "r2": None}) == (
        "3 spans, rows not checked; 2 requests, worst r2 (no WER: an error)")
    assert ev["tail"].describe({}) == "not reached (0 spans)"


def test_conform_beside_a_run_puts_the_verdicts_next_to_the_sims_spans(tmp_path):
    res = run_cli("run", "--family", "qwen3-tts", "--deploy", "qwen3-tts-stress", "--arm", "tts-0.30.0", "--asr", "none",
                  "--quiet", "--no-cache", "--out", str(tmp_path), "--run-id", "b")
    assert res.exit_code == 0, res.stderr[-2000:]
    conform = run_cli("conform", "--beside", str(tmp_path / "b"), "--source", "vllm-omni:0.30.0", "--deploy", "none",
                      "--requests", "1")
    assert conform.exit_code == 1, conform.stderr[-2000:]  # the release does not conform
    table = conform.stdout[conform.stdout.index("conform beside run"):].splitlines()
    # the conform column of the runner the run's deploy uses (V1) only
    assert table[2] == "| situation | conform qwen3-tts (V1) | sim tts-0.30.0 / qwen3-tts-stress |"
    assert table[7] == ("| cross-boundary replay | differs @0 | 23 spans, 23 misaligned; 12 requests, "
                        "worst p11-volcano (WER 0.967, first wrong span step 1245 c=0 n=17) |")
    assert table[8] == ("| decode after a replay (conform: restart after preemption) | no restart | "
                        "3796 spans, 154 misaligned; 6 requests, worst p11-volcano (WER 0.967, first wrong span step "
                        "1246 c=17 n=1) |")


def test_beside_table_puts_conform_sim_and_real_side_by_side():
    """Issue 31's three-way table: the conform verdict, then the sim's cells, then the real server's (pure)."""
    from harness.conform.beside import BesideRun, beside_table

    matrix = {"models": [{"model": "qwen3-tts", "cells": {"cross_replay": {"summary": "differs @0"},
                                                          "restart": {"summary": "no restart"}}}]}
    sim = BesideRun("sim", [("a", "d", "v1")],
                    [_span(0, 0, 5), _span(9, 0, 11, mis=11, cross_boundary=True)], {("a", "d", "r1"): 0.5})
    real_spans = [{**_span(0, 0, 9), "request": "r2"}, {**_span(1, 9, 1), "request": "r2"},
                  {**_span(7, 0, 11, cross_boundary=True), "request": "r2"}, {**_span(8, 11, 1, mis=1), "request": "r2"}]
    real = BesideRun("real", [("a", "d", "v1"), ("b", "d", "v1")], real_spans, {("a", "d", "r2"): 0.25})
    lines = beside_table(matrix, "qwen3-tts", [sim, real]).splitlines()
    assert lines[0] == "| situation | conform qwen3-tts (V1) | sim a / d | real a / d |"
    assert lines[5] == ("| cross-boundary replay | differs @0 | 1 spans, 1 misaligned; 1 requests, worst r1 (WER 0.500, "
                        "first wrong span step 9 c=0 n=11) | 1 spans, 0 misaligned |")
    assert lines[6] == ("| decode after a replay (conform: restart after preemption) | no restart | not reached (0 spans) "
                        "| 1 spans, 1 misaligned; 1 requests, worst r2 (WER 0.250, first wrong span step 8 c=11 n=1) |")
    assert lines[-1] == "Cells that reached none of these situations: real b / d."


def test_beside_table_names_the_release_each_real_cell_ran():
    from harness.conform.beside import BesideRun, beside_table

    matrix = {"models": [{"model": "qwen3-tts", "cells": {"cross_replay": {"summary": "differs @0"}}}]}
    spans = [_span(7, 0, 11, mis=11, cross_boundary=True)]
    real = BesideRun("real", [("a", "d", "v1"), ("b", "d", "v1")], spans + [{**spans[0], "arm": "b"}], {},
                     {("a", "d"): "0.32.0rc1"})
    head = beside_table(matrix, "qwen3-tts", [real]).splitlines()[0]
    assert head == "| situation | conform qwen3-tts (V1) | real a / d on vLLM-Omni 0.32.0rc1 | real b / d |"


def test_conform_beside_refuses_runs_of_two_families(tmp_path):
    tts = run_cli("run", "--family", "qwen3-tts", "--deploy", "qwen3-tts-reference", "--arm", "tts-fix", "--asr", "none",
                  "--quiet", "--no-cache", "--out", str(tmp_path), "--run-id", "t")
    omni = run_cli("run", "--deploy", "reference", "--arm", "pr", "--asr", "none", "--quiet", "--no-cache",
                   "--out", str(tmp_path), "--run-id", "o", "--prompts", str(SMALL_PROMPTS))
    assert tts.exit_code == 0 and omni.exit_code == 0, tts.stderr[-1000:] + omni.stderr[-1000:]
    res = run_cli("conform", "--beside", str(tmp_path / "t"), "--beside", str(tmp_path / "o"), "--deploy", "none")
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"omni-stress: error: --beside {tmp_path / 'o'}: a run of conform model 'qwen2.5-omni', not 'qwen3-tts' like "
        f"--beside {tmp_path / 't'} (put runs of one model family side by side)")
