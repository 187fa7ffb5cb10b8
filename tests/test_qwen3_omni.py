"""Issue 43: the qwen3-omni family on the sim.

Unit tests check the contract's rows, the bf16-exact row space, the payloads against the release's own
stage input processor (vendored 0.30.0), and drive the family's runner path with forced spans (a chunked
prefill while the Thinker streams, a preemption and its replay) for the release's own ``talker_preprocess``
and the fix; the end-to-end tests run the CLI as a user does (``omni-stress run --family qwen3-omni``) and
gate the result.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, run_cli
from harness.config import load_arms, load_deploy, load_prompts
from harness.families.qwen3_omni.contract import OmniRowRef, expected_row, prompt_len
from harness.sim.codec import CODEC_BOS, CODEC_PAD
from harness.sim.rows import NONE, UNKNOWN


def test_contract_rows_of_a_two_token_user_turn_and_a_three_token_reply():
    rows = [expected_row(p, 2, 3) for p in range(prompt_len(2) + 5)]
    assert rows == [
        OmniRowRef("user 0", "none"), OmniRowRef("user 1", "none"),
        OmniRowRef("header 0", "none"), OmniRowRef("header 1", "none"), OmniRowRef("header 2", "none"),
        OmniRowRef("tts_pad", "nothink"), OmniRowRef("tts_pad", "think_bos"), OmniRowRef("tts_pad", "think_eos"),
        OmniRowRef("tts_pad", "speaker"), OmniRowRef("tts_bos", "pad"), OmniRowRef("reply 0", "bos"),
        OmniRowRef("reply 1", "own id"), OmniRowRef("reply 2", "own id"), OmniRowRef("tts_eos", "own id"),
        OmniRowRef("tts_pad", "own id"), OmniRowRef("tts_pad", "own id"),
    ]
    with pytest.raises(ValueError, match="at least one"):
        expected_row(0, 2, 0)


def test_the_bf16_row_space_keeps_identities_through_a_bf16_cast():
    from harness.families.qwen3_omni.rows import BF16RowSpace

    space = BF16RowSpace(7)
    space.make("prompt", [None] * 300, "a")  # ids past 256, where one float column would round in bf16
    rows, first = space.make("output", ["x", "y"], "b")
    codec = space.embed_codec(torch.tensor([8294, 17]))
    mixed = (rows + codec).to(torch.bfloat16)
    assert mixed.to(torch.float32).equal(rows + codec)  # exact in bf16
    text, kind = space.identify(mixed)
    assert (text.tolist(), kind.tolist()) == ([300, 301], [8294, 17])
    assert space.identify_one(mixed[1:2]) == (301, 17)
    scaled = rows[:1] * 1.5
    assert space.identify_one(scaled) == (UNKNOWN, NONE)
    assert space.identify_one(torch.zeros(1, 64)) == (NONE, NONE)


# --------------------------------------------------------------------------- cells and payloads

def _cell(arm_name: str, deploy: str, prompts_n: int = 1):
    from harness.family import get_family
    from harness.talkers import load_impl

    arm = load_arms()[arm_name]
    d = load_deploy(deploy)
    ps = load_prompts("qwen3_omni")
    ps = replace(ps, prompts=ps.prompts[:prompts_n])
    cell = get_family(d.family).sim_cell(load_impl(arm), d, ps, 42, "words")
    runner = cell.runner_class(cell.model, cell.space, (arm_name, deploy, 1), cell.contract)
    out = cell.requests[0]
    runner.add_request(out, out.payload({}), 4096)
    return cell, runner, out


def _sip():
    """The release's own stage input processor functions (vendored 0.30.0), compiled as conform compiles them."""
    from harness.talkers.release import read_model_source
    from harness.talkers.upstream import build_functions

    src = read_model_source("0.30.0", "vllm_omni/model_executor/stage_input_processors/qwen3_omni.py")
    tts_utils = "vllm_omni.model_executor.stage_input_processors.tts_utils"
    return build_functions(src, ("thinker2talker_full_payload", "_compute_talker_prompt_ids_length"),
                           module_name="vllm_omni.model_executor.stage_input_processors.qwen3_omni",
                           shims={(tts_utils, "extract_speaker_from_request"): lambda *_a, **_k: None,
                                  (tts_utils, "extract_language_from_request"): lambda *_a, **_k: None})


def test_the_full_payload_and_P_are_the_release_stage_input_processors():
    _cell_, _runner, out = _cell("omni3-0.30.0", "qwen3-omni-full-reference")
    sip = _sip()
    stop_row = torch.full((1, 64), 3.0)  # the terminal <|im_end|> row, which the processor drops
    pooling = {"hidden_states.layer_0": torch.cat([out.rows, stop_row]).to(torch.bfloat16),
               "hidden_states.layer_24": torch.cat([out.hidden, stop_row]).to(torch.bfloat16),
               **{f"embed.{k}": v for k, v in out._tts_rows().items()}}
    transfer = SimpleNamespace(config=SimpleNamespace(hf_config=SimpleNamespace(
        talker_config=SimpleNamespace(accept_hidden_layer=24))))
    thinker = SimpleNamespace(request_id=out.request_id, prompt_token_ids=out.prompt_ids, all_token_ids=out.all_ids,
                              output_token_ids=out.reply_ids + [151645])
    want = sip["thinker2talker_full_payload"](transfer, pooling, thinker)
    got = out.payload({})
    assert got["ids"] == want["ids"]
    for key in ("prefill", "tts_bos", "tts_eos", "tts_pad"):
        assert got["embed"][key].equal(want["embed"][key]), key
    assert got["hidden_states"]["output"].equal(want["hidden_states"]["output"])
    P = sip["_compute_talker_prompt_ids_length"]({"ids": got["ids"]}, device="cpu")
    assert P == out.P == 28  # the user turn of p01-weather (14 tokens + 5) and the nine assistant rows
    from harness.family import get_family

    ps = load_prompts("qwen3_omni")
    assert get_family("qwen3-omni").talker_prompt_lens(ps)[0] == 28


def _request(out, generated: list[int]):
    return SimpleNamespace(request_id=out.request_id, prompt_token_ids=out.talker_prompt_ids,
                           all_token_ids=out.talker_prompt_ids + generated,
                           sampling_params=SimpleNamespace(max_tokens=640, seed=42))


GEN = [500, 501, 502, 503, 504, 505]  # codec ids the Talker "sampled" (content codes)


def _kv(runner, out, upto: int) -> list[tuple[int, int]]:
    kv = runner.kv[out.request_id]
    return list(zip(kv._text_np[:upto].tolist(), kv._codec_np[:upto].tolist()))


def _chunked_then_decode(arm: str, deploy: str):
    """The prompt in two prefill spans, then three decodes; every streamed chunk is ready (the Thinker ran
    ahead), so the second prefill call receives chunk 1 and each decode the next one."""
    cell, runner, out = _cell(arm, deploy)
    P, m = out.P, 12
    spans = [runner.call(_request(out, []), 0, m, 100).span, runner.call(_request(out, []), m, P - m, 101).span]
    for i in range(3):
        spans.append(runner.call(_request(out, GEN[:i + 1]), P + i, 1, 102 + i).span)
    return _kv(runner, out, P + 3), spans, out


def test_the_release_shifts_the_streamed_rows_after_a_chunked_prefill():
    ids, spans, out = _chunked_then_decode("omni3-0.30.0", "qwen3-omni-stress")
    P, first = out.P, out.output_first_id
    expected_prompt = list(zip(out.prompt_text_ids.tolist(), out.prompt_codec_ids.tolist()))
    assert ids[:P] == expected_prompt  # the prompt itself is right
    # chunk 1 (r_1) went to cached_decode during the prefill; the first decode indexes it from 1: r_2, r_3, r_4
    assert ids[P:] == [(first + 2, 500), (first + 3, 501), (first + 4, 502)]
    assert [s.misaligned_text for s in spans] == [0, 0, 1, 1, 1]


def test_the_release_is_right_when_the_prefill_is_one_span():
    cell, runner, out = _cell("omni3-0.30.0", "qwen3-omni-reference")
    P, first = out.P, out.output_first_id
    spans = [runner.call(_request(out, []), 0, P, 100).span]
    for i in range(3):
        spans.append(runner.call(_request(out, GEN[:i + 1]), P + i, 1, 101 + i).span)
    assert _kv(runner, out, P + 3)[P:] == [(first + 1, 500), (first + 2, 501), (first + 3, 502)]
    assert sum(s.misaligned for s in spans) == 0


def _preempt_and_replay(arm: str, deploy: str):
    """Prefill in one span, four decodes, a preemption, the replay of every position in one span, one decode."""
    cell, runner, out = _cell(arm, deploy)
    P = out.P
    spans = {"prefill": runner.call(_request(out, []), 0, P, 100).span}
    for i in range(4):
        spans[f"decode {P + i}"] = runner.call(_request(out, GEN[:i + 1]), P + i, 1, 101 + i).span
    if load_deploy(deploy).talker.model_runner == "v2":
        runner.resumed(out, out.payload({}))
    spans["replay"] = runner.call(_request(out, GEN[:5]), 0, P + 4, 110).span
    spans["after"] = runner.call(_request(out, GEN[:5]), P + 4, 1, 111).span
    return _kv(runner, out, P + 5), spans, out


def test_the_release_on_the_full_payload_loses_the_text_on_a_replay():
    ids, spans, out = _preempt_and_replay("omni3-0.30.0", "qwen3-omni-full-stress")
    P, first = out.P, out.output_first_id
    assert sum(spans[f"decode {P + i}"].misaligned for i in range(4)) == 0
    # the replay's generated positions keep their codec rows with no text; the prefill re-queued trailing_text,
    # so the decode after it reads r_1 again where r_5 belongs
    assert ids[P:P + 4] == [(NONE, 500 + k) for k in range(4)]
    assert (spans["replay"].misaligned_text, spans["replay"].misaligned_end) == (4, 0)
    assert ids[P + 4] == (first + 1, 504) and spans["after"].misaligned_text == 1


@pytest.mark.parametrize("deploy", ["qwen3-omni-stress", "qwen3-omni-full-stress", "qwen3-omni-full-mrv2-stress"])
def test_the_fix_gives_every_position_its_own_row(deploy):
    ids, spans, out = _preempt_and_replay("omni3-fix", deploy)
    P, first = out.P, out.output_first_id
    expected_prompt = list(zip(out.prompt_text_ids.tolist(), out.prompt_codec_ids.tolist()))
    assert ids[:P] == expected_prompt
    assert ids[P:] == [(first + 1 + k, 500 + k) for k in range(5)]
    assert sum(s.misaligned for s in spans.values()) == 0
    assert [c for _t, c in expected_prompt[P - 2:]] == [CODEC_PAD, CODEC_BOS] and expected_prompt[P - 1][0] == first
    if deploy == "qwen3-omni-stress":
        ids, spans, out = _chunked_then_decode("omni3-fix", deploy)
        assert ids[P:] == [(first + 1 + k, 500 + k) for k in range(3)] and sum(s.misaligned for s in spans) == 0


def test_the_fix_conforms_on_both_releases_where_shipped_deploys_reach():
    """``omni-stress conform`` on the fix as a plugin over each vendored release: the full-payload row conforms;
    the streamed row conforms except under speculative decoding (no shipped deploy), where a verify span needs
    Thinker rows conform's connector has not delivered yet, and the fix says so rather than guess."""
    res = run_cli("conform", "--model", "qwen3-omni:harness.families.qwen3_omni.fix:Qwen3OmniFixedTalker",
                  "--deploy", "none", "--requests", "2")
    assert res.exit_code == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert res.stdout.count("Qwen3OmniFixedTalker: conforms") == 2
    assert res.stdout.count("Qwen3OmniFixedTalker@async: fails only from speculative decoding") == 2
    assert "RuntimeError: decode offset 5: the Thinker's row 39 has not arrived" in res.stdout


# --------------------------------------------------------------------------- refusals

def _deploy_file(tmp_path, base: str, **changes: str):
    text = (REPO / "deploy_configs" / f"{base}.yaml").read_text()
    for old, new in changes.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / f"{base}-x.yaml"
    path.write_text(text.replace(f"name: {base}\n", f"name: {base}-x\n"))
    return path


def test_mrv2_with_async_chunk_is_refused_in_one_line(tmp_path):
    path = _deploy_file(tmp_path, "qwen3-omni-stress", **{"model_runner: v1": "model_runner: v2"})
    res = run_cli("run", "--family", "qwen3-omni", "--deploy", str(path), "--arm", "omni3-fix", "--asr", "none",
                  "--quiet", "--out", str(tmp_path / "r"))
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"omni-stress: error: {path}: talker.model_runner v2 with async_chunk: true: how MRV2 rebuilds a resumed "
        "request's streamed rows is not modelled by the qwen3-omni sim (use v1, or async_chunk: false)")


def test_the_real_backend_describes_each_default_cell_and_refuses_an_mrv2_deploy(tmp_path):
    """Issue 44: the family has a serve module; a dry run describes its four default cells per arm, and an MRV2
    deploy (CUDA only in 0.30.0) is refused by file and field before any server."""
    res = run_cli("run", "--family", "qwen3-omni", "--backend", "vllm-omni", "--platform", "cpu", "--dry-run",
                  "--out", str(tmp_path))
    assert res.exit_code == 0, res.stderr
    assert res.stdout.count("# arm 'omni3-") == 8 and res.stdout.count("--deploy-config") == 16  # the command line and the YAML heading
    res = run_cli("run", "--family", "qwen3-omni", "--backend", "vllm-omni", "--deploy", "qwen3-omni-full-mrv2-stress",
                  "--dry-run", "--out", str(tmp_path))
    assert res.exit_code == 2 and "qwen3-omni-full-mrv2-stress.yaml" in res.stderr and "model_runner" in res.stderr


# --------------------------------------------------------------------------- the CLI, as a user runs it

EXPECTED_CELLS = {  # (arm, deploy): mean WER, requests over 0.5, non-zero-offset chunks, cross-boundary
    # replays, multi-position decode spans, misaligned text / end positions, preemptions, errors
    ("omni3-0.30.0", "qwen3-omni-reference"): (0.009, 0, 0, 0, 0, 0, 0, 0, 0),
    ("omni3-0.30.0", "qwen3-omni-stress"): (0.282, 5, 31, 9, 45, 1186, 944, 9, 0),
    ("omni3-0.30.0", "qwen3-omni-full-reference"): (0.009, 0, 0, 0, 0, 0, 0, 0, 0),
    ("omni3-0.30.0", "qwen3-omni-full-stress"): (0.229, 3, 30, 9, 46, 467, 1011, 9, 0),
    ("omni3-fix", "qwen3-omni-reference"): (0.009, 0, 0, 0, 0, 0, 0, 0, 0),
    ("omni3-fix", "qwen3-omni-stress"): (0.009, 0, 45, 22, 74, 0, 0, 23, 0),
    ("omni3-fix", "qwen3-omni-full-reference"): (0.009, 0, 0, 0, 0, 0, 0, 0, 0),
    ("omni3-fix", "qwen3-omni-full-stress"): (0.009, 0, 45, 21, 60, 0, 0, 21, 0),
}


@pytest.mark.slow
def test_run_family_qwen3_omni_shows_the_release_failing_and_the_fix_equal_to_its_reference(tmp_path):
    res = run_cli("run", "--family", "qwen3-omni", "--asr", "none", "--no-cache", "--out", str(tmp_path),
                  "--run-id", "omni3")
    assert res.exit_code == 0, res.stderr[-3000:]
    run = tmp_path / "omni3"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["family"] == "qwen3-omni"
    cells = json.loads((run / "summary.json").read_text())["cells"]
    got = {(c["arm"], c["deploy"]): (round(c["wer_mean"], 3), c["requests_over_threshold"], c["nonzero_offset_chunks"],
                                     c["cross_boundary_replays"], c["multi_position_decode_spans"],
                                     c["misaligned_text_positions"], c["misaligned_end_positions"], c["preemptions"],
                                     c["errors"]) for c in cells}
    assert got == EXPECTED_CELLS
    table = [" ".join(line.split()) for line in res.stdout.splitlines()]
    assert "omni3-0.30.0, qwen3-omni-stress deploy 0.282 5/16 31 9" in table
    assert "omni3-fix, qwen3-omni-stress deploy 0.009 0/16 45 22" in table
    paired = json.loads((run / "summary.json").read_text())["paired"]
    assert sorted({(p["arm"], p["deploy"], p["reference_deploy"]) for p in paired}) == sorted(
        (arm, f"qwen3-omni{k}-stress", f"qwen3-omni{k}-reference") for arm in ("omni3-0.30.0", "omni3-fix")
        for k in ("", "-full"))
    gate = run_cli("gate", str(run))
    assert gate.exit_code == 0, gate.stdout[-3000:]
    assert gate.stdout.splitlines()[-1] == "gate: 13 passed, 0 failed, 3 skipped, 0 could not be evaluated -> pass (exit 0)"
    assert ("PASS   baseline-stress-shows-bug (expected failure): omni3-0.30.0/qwen3-omni-stress run 1 [baseline]"
            in gate.stdout)


@pytest.mark.slow
def test_the_gate_fails_the_release_as_a_candidate(tmp_path):
    res = run_cli("run", "--family", "qwen3-omni", "--arm", "upstream=vllm-omni:0.32.0rc1", "--deploy",
                  "qwen3-omni-reference", "--deploy", "qwen3-omni-stress", "--asr", "none", "--quiet", "--no-cache",
                  "--out", str(tmp_path), "--run-id", "up")
    assert res.exit_code == 0, res.stderr[-3000:]
    gate = run_cli("gate", str(tmp_path / "up"))
    assert gate.exit_code == 1
    assert "FAIL   candidate-contract: upstream/qwen3-omni-stress run 1 [candidate]" in gate.stdout
    assert "FAIL  max_misaligned_text_positions: misaligned positions in the text region = 1186 > 0" in gate.stdout
    # gated in the role it plays here (issue 45: gate --role for plugin arms): the release expected to fail
    as_baseline = run_cli("gate", str(tmp_path / "up"), "--role", "upstream=baseline")
    assert as_baseline.exit_code == 0, as_baseline.stdout[-3000:]
    assert ("PASS   baseline-stress-shows-bug (expected failure): upstream/qwen3-omni-stress run 1 [baseline]"
            in as_baseline.stdout)
    assert as_baseline.stdout.splitlines()[-1] == "gate: 2 passed, 0 failed, 0 could not be evaluated -> pass (exit 0)"
    for bad, msg in (("nope=baseline", f"the run {tmp_path / 'up'} has no arm 'nope' (its arms: upstream)"),
                     ("upstream=banana", "role 'banana' for arm 'upstream'; expected baseline or candidate"),
                     ("upstream", "expected ARM=ROLE (ROLE baseline or candidate)")):
        refused = run_cli("gate", str(tmp_path / "up"), "--role", bad)
        assert refused.exit_code == 2
        assert refused.stderr.strip().splitlines()[-1].endswith(msg), refused.stderr


def test_conform_beside_a_run_puts_each_path_beside_its_own_conform_row(tmp_path):
    res = run_cli("run", "--family", "qwen3-omni", "--deploy", "qwen3-omni-stress", "--deploy", "qwen3-omni-full-stress",
                  "--arm", "omni3-0.30.0", "--asr", "none", "--quiet", "--no-cache", "--out", str(tmp_path),
                  "--run-id", "b")
    assert res.exit_code == 0, res.stderr[-2000:]
    conform = run_cli("conform", "--beside", str(tmp_path / "b"), "--source", "vllm-omni:0.30.0", "--deploy", "none",
                      "--requests", "1")
    assert conform.exit_code == 1, conform.stderr[-2000:]  # the release does not conform
    table = conform.stdout[conform.stdout.index("conform beside run"):].splitlines()
    assert table[2] == ("| situation | conform qwen3-omni (V1) | conform qwen3-omni (V1, async_chunk) | "
                        "sim omni3-0.30.0 / qwen3-omni-stress | sim omni3-0.30.0 / qwen3-omni-full-stress |")
    # the streamed path: a chunked prefill alone shifts the decode rows (conform: differs), the full payload conforms
    assert table[4] == ("| non-zero-offset chunk | conforms | differs @28 | 2605 spans, 687 misaligned; 14 requests, "
                        "worst p10-dog (WER 0.862, first wrong span step 412 c=47 n=1) | 2539 spans, 0 misaligned |")


# --------------------------------------------------------------------------- the speaking sim Talker (issue 44 item 4)

SPEAKING_STRESS = {  # prompts/qwen3_omni_cpu.yaml under qwen3-omni-cpu-stress, the sim's speaking Talker
    ("omni3-0.30.0", "o01-tea"): "Hat the water until it is hot but not boiling, then steep the tea well.",
    ("omni3-0.30.0", "o02-plants"): "Wnter air is dry and the <unk> so give plants more light now.",
    ("omni3-0.30.0", "o03-run"): "Bgin with short runs mixed hree or four days each week.",
    ("omni3-0.30.0", "o04-stars"): "Sars are tiny points of <unk> air bends their light around.",
}


def test_the_speaking_sim_talker_says_what_the_real_server_says(tmp_path):
    """``--sim-talker speaking``: the Thinker tokenizes like the tiny checkpoint (``P`` = 38, the real server's),
    the Talker follows the speaking rules. The fix says every reply exactly under stress (its codec stream is
    ``encode_reply``, as on the real server); the release loses each reply's second byte after the chunked
    prefill (the streamed rows' counter shifted) and, once preempted, more: its first request says "Hat the
    water ...", the words the real server's Talker said before it crashed (docs/families/qwen3_omni.md)."""
    from harness.families.qwen3_omni import speaking as sp
    from harness.records import read_requests

    res = run_cli("run", "--family", "qwen3-omni", "--sim-talker", "speaking", "--arm", "omni3-0.30.0", "--arm",
                  "omni3-fix", "--deploy", "qwen3-omni-cpu-stress", "--prompts", "qwen3_omni_cpu", "--asr", "none",
                  "--quiet", "--no-cache", "--out", str(tmp_path), "--run-id", "sp")
    assert res.exit_code == 0, res.stderr[-3000:]
    prompts = {p.id: p for p in load_prompts("qwen3_omni_cpu").prompts}
    recs = {(r.arm, r.prompt_id): r for r in read_requests(tmp_path / "sp")}
    assert len(recs) == 8 and all(r.talker_prompt_len == 38 and r.error is None for r in recs.values())
    for pid, p in prompts.items():
        fix = recs[("omni3-fix", pid)]
        assert (fix.codec_tokens, fix.oracle_transcript, fix.oracle_wer) == (sp.encode_reply(p.reply), p.reply, 0.0)
        assert fix.chunk_frames_sent == [4, 25, 25, 20] and fix.chunk_violations == 0, pid
        assert recs[("omni3-0.30.0", pid)].oracle_transcript == SPEAKING_STRESS[("omni3-0.30.0", pid)], pid
    assert sum(r.preemptions for r in recs.values() if r.arm == "omni3-fix") == 4


def test_the_speaking_sim_talker_refuses_a_question_the_tiny_tokenizer_reads_otherwise(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("family: qwen3-omni\nsystem_prompt: hi\nprompts:\n  - id: a\n    user: ask the assistant\n"
                    "    reply: Fine.\n")
    res = run_cli("run", "--family", "qwen3-omni", "--sim-talker", "speaking", "--deploy", "qwen3-omni-cpu-reference",
                  "--arm", "omni3-fix", "--prompts", str(path), "--asr", "none", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        f"omni-stress: error: {path}: prompts[0].user: the text 'ask the assistant' holds 'assistant', which the tiny "
        "tokenizer reads as one token (prompt 'a'; --sim-talker speaking)"]
    path.write_text("family: qwen3-omni\nsystem_prompt: Serve the user.\nprompts:\n  - id: a\n    user: Hi.\n"
                    "    reply: Fine.\n")
    res = run_cli("run", "--family", "qwen3-omni", "--sim-talker", "speaking", "--deploy", "qwen3-omni-cpu-reference",
                  "--arm", "omni3-fix", "--prompts", str(path), "--asr", "none", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        f"omni-stress: error: {path}: system_prompt: the text 'Serve the user.' holds 'user', which the tiny "
        "tokenizer reads as one token (--sim-talker speaking)"]
