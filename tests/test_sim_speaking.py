"""The sim's ``speaking`` Talker mode (harness/sim/speaking_talker.py) and ``omni-stress fidelity``.

Unit tests of the rules on hand-written KV rows, cells of the speaking sim with exact expectations
(``pr`` says each reply exactly, ``main`` under ``cpu-stress`` babbles, ``P`` is the tiny tokenizer's),
and the CLI end to end: ``run --sim-talker speaking``, then ``fidelity`` of the run against itself,
against a hand-edited copy, and on bad input.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.families.qwen2_5_omni import speaking
from harness.config import load_arms, load_deploy, load_prompts
from harness.talkers import resolve_arm
from harness.errors import UserError
from harness.report.fidelity import Side, compare, ratio, render_text
from harness.records import EventCounts, RequestRecord
from harness.sim.codec import CODEC_BOS, CODEC_EOS, CODEC_PAD, parse_babble
from harness.sim.rows import NONE, UNKNOWN, RowSpace
from harness.sim.speaking_talker import SpeakingKV, SpeakingTalker, speech_units, spoken_codes
from harness.tokenizer import SPECIAL_TOKENS, byte_tokenize, chat_prompt, token_byte
from clikit import as_jsonl_run
from tests.conftest import REPO, invoke_cli

# --------------------------------------------------------------------------- tokenizer


def test_byte_tokenize_one_token_per_byte_and_special_tokens_whole():
    toks = byte_tokenize("<|im_start|>hé\n<|im_end|>")
    assert toks == ["<|im_start|>", "h", chr(0xC3), chr(0xA9), "\n", "<|im_end|>"]
    assert [token_byte(t) for t in toks] == [None, ord("h"), 0xC3, 0xA9, 10, None]
    assert byte_tokenize("<|not_special|>") == [chr(b) for b in b"<|not_special|>"]  # only the tokenizer's specials


def test_special_tokens_are_the_tiny_checkpoints():
    from harness.families.qwen2_5_omni.tiny_model import SPECIAL_TOKENS as TINY

    assert set(SPECIAL_TOKENS) == set(TINY)


def test_talker_prompt_length_is_the_chat_prompts_bytes_specials_once_plus_two():
    from harness.families.qwen2_5_omni.thinker import run_thinker

    prompts = load_prompts("cpu_smoke")
    outs = run_thinker(prompts, RowSpace(0), 1.0, byte_tokenize)
    for prompt, out in zip(prompts.prompts, outs):
        text = chat_prompt(prompts.system_prompt, prompt.user)
        assert (text.count("<|im_start|>"), text.count("<|im_end|>")) == (3, 2)
        extra = 3 * (len("<|im_start|>") - 1) + 2 * (len("<|im_end|>") - 1)  # each special token is one token
        assert out.P == len(text.encode("utf-8")) - extra + 2
        assert out.reply_tokens == [chr(b) for b in prompt.reply.encode("utf-8")]
    assert outs[0].P == 104  # c01-tea


def test_thinker_sequences_space_the_arrivals():
    from harness.families.qwen2_5_omni.thinker import run_thinker

    prompts = load_prompts("cpu_smoke")
    k = [len(p.reply.encode()) for p in prompts.prompts]
    one = [o.arrival_step for o in run_thinker(prompts, RowSpace(0), 1.0, byte_tokenize)]
    assert one == list(np.cumsum([1 + x for x in k]))  # max_num_seqs 1: one after the other
    four = [o.arrival_step for o in run_thinker(prompts, RowSpace(0), 1.0, byte_tokenize, thinker_seqs=4)]
    assert four == [1 + x for x in k]  # four sequences: all four together
    two = [o.arrival_step for o in run_thinker(prompts, RowSpace(0), 1.0, byte_tokenize, thinker_seqs=2)]
    assert two[:2] == [1 + k[0], 1 + k[1]] and two[2] == min(two[:2]) + 1 + k[2]


# --------------------------------------------------------------------------- the rules on hand-written rows


@pytest.fixture
def rows():
    """A RowSpace with request a's prompt rows (one special, then bytes), a's reply "Hi" and b's reply "Yo"."""
    space = RowSpace(0)
    _, p0 = space.make("prompt", ["<|im_start|>", "x", "y"], "a")
    _, a0 = space.make("output", ["H", "i"], "a")
    _, b0 = space.make("output", ["Y", "o"], "b")
    _, eos = space.make("text_eos", [None], None)
    _, pad = space.make("text_pad", [None], None)
    _, spk = space.make("spk:1", [None], None)
    talker = SpeakingTalker(space, speaking)
    talker.freeze()
    return talker, {"p0": p0, "a0": a0, "b0": b0, "eos": eos, "pad": pad, "spk": spk}


def _kv(text: list[int], codec: list[int], P: int) -> SpeakingKV:
    kv = SpeakingKV("a", P, -1, -1, 32)
    kv.write(0, np.array(text, dtype=np.int64), np.array(codec, dtype=np.int64))
    return kv


def test_a_correct_kv_says_its_reply_then_the_end_region_then_eos(rows):
    talker, r = rows
    # P = 5: prompt rows 0..2, speaker + PAD at 3, reply[0] + BOS at 4; then reply[1], text-EOS, PAD, PAD
    text = [r["p0"], r["p0"] + 1, r["p0"] + 2, r["spk"], r["a0"], r["a0"] + 1, r["eos"], r["pad"], r["pad"]]
    codec = [NONE, NONE, NONE, CODEC_PAD, CODEC_BOS, 100, 101, 0, 0]
    kv = _kv(text, codec, P=5)
    codes = [talker.next_token(kv, g) for g in range(5)]
    assert codes == speaking.encode_reply("Hi") + [CODEC_EOS] == [72, 105 + 8 * 256, 0, 0, CODEC_EOS]
    assert speaking.decode(codes).text == "Hi" and speaking.decode(codes).silence == 2


def test_the_end_region_is_heard_a_dropped_or_shifted_pad_moves_the_end(rows):
    """Issue 32 item 1: after text-EOS the Talker reads END_POSITIONS = 2 more rows."""
    talker, r = rows
    head = [r["p0"], r["p0"] + 1, r["p0"] + 2, r["spk"], r["a0"], r["a0"] + 1, r["eos"]]
    codec = [NONE, NONE, NONE, CODEC_PAD, CODEC_BOS, 100, 101, 0, 0, 0]
    said = speaking.encode_reply("Hi", end=False)

    def says(tail: list[int]) -> list[int]:
        kv = _kv(head + tail, codec[:len(head) + len(tail)], P=5)
        out = []
        for g in range(len(head) + len(tail) - 4):
            out.append(talker.next_token(kv, g))
            if out[-1] == CODEC_EOS:
                break
        return out

    assert says([r["pad"], r["pad"]]) == said + [0, 0, CODEC_EOS]
    assert says([NONE, NONE]) == said + [0, CODEC_EOS]  # PAD rows dropped: ends one position early
    assert says([r["eos"], r["pad"], r["pad"]]) == said + [0, 0, 0, CODEC_EOS]  # PAD shifted: one late
    assert speaking.END_POSITIONS == 2


def test_no_codec_bos_anywhere_babbles_while_the_row_has_text(rows):
    talker, r = rows
    text = [r["p0"], r["p0"] + 1, r["p0"] + 2, r["p0"], r["p0"] + 1, r["a0"] + 1, NONE]
    kv = _kv(text, [NONE] * 7, P=5)
    assert [talker.next_token(kv, g) for g in range(3)] == [speaking.BABBLE, speaking.BABBLE, CODEC_EOS]


def test_a_codec_bos_at_position_0_starts_it_and_a_replay_that_drops_it_stops_it(rows):
    talker, r = rows
    # an unreplaced row 0 is the raw embedding of the Talker prompt's first id: codec BOS
    text = [NONE, r["p0"] + 1, r["p0"] + 2, r["p0"], r["a0"] + 1]
    kv = _kv(text, [CODEC_BOS, NONE, NONE, NONE, NONE], P=5)
    assert kv.first_bos == 0
    # row 4 carries "i", row 3 carries the special token: no byte, so tag 0
    assert talker.next_token(kv, 0) == speaking.codec_id(ord("i"), None)
    kv.write(0, np.array([r["p0"]]), np.array([NONE]))  # a replay rewrites row 0 and truncates the KV
    assert kv.first_bos is None and kv.length == 1
    kv.write(1, np.array(text[1:]), np.array([NONE] * 4))
    assert talker.next_token(kv, 0) == speaking.BABBLE


def test_bos_later_than_the_sampled_position_does_not_start_it(rows):
    talker, r = rows
    text = [r["p0"], r["p0"] + 1, r["a0"], r["a0"] + 1]
    kv = _kv(text, [NONE, NONE, NONE, CODEC_BOS], P=3)
    assert talker.next_token(kv, 0) == speaking.BABBLE  # position 2 sees positions 0..2 only
    assert talker.next_token(kv, 1) == speaking.codec_id(ord("i"), ord("H"))


def test_memory_reads_the_previous_rows_byte_cross_talk_and_unknown(rows):
    talker, r = rows
    # row 3 is request b's "o" (cross-talk): said as "o", with the tag of row 2 ("Y" of b)
    text = [r["spk"], r["b0"], r["b0"], r["b0"] + 1, UNKNOWN]
    kv = _kv(text, [CODEC_BOS, NONE, NONE, NONE, NONE], P=3)
    assert talker.next_token(kv, 0) == speaking.codec_id(ord("Y"), ord("Y"))
    assert talker.next_token(kv, 1) == speaking.codec_id(ord("o"), ord("Y"))
    assert talker.next_token(kv, 2) == CODEC_EOS  # an unknown text component carries no byte
    assert talker.next_token(kv, 3) == CODEC_EOS  # past the KV: no row


def test_spoken_codes_and_speech_units():
    assert spoken_codes([1, 2, CODEC_EOS], CODEC_EOS) == [1, 2]
    assert spoken_codes([1, 2], CODEC_EOS) == [1, 2]
    units = speech_units("Hi, you <unk> there", 19, speaking.UNINTELLIGIBLE)
    assert units[:3] == ["Hi", "<pause>", "you"] and units[4] == "there"
    assert parse_babble(units[3]) == (3, 19)
    assert speech_units("", 19, speaking.UNINTELLIGIBLE) == []


# --------------------------------------------------------------------------- cells of the speaking sim


@pytest.fixture(scope="module")
def cells():
    """pr and main on cpu_smoke under cpu-reference and cpu-stress, speaking mode, seed 42."""
    from harness.sim.steploop import run_cell

    arms = load_arms()
    prompts = load_prompts("cpu_smoke")
    out = {}
    for arm in ("main", "pr"):
        for deploy in ("cpu-reference", "cpu-stress"):
            recs: list = []
            run_cell(resolve_arm(arm, arms), load_deploy(deploy), prompts, 1, 42, recs.append,
                     talker_mode="speaking")
            out[(arm, deploy)] = {r.record.prompt_id: r for r in recs}
    return prompts, out


def test_pr_under_cpu_reference_says_each_reply_exactly(cells):
    prompts, out = cells
    for p in prompts.prompts:
        rec = out[("pr", "cpu-reference")][p.id].record
        assert rec.codec_tokens == speaking.encode_reply(p.reply)
        assert rec.num_codec_tokens == len(p.reply.encode("utf-8")) + 2  # the end region's two SILENCE ids
        assert rec.oracle_transcript == " ".join(p.reply.split())
        assert rec.oracle_wer == 0.0
        assert rec.finish_reason == "stop"
        text = chat_prompt(prompts.system_prompt, p.user)
        extra = 3 * (len("<|im_start|>") - 1) + 2 * (len("<|im_end|>") - 1)
        assert rec.talker_prompt_len == len(text.encode("utf-8")) - extra + 2


def test_pr_under_cpu_stress_says_what_it_says_unstressed(cells):
    prompts, out = cells
    stressed = out[("pr", "cpu-stress")]
    assert sum(r.record.events.nonzero_offset_chunks for r in stressed.values()) > 0
    for p in prompts.prompts:
        assert stressed[p.id].record.codec_tokens == out[("pr", "cpu-reference")][p.id].record.codec_tokens
        assert stressed[p.id].record.oracle_wer == 0.0
        assert stressed[p.id].record.events.misaligned_positions == 0


def test_main_under_cpu_stress_babbles_every_request(cells):
    prompts, out = cells
    for p in prompts.prompts:
        res = out[("main", "cpu-stress")][p.id]
        rec = res.record
        assert rec.oracle_transcript == ""
        assert rec.oracle_wer == 1.0
        assert rec.num_codec_tokens > 0 and set(rec.codec_tokens) == {speaking.BABBLE}
        assert res.units == []  # babble carries no words: the WAV is silence
        assert rec.events.misaligned_text_positions > 0


def test_main_under_cpu_reference_speaks(cells):
    prompts, out = cells
    for p in prompts.prompts:
        rec = out[("main", "cpu-reference")][p.id].record
        assert rec.oracle_wer == 0.0
        # 0.30.0 has no text-EOS/PAD rows: its row after the reply has no text and no mark, so it stops
        # there without the end region's SILENCE ids, and the contract counts that text-EOS position
        assert rec.codec_tokens == speaking.encode_reply(p.reply, end=False)
        assert (rec.events.misaligned_text_positions, rec.events.misaligned_end_positions) == (1, 0)


def test_an_arm_dropping_the_persistent_pad_rows_is_heard_and_counted_on_the_speaking_sim():
    """Issue 32 item 1: the end region is scheduled on the speaking path, so the contract counts a
    dropped PAD row (one end position per request) and the request ends one SILENCE early."""
    from harness.sim.steploop import run_cell

    prompts = load_prompts("cpu_smoke")
    arm = resolve_arm("droppad=tests.fixtures.helper_override_arm:DropPadPr", load_arms())
    recs: list = []
    run_cell(arm, load_deploy("cpu-reference"), prompts, 1, 42, recs.append, talker_mode="speaking")
    by = {r.record.prompt_id: r.record for r in recs}
    for p in prompts.prompts:
        rec = by[p.id]
        assert rec.codec_tokens == speaking.encode_reply(p.reply, end=False) + [speaking.SILENCE], p.id
        assert rec.oracle_wer == 0.0
        assert (rec.events.misaligned_text_positions, rec.events.misaligned_end_positions) == (0, 1), p.id


# --------------------------------------------------------------------------- fidelity logic


def _rec(arm="pr", deploy="d", prompt="p1", wer=0.0, codes=(1, 2), **events) -> RequestRecord:
    return RequestRecord(arm=arm, deploy=deploy, repeat=1, prompt_id=prompt, backend="sim", reference_text="x",
                         codec_tokens=list(codes), num_codec_tokens=len(codes), oracle_wer=wer,
                         events=EventCounts(**events))


def test_ratio_rules():
    assert ratio(0, 0) == 1.0 and ratio(2, 4) == 0.5 and ratio(3, 0) is None and ratio(None, 1) is None


def test_compare_matches_requests_and_sums_cells():
    sim = Side("s", "sim", "speaking", [_rec(prompt="p1", nonzero_offset_chunks=2),
                                        _rec(prompt="p2", wer=1.0, codes=(5,)), _rec(prompt="p3")])
    real = Side("r", "vllm-omni", None, [_rec(prompt="p1", nonzero_offset_chunks=4),
                                          _rec(prompt="p2", wer=0.5, codes=(5, 6)), _rec(prompt="p4")])
    fid = compare(sim, real)
    assert [r.key[3] for r in fid.requests] == ["p1", "p2"]
    cell = fid.cells[0]
    assert cell.requests == 2
    assert cell.values["oracle_wer"].sim == 0.5 and cell.values["oracle_wer"].real == 0.25
    assert cell.values["oracle_wer"].ratio == 2.0
    assert cell.values["nonzero_offset_chunks"].sim == 2 and cell.values["nonzero_offset_chunks"].real == 4
    assert cell.values["codec_tokens"].sim == 3 and cell.values["codec_tokens"].real == 4
    assert fid.only_sim == [("pr", "d", 1, "p3")] and fid.only_real == [("pr", "d", 1, "p4")]
    assert [r.same_codes for r in fid.requests] == [True, False]
    text = render_text(fid)
    assert "Only in the sim run s (1): pr/d/1/p3" in text and "Only in the real run r (1): pr/d/1/p4" in text


def test_compare_refuses_runs_without_a_common_cell():
    with pytest.raises(UserError, match="no common cells"):
        compare(Side("s", "sim", "speaking", [_rec(deploy="a")]), Side("r", "sim", "speaking", [_rec(deploy="b")]))


def test_compare_notes_a_words_sim_against_a_real_run():
    fid = compare(Side("s", "sim", "words", [_rec()]), Side("r", "vllm-omni", None, [_rec()]))
    assert any("words Talker" in n for n in fid.notes)


# --------------------------------------------------------------------------- the CLI end to end


@pytest.fixture(scope="module")
def speaking_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("speaking-run")
    res = invoke_cli("run", "--sim-talker", "speaking", "--arm", "main", "--arm", "pr", "--deploy", "cpu-reference",
                     "--deploy", "cpu-stress", "--prompts", "cpu_smoke", "--asr", "none", "--quiet",
                     "--out", str(out), "--run-id", "sp")
    assert res.exit_code == 0, res.stderr
    assert "backend sim (Talker: speaking)" in res.stdout
    return out / "sp"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def test_run_records_the_mode_and_speaks(speaking_run):
    manifest = json.loads((speaking_run / "manifest.json").read_text())
    assert manifest["sim_talker"] == "speaking"
    recs = _lines(speaking_run / "requests.jsonl")
    assert len(recs) == 16
    by = {(r["arm"], r["deploy"], r["prompt_id"]): r for r in recs}
    prompts = load_prompts("cpu_smoke")
    for p in prompts.prompts:
        assert by[("pr", "cpu-reference", p.id)]["codec_tokens"] == speaking.encode_reply(p.reply)
        assert by[("main", "cpu-stress", p.id)]["oracle_wer"] == 1.0


def test_resume_refuses_another_sim_talker(speaking_run):
    res = invoke_cli("run", "--arm", "main", "--arm", "pr", "--deploy", "cpu-reference", "--deploy", "cpu-stress",
                     "--prompts", "cpu_smoke", "--asr", "none", "--quiet", "--resume", str(speaking_run))
    assert res.exit_code == 2
    assert "sim_talker differ" in res.stderr and "'speaking'" in res.stderr and "'words'" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_sim_talker_refused_on_the_real_backend(tmp_path):
    res = invoke_cli("run", "--backend", "vllm-omni", "--sim-talker", "speaking", "--arm", "pr", "--deploy",
                     "cpu-reference", "--prompts", "cpu_smoke", "--asr", "none", "--out", str(tmp_path))
    assert res.exit_code == 2 and "--sim-talker speaking applies to --backend sim" in res.stderr


def test_fidelity_of_a_run_against_itself_is_all_ones(speaking_run, tmp_path):
    out = tmp_path / "f.json"
    res = invoke_cli("fidelity", str(speaking_run), str(speaking_run), "--json", str(out), "--same-backend")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.startswith("self-check, not a fidelity measurement: the same run twice (backend sim")
    assert "16 requests in both runs, 16 identical" in res.stdout
    assert "Every request is in both runs." in res.stdout
    data = json.loads(out.read_text())
    assert len(data["cells"]) == 4 and len(data["requests"]) == 16
    ratios = [v["ratio"] for item in data["cells"] + data["requests"] for v in item["metrics"].values()]
    assert ratios and all(r == 1.0 for r in ratios)
    assert data["only_sim"] == [] and data["only_real"] == []
    assert all(r["same_codec_tokens"] for r in data["requests"])


def test_fidelity_shows_the_exact_differences_of_a_hand_edited_copy(speaking_run, tmp_path):
    real = tmp_path / "real"
    shutil.copytree(speaking_run, real)
    as_jsonl_run(real)  # its spans as an old run's spans.jsonl, to edit by line
    recs = _lines(real / "requests.jsonl")
    by = {(r["arm"], r["deploy"], r["prompt_id"]): r for r in recs}
    tea = by[("pr", "cpu-stress", "c01-tea")]
    tea_codes = tea["num_codec_tokens"]
    tea["codec_tokens"] = tea["codec_tokens"][:35]
    tea["num_codec_tokens"] = 35
    tea["oracle_wer"] = 0.5
    tea["preemptions"] += 2
    recs.remove(by[("main", "cpu-reference", "c03-run")])  # only in the sim run
    extra = dict(by[("pr", "cpu-reference", "c04-stars")], prompt_id="c99-extra")  # only in the "real" run
    recs.append(extra)
    _write(real / "requests.jsonl", recs)
    spans = _lines(real / "spans.jsonl")
    plants = [s for s in spans if (s["arm"], s["deploy"], s["request"]) == ("pr", "cpu-stress", "c02-plants")]
    chunks = sum(s["nonzero_offset"] for s in plants)
    dropped = next(s for s in plants if s["nonzero_offset"])
    spans.remove(dropped)
    _write(real / "spans.jsonl", spans)

    out = tmp_path / "f.json"
    res = invoke_cli("fidelity", str(speaking_run), str(real), "--json", str(out), "--same-backend")
    assert res.exit_code == 0, res.stderr
    data = json.loads(out.read_text())
    reqs = {(r["arm"], r["deploy"], r["prompt_id"]): r for r in data["requests"]}
    m = reqs[("pr", "cpu-stress", "c01-tea")]["metrics"]
    assert m["codec_tokens"] == {"sim": tea_codes, "real": 35, "ratio": tea_codes / 35}
    assert m["oracle_wer"] == {"sim": 0.0, "real": 0.5, "ratio": 0.0}
    pre = m["preemptions"]["sim"]
    assert m["preemptions"] == {"sim": pre, "real": pre + 2, "ratio": pre / (pre + 2)}
    assert not reqs[("pr", "cpu-stress", "c01-tea")]["same_codec_tokens"]
    p = reqs[("pr", "cpu-stress", "c02-plants")]["metrics"]
    assert p["nonzero_offset_chunks"] == {"sim": chunks, "real": chunks - 1, "ratio": chunks / (chunks - 1)}
    assert p["prefill_calls"]["sim"] == p["prefill_calls"]["real"] + 1
    cells = {(c["arm"], c["deploy"]): c for c in data["cells"]}
    assert cells[("pr", "cpu-stress")]["metrics"]["oracle_wer"] == {"sim": 0.0, "real": 0.125, "ratio": 0.0}
    assert cells[("main", "cpu-reference")]["requests"] == 3
    assert data["only_sim"] == [{"arm": "main", "deploy": "cpu-reference", "repeat": 1, "prompt_id": "c03-run"}]
    assert data["only_real"] == [{"arm": "pr", "deploy": "cpu-reference", "repeat": 1, "prompt_id": "c99-extra"}]
    assert data["identical_requests"] == 13
    # the same, as printed
    assert "15 requests in both runs, 13 identical" in res.stdout
    assert "Only in the sim run sp (1): main/cpu-reference/1/c03-run" in res.stdout
    assert "Only in the real run sp (1): pr/cpu-reference/1/c99-extra" in res.stdout
    assert "codec tokens *" in res.stdout and "(* sim and real differ)" in res.stdout


def test_fidelity_bad_input_is_one_line_and_exit_2(speaking_run, tmp_path):
    def refused(*args: str) -> str:
        res = invoke_cli("fidelity", *args)
        assert res.exit_code == 2, (args, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("omni-stress: error: "), res.stderr
        return lines[0]

    assert "run directory not found" in refused(str(tmp_path / "nope"), str(speaking_run))
    (tmp_path / "empty").mkdir()
    assert "not a run directory" in refused(str(speaking_run), str(tmp_path / "empty"))
    other = tmp_path / "other"
    shutil.copytree(speaking_run, other)
    as_jsonl_run(other)
    for name in ("requests.jsonl", "spans.jsonl", "manifest.json"):
        path = other / name
        path.write_text(path.read_text().replace("cpu-reference", "x-reference").replace("cpu-stress", "x-stress"))
    line = refused(str(speaking_run), str(other), "--same-backend")
    assert "no common cells" in line and "x-stress" in line
    assert "cannot write" in refused(str(speaking_run), str(speaking_run), "--same-backend", "--json",
                                     str(tmp_path / "no" / "f.json"))
    assert "Missing argument" in refused(str(speaking_run))


def test_fidelity_imports_no_heavy_library(speaking_run, tmp_path):
    probe = ("import json, sys\nsys.argv = ['omni-stress', 'fidelity', sys.argv[1], sys.argv[1], '--same-backend']\ncode = 0\n"
             "try:\n    from harness.cli import main\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
             "print(json.dumps({'code': code, 'mods': sorted({m.split('.')[0] for m in sys.modules})}))\n")
    proc = subprocess.run([sys.executable, "-c", probe, str(speaking_run)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, check=False)
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["code"] in (0, None), proc.stderr
    assert not {"torch", "vllm", "faster_whisper", "ctranslate2", "whisper", "pandas"} & set(data["mods"])
