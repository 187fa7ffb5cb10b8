"""Issue 31 item 2: the sim's ``speaking`` Talker for Qwen3-TTS, and ``fidelity`` by family.

The speaking sim must say exactly what the speaking tiny Qwen3-TTS's rules
(``harness.families.qwen3_tts.speaking``) say over the rows the arm handed the runner, as the KV holds
them at each sampled position (a replay's rewrite included). Unit tests drive one request through the
family's runner with forced spans (a prefill, decodes, a preemption, the replay), sample every code
from the sim's Talker and check it against ``speaking.say`` on the KV read back as ``speaking.Row``s;
the end-to-end tests run the CLI (``omni-stress run --family qwen3-tts --sim-talker speaking``) and
``omni-stress fidelity`` on its run.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from clikit import as_jsonl_run
from conftest import invoke_cli
from harness.config import load_arms, load_deploy, load_prompts
from harness.family import get_family
from harness.families.qwen3_tts import speaking
from harness.sim.codec import CODEC_BOS
from harness.talkers import load_impl

PROMPTS = "qwen3_tts_cpu_smoke"
TEA = "Heat the water until it is hot but not boiling, then steep the tea well."

# --------------------------------------------------------------------------- the cell


def _cell(arm_name: str, deploy: str = "qwen3-tts-cpu-stress", prompts_n: int = 1):
    arm = load_arms()[arm_name]
    d = load_deploy(deploy)
    ps = load_prompts(PROMPTS)
    ps = replace(ps, prompts=ps.prompts[:prompts_n])
    cell = get_family(d.family).sim_cell(load_impl(arm), d, ps, 42, "speaking")
    runner = cell.runner_class(cell.model, cell.space, (arm_name, deploy, 1), cell.contract)
    for out in cell.requests:
        runner.add_request(out, out.payload({}), 4096)
    return cell, runner, cell.requests[0]


def test_the_speaking_cell_uses_the_tiny_tokenizers_bytes_and_the_real_codec_specials():
    cell, _runner, out = _cell("tts-fix", prompts_n=4)
    assert out.prompt.reply == TEA
    assert [r.P for r in cell.requests] == [9, 9, 9, 9]  # the real server's P (speaking.PROMPT_LEN)
    assert [r.T for r in cell.requests] == [72, 72, 72, 72]  # one text row per byte
    assert out.reply_tokens == [chr(b) for b in TEA.encode()]
    assert cell.stop_token_ids == [speaking.CODEC_EOS] == [2150]
    talker = cell.talker
    # the role header's rows: <|im_start|>, assistant (no byte), \n (its byte), as the tiny tokenizer's
    role = [int(t) for t in out.prompt_text_ids[:3]]
    assert [talker.byte_of(t) for t in role] == [None, None, 10]
    pad, bos, first = (int(t) for t in out.prompt_text_ids[[3, 7, 8]])
    assert (talker.mark_of(pad), talker.mark_of(bos), talker.byte_of(first)) == ("pad", "bos", ord("H"))


def test_a_text_the_tiny_tokenizer_would_split_otherwise_is_refused(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("name: p\nfamily: qwen3-tts\nprompts:\n  - id: a\n    text: \"fine\"\n"
                   "  - id: b\n    text: \"the assistant says hello\"\n")
    res = invoke_cli("run", "--family", "qwen3-tts", "--sim-talker", "speaking", "--arm", "tts-fix", "--deploy",
                     "qwen3-tts-cpu-reference", "--prompts", str(bad), "--asr", "none", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        f"omni-stress: error: {bad}: prompts[1].text: the text 'the assistant says hello' holds 'assistant' or "
        "'<|', which the tiny tokenizer reads as special tokens (prompt 'b'; --sim-talker speaking)"]


# --------------------------------------------------------------------------- forced spans through the runner


def _rows_of(cell, kv) -> list[speaking.Row]:
    """The request's KV read back as the speaking rules' rows (independently of the sim's Talker)."""
    meanings = cell.space.meanings
    rows = []
    for t, c in zip(kv._text_np[:kv.length].tolist(), kv._codec_np[:kv.length].tolist()):
        byte = mark = None
        if t >= 0:
            m = meanings[t]
            if m.kind in ("output", "role") and m.word is not None and len(m.word) == 1:
                byte = ord(m.word)
            mark = {"text_eos": speaking.EOS_MARK, "text_pad": speaking.PAD_MARK,
                    "text_bos": speaking.BOS_MARK}.get(m.kind)
        rows.append(speaking.Row(byte, mark, c == CODEC_BOS))
    return rows


def _speak(arm_name: str, replay_after: int | None = None, tail: bool = False) -> tuple[list[int], list]:
    """One request (the tea text) on the runner: its prompt in one span, then one decode span per sampled code,
    each code sampled by the sim's Talker and checked against ``speaking.say`` on the KV as it is then.
    ``replay_after=g``: once ``g`` codes are sampled the request is preempted and replayed from 0: all
    ``P + g`` positions in one span, or (``tail``) ``P + g - 1`` positions and then the last sampled code's
    position as a one-token decode span. Returns the codes (codec EOS included) and the spans."""
    cell, runner, out = _cell(arm_name)
    kv = runner.kv[out.request_id]
    P, codes, spans = out.P, [], []

    def call(c: int, n: int) -> None:
        req = SimpleNamespace(request_id=out.request_id, prompt_token_ids=out.talker_prompt_ids,
                              all_token_ids=out.talker_prompt_ids + codes,
                              sampling_params=SimpleNamespace(max_tokens=160, seed=42))
        spans.append(runner.call(req, c, n, len(spans)).span)

    def sample() -> None:
        code = cell.talker.next_token(kv, len(codes))
        assert code == speaking.say(_rows_of(cell, kv), P - 1 + len(codes)), (len(codes), code)
        codes.append(code)

    call(0, P)
    sample()
    while codes[-1] != speaking.CODEC_EOS and len(codes) < 160:
        g = len(codes)
        if g == replay_after:
            replay_after = None
            if tail:
                call(0, P + g - 1)
                call(P + g - 1, 1)
            else:
                call(0, P + g)
        else:
            call(P + g - 1, 1)
        sample()
    return codes, spans


@pytest.mark.parametrize("arm", ["tts-0.30.0", "tts-fix"])
def test_a_request_that_is_never_preempted_says_every_byte_then_silence_silence_eos(arm):
    codes, spans = _speak(arm)
    assert codes == speaking.encode_reply(TEA) + [speaking.CODEC_EOS]
    assert codes == speaking.talk(speaking.contract_rows(TEA))  # the rules on the contract's rows
    assert codes[-3:] == [speaking.SILENCE, speaking.SILENCE, speaking.CODEC_EOS]  # tts_eos, first tts_pad, second
    assert speaking.decode(codes).text == TEA
    assert sum(s.misaligned for s in spans) == 0


def test_the_release_on_a_crossing_replay_loses_its_start_rows_and_stops():
    """V1 keeps the buffer: the replay slices the stored prompt past its end, so every replayed position
    holds tts_pad and no codec part; the position sampled next reads tts_pad after tts_pad: codec EOS."""
    codes, spans = _speak("tts-0.30.0", replay_after=6)
    assert codes == speaking.encode_reply(TEA)[:6] + [speaking.CODEC_EOS]
    assert speaking.decode(codes).text == "Heat t"
    replay = spans[-1]
    assert (replay.c, replay.n, replay.cross_boundary) == (0, 15, True)
    assert (replay.misaligned_text, replay.misaligned_end) == (15, 0)


def test_the_release_after_a_replay_ending_in_a_decode_span_babbles_to_the_end():
    """The same replay, its last position a one-token decode: that position gets its own text row (the
    decode hook's queue was not touched by the replay), but no KV position holds codec BOS any more: the
    Talker babbles through the rest of the text, then says the end region (silence, silence, EOS)."""
    codes, spans = _speak("tts-0.30.0", replay_after=6, tail=True)
    T = len(TEA.encode())
    assert codes == (speaking.encode_reply(TEA)[:6] + [speaking.BABBLE] * (T - 6)
                     + [speaking.SILENCE, speaking.SILENCE, speaking.CODEC_EOS])
    spoken = speaking.decode(codes)
    assert (spoken.text, spoken.speech, spoken.babble, spoken.silence) == ("Heat t", 6, T - 6, 2)
    replay = next(i for i, s in enumerate(spans) if i > 0 and s.c == 0)
    assert [(s.c, s.n) for s in spans[replay:replay + 2]] == [(0, 14), (14, 1)]
    assert spans[replay].cross_boundary and spans[replay].misaligned_text == 14


@pytest.mark.parametrize("tail", [False, True])
def test_the_fix_says_every_byte_after_the_same_replay(tail):
    codes, spans = _speak("tts-fix", replay_after=6, tail=tail)
    assert codes == speaking.encode_reply(TEA) + [speaking.CODEC_EOS]
    assert sum(s.misaligned for s in spans) == 0


# --------------------------------------------------------------------------- the CLI, as a user runs it


@pytest.fixture(scope="module")
def speaking_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tts-speaking")
    res = invoke_cli("run", "--family", "qwen3-tts", "--sim-talker", "speaking", "--arm", "tts-0.30.0", "--arm",
                     "tts-fix", "--deploy", "qwen3-tts-cpu-reference", "--deploy", "qwen3-tts-cpu-stress",
                     "--prompts", PROMPTS, "--asr", "none", "--quiet", "--out", str(out), "--run-id", "sp")
    assert res.exit_code == 0, res.stderr
    assert "backend sim (Talker: speaking)" in res.stdout
    return out / "sp"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _records(run: Path) -> dict[tuple[str, str, str], dict]:
    return {(r["arm"], r["deploy"], r["prompt_id"]): r for r in _lines(run / "requests.jsonl")}


def test_the_fix_says_every_byte_and_the_release_under_stress_stops_or_babbles_after_its_replays(speaking_run):
    recs = _records(speaking_run)
    assert len(recs) == 16
    texts = {p.id: p.reply for p in load_prompts(PROMPTS).prompts}
    preempted = ("t02-plants", "t03-run", "t04-stars")
    for (arm, deploy, pid), r in recs.items():
        if (arm, deploy) == ("tts-0.30.0", "qwen3-tts-cpu-stress") and pid in preempted:
            continue
        # every byte, then silence at tts_eos and at the first tts_pad (codec EOS, the stop token, not recorded)
        assert r["codec_tokens"] == speaking.encode_reply(texts[pid]), (arm, deploy, pid)
        assert (r["oracle_transcript"], r["oracle_wer"], r["num_codec_tokens"]) == (texts[pid], 0.0, 74)
    # the release under stress: three requests are preempted and replayed from 0 with their buffer kept (V1) in
    # 8-row chunks: prompt chunks get tts_pad rows and no codec part, chunks past the prompt bare codec rows, so
    # no KV position holds codec BOS. t02's replay ends with a one-token decode span, whose row is its own text
    # row: the Talker babbles through the rest of the text, then says the end region. t03's and t04's end inside
    # a chunk past the prompt: a bare codec row, codec EOS at once.
    release = {pid: recs[("tts-0.30.0", "qwen3-tts-cpu-stress", pid)] for pid in texts}
    for pid, said, babble in (("t02-plants", 56, True), ("t03-run", 24, False), ("t04-stars", 21, False)):
        r = release[pid]
        rest = [speaking.BABBLE] * (72 - said) + [speaking.SILENCE, speaking.SILENCE] if babble else []
        assert r["codec_tokens"] == speaking.encode_reply(texts[pid], end=False)[:said] + rest, pid
        assert r["oracle_transcript"] == texts[pid].encode()[:said].decode()
    assert {p: r["oracle_transcript"] for p, r in release.items() if p in preempted} == {
        "t02-plants": "Winter air is dry and the days are short, so give plants",
        "t03-run": "Begin with short runs mi", "t04-stars": "Stars are tiny points"}
    assert [round(release[p]["oracle_wer"], 4) for p in texts] == [0.0, 0.2, 0.7143, 0.6923]  # 3/15, 10/14, 9/13
    events = {p: (r["preemptions"], r["events"]["cross_boundary_replays"], r["events"]["multi_position_decode_spans"],
                  r["events"]["nonzero_offset_chunks"], r["events"]["misaligned_text_positions"],
                  r["events"]["misaligned_end_positions"]) for p, r in release.items()}
    assert events == {"t01-tea": (0, 0, 0, 1, 0, 0), "t02-plants": (1, 1, 6, 2, 64, 0),
                      "t03-run": (1, 1, 3, 2, 33, 0), "t04-stars": (1, 1, 3, 3, 30, 0)}
    # the fix under stress: preempted and replayed too, no misaligned position, every byte said
    fix = {p: recs[("tts-fix", "qwen3-tts-cpu-stress", p)] for p in texts}
    assert {p: (r["preemptions"], r["events"]["cross_boundary_replays"], r["events"]["misaligned_positions"])
            for p, r in fix.items()} == {"t01-tea": (0, 0, 0), "t02-plants": (1, 1, 0), "t03-run": (1, 1, 0),
                                         "t04-stars": (1, 1, 0)}


def test_the_report_names_the_families_blind_spots(speaking_run):
    res = invoke_cli("report", str(speaking_run))
    assert res.exit_code == 0, res.stderr
    assert "the low 3 bits of the byte before it, and past the text whether a row is tts_eos" in res.stdout
    assert "low 5 bits" not in res.stdout


# --------------------------------------------------------------------------- fidelity by family


def test_first_difference_of_two_codec_streams():
    from harness.report.fidelity import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([], []) is None and first_difference([], [7]) == 0


def _as_real(run: Path, where: Path) -> Path:
    """A copy of a sim run that says it came from the real backend (what fidelity's second run is)."""
    real = where / "real"
    shutil.copytree(run, real)
    as_jsonl_run(real)  # its spans as an old run's spans.jsonl, to edit by line
    for name in ("manifest.json", "requests.jsonl"):
        path = real / name
        path.write_text(path.read_text().replace('"backend": "sim"', '"backend": "vllm-omni"'))
    return real


def test_fidelity_refuses_runs_of_two_families(speaking_run, tmp_path):
    other = _as_real(speaking_run, tmp_path)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["family"] = "qwen2.5-omni"
    (other / "manifest.json").write_text(json.dumps(manifest))
    res = invoke_cli("fidelity", str(speaking_run), str(other))
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        f"omni-stress: error: fidelity {speaking_run} {other}: the first run is of family 'qwen3-tts', the second "
        "of 'qwen2.5-omni'; fidelity compares two runs of one model family"]


def test_fidelity_of_a_sim_run_against_itself_is_all_identical(speaking_run, tmp_path):
    out = tmp_path / "f.json"
    res = invoke_cli("fidelity", str(speaking_run), str(speaking_run), "--same-backend", "--json", str(out))
    assert res.exit_code == 0, res.stderr
    assert "16 requests in both runs, 16 identical" in res.stdout and "Where they differ" not in res.stdout
    data = json.loads(out.read_text())
    assert data["identical_requests"] == 16
    assert all(r["same_codec_tokens"] and r["schedule"] == "same" and r["first_code_difference"] is None
               and r["said"] is None for r in data["requests"])
    ratios = [v["ratio"] for item in data["cells"] + data["requests"] for v in item["metrics"].values()]
    assert ratios and all(r == 1.0 for r in ratios)


def test_fidelity_says_per_request_where_the_codes_part_and_whether_the_spans_match(speaking_run, tmp_path):
    """A "real" run whose fix request t04-stars said what the release said (on the same spans), and whose
    t03-run lost one span (a different schedule): each is named with its reason, the codes read back by
    Qwen3-TTS's rules (Qwen2.5-Omni's would garble them: other tags, other specials)."""
    real = _as_real(speaking_run, tmp_path)
    recs = _lines(real / "requests.jsonl")
    by = {(r["arm"], r["deploy"], r["prompt_id"]): r for r in recs}
    stars = by[("tts-fix", "qwen3-tts-cpu-stress", "t04-stars")]
    said = by[("tts-0.30.0", "qwen3-tts-cpu-stress", "t04-stars")]
    stars.update(codec_tokens=said["codec_tokens"], oracle_transcript=said["oracle_transcript"],
                 oracle_wer=said["oracle_wer"])
    (real / "requests.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
    spans = _lines(real / "spans.jsonl")
    run_spans = [s for s in spans if (s["arm"], s["deploy"], s["request"]) == ("tts-fix", "qwen3-tts-cpu-stress",
                                                                                "t03-run")]
    spans.remove(run_spans[-1])
    (real / "spans.jsonl").write_text("".join(json.dumps(s, sort_keys=True) + "\n" for s in spans))

    out = tmp_path / "f.json"
    res = invoke_cli("fidelity", str(speaking_run), str(real), "--json", str(out))
    assert res.exit_code == 0, res.stderr
    tail = res.stdout[res.stdout.index("Where they differ"):].splitlines()
    assert tail[:3] == [
        "Where they differ, per request (2):",
        "  tts-fix/qwen3-tts-cpu-stress/1/t03-run: the spans differ (the schedule: docs/fidelity.md); identical "
        "codec tokens",
        "  tts-fix/qwen3-tts-cpu-stress/1/t04-stars: identical spans; codec tokens differ from token 21 on identical "
        "spans (the Talker or the runner differs); sim says 'Stars are tiny points of light, and moving air bends "
        "their light around.', real says 'Stars are tiny points'"]
    data = json.loads(out.read_text())
    reqs = {(r["arm"], r["deploy"], r["prompt_id"]): r for r in data["requests"]}
    r = reqs[("tts-fix", "qwen3-tts-cpu-stress", "t04-stars")]
    assert (r["schedule"], r["first_code_difference"]) == ("same", 21)
    assert r["said"] == {"sim": "Stars are tiny points of light, and moving air bends their light around.",
                         "real": "Stars are tiny points"}
    assert reqs[("tts-fix", "qwen3-tts-cpu-stress", "t03-run")]["schedule"] == "differs"
    assert data["identical_requests"] == 15  # identical codes and counts: t03-run too (its spans are named above)
