"""End to end on a real ``vllm serve --omni``, on CPU: the speaking tiny Qwen2.5-Omni (docs/speaking-model.md),
arms main and pr bound into the real Talker worker, the CPU reference and stress deploys, four prompts, the
audio streamed (``--stream``: ``stream: true`` on ``/v1/chat/completions``, measured as it arrives).

Runs the CLI as a user would (``omni-stress tiny-model``, then ``omni-stress run --backend vllm-omni``,
``gate``, ``transcribe``) and asserts on the real trace (what vLLM-Omni 0.30.0's runner scheduled and
what each arm returned) and on what the real Talker *said*: its codec stream read back through the
speaking model's table is the oracle transcript, scored against the text the Thinker returned.
Needs the real environment (``scripts/install-real-cpu.sh`` -> ``.venv-omni``); skipped without it,
except under ``OMNI_STRESS_REQUIRE_REAL=1`` (``.ci/run`` sets it), where its absence fails.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import wave
from collections import defaultdict
from pathlib import Path

import pytest

from harness.families.qwen2_5_omni import speaking
from harness.config import load_prompts
from harness.records import read_requests

from conftest import REAL_PY, records_by_cell, spans_by_cell

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "harness.cli"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    tmp = tmp_path_factory.mktemp("real")
    model = tiny_model
    t0 = time.monotonic()
    check = subprocess.run([str(REAL_PY), "-m", "harness.families.qwen2_5_omni.speaking_check", str(model), "--dtype", "bfloat16"],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
    (tmp / "speaking_check.json").write_text(check.stdout.strip().splitlines()[-1] if check.stdout.strip() else "{}")
    sys.stderr.write(f"[real e2e] speaking check: {time.monotonic() - t0:.1f} s, rc {check.returncode}\n")
    t0 = time.monotonic()
    run = subprocess.run(
        [*CLI, "run", "--backend", "vllm-omni", "--platform", "cpu", "--serve-python", str(REAL_PY),
         "--model", str(model), "--arm", "main", "--arm", "pr", "--deploy", "cpu-reference", "--deploy", "cpu-stress",
         "--prompts", "cpu_smoke", "--asr", "none", "--stream", "--out", str(tmp), "--run-id", "real", "--quiet",
         "--health-timeout", "900", "--request-timeout", "900"],
        cwd=tmp, capture_output=True, text=True, timeout=2700)
    sys.stderr.write(f"[real e2e] run: {time.monotonic() - t0:.1f} s\n{run.stdout}\n")
    (tmp / "run_stdout.txt").write_text(run.stdout)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    return tmp / "real"


def test_the_weights_follow_the_rules_in_transformers(real_run: Path) -> None:
    """The construction, checked outside vLLM in bfloat16: the reply said byte for byte, babble without
    a BOS row, and a replayed row garbles exactly the next word (memory through attention)."""
    result = json.loads((real_run.parent / "speaking_check.json").read_text())
    reply = result["reply"]
    assert result["correct"] == {"ok": True, "min_prob": 1.0, "said": reply}
    assert result["no_bos"] == {"ok": True, "min_prob": 1.0, "said": ""}
    assert result["end"] == {"ok": True, "min_prob": 1.0, "said": reply}  # dropped PAD rows: one SILENCE fewer
    assert result["long"]["ok"] is True and result["long"]["min_prob"] == 1.0
    replay = result["replay"]
    assert (replay["next_changed"], replay["next_byte_kept"], replay["rest_unchanged"], replay["garbled"]) == (
        True, True, True, 1)
    assert replay["said"] == reply.replace("the", "<unk>", 1) and result["ok"] is True



def test_the_real_thinker_says_each_reply_and_the_talker_speaks_it_unstressed(real_run: Path) -> None:
    replies = {p.id: p.reply for p in load_prompts("cpu_smoke").prompts}
    for arm in ("main", "pr"):
        for pid, r in records_by_cell(real_run)[(arm, "cpu-reference")].items():
            assert r.thinker_text == replies[pid], (arm, pid)
            # pr: the bytes, then the end region (SILENCE at text-EOS and the first PAD, EOS at the
            # persistent PAD); main (0.30.0, no EOS/PAD rows): the bytes, then EOS at once
            assert r.codec_tokens == speaking.encode_reply(replies[pid], end=arm == "pr"), (arm, pid)
            assert (r.oracle_transcript, r.oracle_wer) == (replies[pid], 0.0), (arm, pid)


def test_pr_speaks_under_stress_as_unstressed_and_main_does_not(real_run: Path) -> None:
    cells = records_by_cell(real_run)
    for pid, r in cells[("pr", "cpu-stress")].items():
        assert r.oracle_wer == cells[("pr", "cpu-reference")][pid].oracle_wer == 0.0, pid
        assert r.oracle_transcript == r.thinker_text, pid
    main = cells[("main", "cpu-stress")]
    assert sum(r.oracle_wer > 0.5 for r in main.values()) >= 3, {k: r.oracle_wer for k, r in main.items()}


def test_every_cell_ran_at_the_default_trace_level(real_run: Path) -> None:
    """Issue 34: the manifest says at which --trace level the latencies were measured (default contract)."""
    manifest = json.loads((real_run / "manifest.json").read_text())
    assert manifest["trace"] == "contract"
    assert [c["trace"] for c in manifest["cells"]] == ["contract"] * 4
    assert "Trace level (--trace): contract in every cell" in (real_run / "summary.md").read_text()


def test_the_server_audio_lasts_one_50_hz_frame_per_codec_token(real_run: Path) -> None:
    for r in read_requests(real_run):
        assert r.num_codec_tokens > 0 and abs(r.audio_seconds - r.num_codec_tokens / 50) < 0.021, (
            r.arm, r.deploy, r.prompt_id, r.audio_seconds, r.num_codec_tokens)


def test_the_shipped_gate_passes_pr_and_shows_the_bug_in_main(real_run: Path) -> None:
    gate = subprocess.run([*CLI, "gate", str(real_run)], cwd=real_run, capture_output=True, text=True, timeout=600)
    sys.stderr.write(f"[real e2e] gate:\n{gate.stdout}\n")
    assert gate.returncode == 0, (gate.stdout[-3000:], gate.stderr[-2000:])
    assert "PASS   candidate-stress-matches-reference: pr/cpu-stress run 1 [candidate]" in gate.stdout
    assert "PASS   baseline-stress-shows-bug (expected failure): main/cpu-stress run 1 [baseline]" in gate.stdout


def test_whisper_hears_the_server_audio(real_run: Path) -> None:
    """The audio path end to end: the server's Code2Wav WAV goes through Whisper (random Code2Wav
    weights: noise, so only that it is transcribed is asserted, not what is heard)."""
    r = read_requests(real_run)[0]
    out = subprocess.run([*CLI, "transcribe", str(real_run / r.audio_path), "--no-cache"], cwd=real_run,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and r.audio_path.split("/")[-1] in out.stdout, (out.stdout, out.stderr[-2000:])


def test_every_request_answered_with_audio(real_run: Path) -> None:
    records = read_requests(real_run)
    by_cell = defaultdict(list)
    for r in records:
        by_cell[(r.arm, r.deploy)].append(r)
    assert sorted(by_cell) == [("main", "cpu-reference"), ("main", "cpu-stress"), ("pr", "cpu-reference"),
                               ("pr", "cpu-stress")]
    for cell, recs in by_cell.items():
        assert sorted(r.prompt_id for r in recs) == ["c01-tea", "c02-plants", "c03-run", "c04-stars"], cell
        for r in recs:
            assert r.error is None, (cell, r.prompt_id, r.error)
            assert r.backend == "vllm-omni"
            wav = real_run / r.audio_path
            assert wav.read_bytes()[:4] == b"RIFF", wav
            assert r.talker_prompt_len is not None and r.events.talker_calls > 0


def test_reference_deploy_has_no_stress_events(real_run: Path) -> None:
    cells = spans_by_cell(real_run)
    for arm in ("main", "pr"):
        spans = cells[(arm, "cpu-reference")]
        assert spans, arm
        assert sum(s.nonzero_offset for s in spans) == 0, arm
        assert sum(s.cross_boundary for s in spans) == 0, arm


def test_stress_deploy_chunks_and_replays_across_the_prompt(real_run: Path) -> None:
    cells = spans_by_cell(real_run)
    records = read_requests(real_run)
    for arm in ("main", "pr"):
        spans = cells[(arm, "cpu-stress")]
        assert sum(s.nonzero_offset for s in spans) > 0, arm
        assert sum(s.cross_boundary for s in spans) >= 1, arm
        assert all(s.n <= 32 for s in spans), arm  # max_num_batched_tokens
        assert sum(r.preemptions for r in records if (r.arm, r.deploy) == (arm, "cpu-stress")) > 0, arm


def test_main_mismatches_every_multi_row_prefill_call_and_misaligns(real_run: Path) -> None:
    spans = spans_by_cell(real_run)[("main", "cpu-stress")]
    prefill = [s for s in spans if s.c < s.P and s.n > 1]
    assert prefill
    assert all(s.rows != s.n for s in prefill), [(s.c, s.n, s.rows) for s in prefill if s.rows == s.n]
    assert all(s.rows == s.P for s in prefill)  # 0.30.0's prefill branch returns the whole prompt
    assert sum((s.misaligned_text or 0) for s in spans) > 0


def test_pr_conforms_in_the_real_server(real_run: Path) -> None:
    cells = spans_by_cell(real_run)
    for deploy in ("cpu-reference", "cpu-stress"):
        spans = cells[("pr", deploy)]
        assert all(s.misaligned_text is not None and s.misaligned_end is not None for s in spans), deploy
        assert sum(s.row_mismatch for s in spans) == 0, deploy
        assert sum(s.misaligned_text + s.misaligned_end for s in spans) == 0, deploy
        assert all(s.error is None for s in spans), deploy


def test_manifest_says_which_implementation_ran(real_run: Path) -> None:
    manifest = json.loads((real_run / "manifest.json").read_text())
    want = {"main": "harness.families.qwen2_5_omni.main:MainTalker", "pr": "harness.families.qwen2_5_omni.pr:FixedTalker"}
    for cell in manifest["cells"]:
        sys.stderr.write(f"[real e2e] {cell['arm']}/{cell['deploy']}: {json.dumps(cell['serve_seconds'])}\n")
        assert cell["serve_seconds"]["server_start_s"] > 0 and cell["serve_seconds"]["requests_s"] > 0
        impl = cell["implementation"]
        assert impl["platform"] == "cpu" and impl["arm"] == want[cell["arm"]]
        workers = impl["workers"]
        assert workers and all(w["arm"] == want[cell["arm"]] and "error" not in w for w in workers), workers
        assert all(w["vllm-omni_version"] == "0.30.0" and w["model_sha256"] for w in workers)
        assert "talker_preprocess" in workers[0]["bound_methods"]


def test_the_sim_measured_against_the_real_server(real_run: Path) -> None:
    """Issue 19 item 4: the sim with the speaking model's Talker (``--sim-talker speaking``) on the same
    arms, deploys and prompts, compared request by request (``omni-stress fidelity``). What each side
    *said* must agree exactly (the Talker is the same); the scheduler events are printed, and their
    differences explained in docs/fidelity.md."""
    out = real_run.parent / "sim"
    sim = subprocess.run(
        [*CLI, "run", "--sim-talker", "speaking", "--arm", "main", "--arm", "pr", "--deploy", "cpu-reference",
         "--deploy", "cpu-stress", "--prompts", "cpu_smoke", "--asr", "none", "--out", str(out), "--run-id", "sim",
         "--quiet"], cwd=real_run.parent, capture_output=True, text=True, timeout=1200)
    assert sim.returncode == 0, (sim.stdout[-2000:], sim.stderr[-2000:])
    fid_json = real_run.parent / "fidelity.json"
    fid = subprocess.run([*CLI, "fidelity", str(out / "sim"), str(real_run), "--json", str(fid_json)],
                         cwd=real_run.parent, capture_output=True, text=True, timeout=600)
    sys.stderr.write(f"[real e2e] fidelity:\n{fid.stdout}\n")
    assert fid.returncode == 0, fid.stderr[-2000:]
    result = json.loads(fid_json.read_text())
    assert result["only_sim"] == [] and result["only_real"] == [] and len(result["requests"]) == 16
    same = 0
    for req in result["requests"]:
        wer = req["metrics"]["oracle_wer"]
        assert wer["sim"] == wer["real"], req  # the same words said, request by request
        if req["same_schedule"]:  # identical spans: both sides compare row identities (issue 32 item 2)
            same += 1
            for key in ("misaligned_text", "misaligned_end"):
                assert req["metrics"][key]["sim"] == req["metrics"][key]["real"], (key, req)
        if req["arm"] == "pr" or req["deploy"] == "cpu-reference":
            assert req["same_codec_tokens"] is True, req  # a speaking Talker: the identical codec stream
    assert same >= 8, same  # at least the unstressed cells run identical spans
    for cell in result["cells"]:
        m = cell["metrics"]
        if cell["deploy"] == "cpu-reference":  # unstressed: the two backends agree on every count
            assert all(v["sim"] == v["real"] for v in m.values()), cell
        else:  # both stressed the Talker the same way (the counts themselves are in docs/fidelity.md)
            assert m["cross_boundary_replays"]["sim"] >= 1 and m["cross_boundary_replays"]["real"] >= 1, cell


# ---------------------------------------------------------------------------- streamed audio (issue 31 item 3)
# What vLLM-Omni 0.30.0 does, pinned exactly: its chat path streams audio (``chat_completion_stream_generator``
# builds an audio choice per stage-2 output), but Qwen2.5-Omni's stage chain has no async-chunk path, so
# Code2Wav decodes each request once, after its Talker has finished: one audio chunk per request, holding all
# of it (codec tokens x 480 frames at 24 kHz, one 50 Hz frame per token), so no gap and no underrun, and the
# first audio bytes arrive after the Talker's first codec token (the trace-derived TTFA). The main run above
# streams (one server start fewer than a run of its own, docs/streaming.md).

FRAMES_PER_CODEC_TOKEN = 480  # 24000 Hz / the codec's 50 Hz


def test_every_request_streams_its_whole_audio_in_one_chunk(real_run: Path) -> None:
    for r in read_requests(real_run):
        key = (r.arm, r.deploy, r.prompt_id)
        sys.stderr.write(f"[real stream] {key}: TTFA {r.stream_ttfa_s} s (trace: first codec token {r.ttfa_s} s), "
                         f"end {r.stream_end_s} s, E2E {r.wall_s} s, chunks {r.stream_chunks}, "
                         f"gaps {r.stream_gaps_s}, underruns {r.stream_underruns}, RTF {r.rtf}\n")
        assert r.error is None, (key, r.error)
        frames = r.num_codec_tokens * FRAMES_PER_CODEC_TOKEN
        assert (r.stream_chunks, r.stream_audio_events, r.stream_chunk_frames, r.stream_sample_rate) == (
            1, 1, [frames], 24000), key
        assert (r.stream_gaps_s, r.stream_underruns, r.stream_underrun_s) == ([], [], 0.0), key  # gaps = chunks - 1
        with wave.open(io.BytesIO((real_run / r.audio_path).read_bytes()), "rb") as w:
            assert (w.getframerate(), w.getnframes(), w.getsampwidth()) == (24000, frames, 2), key
        assert r.audio_seconds == frames / 24000, key
        # the first audio bytes come after the Talker's first codec token and before the stream's end
        assert 0 < r.ttfa_s < r.stream_ttfa_s <= r.stream_end_s <= r.wall_s, r
        assert abs(r.rtf - r.wall_s / r.audio_seconds) < 0.01, key
    # pr unstressed: the Thinker's text arrived as text deltas, whole; the Talker said it (bytes, end region)
    replies = {p.id: p.reply for p in load_prompts("cpu_smoke").prompts}
    for pid, r in records_by_cell(real_run)[("pr", "cpu-reference")].items():
        assert r.thinker_text == replies[pid] and r.oracle_wer == 0.0, pid
        assert r.codec_tokens == speaking.encode_reply(replies[pid], end=True) and r.num_codec_tokens == 72, pid


def test_the_run_prints_the_streamed_table_and_the_manifest_says_stream(real_run: Path) -> None:
    stdout = (real_run.parent / "run_stdout.txt").read_text()
    assert "Streamed audio (--stream, measured by the client)" in stdout
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("Arm ") and "Streamed" in line)
    rows = [line.split() for line in lines[head + 2:head + 6]]
    assert sorted(row[:2] for row in rows) == [["main", "cpu-reference"], ["main", "cpu-stress"],
                                               ["pr", "cpu-reference"], ["pr", "cpu-stress"]]
    for row in rows:
        assert row[2:4] == ["1", "4/4"], row
        assert row[4] == "0" and row[-1] == "n/a", row  # no failed stream; Qwen2.5-Omni has no connector windows
        # one chunk per request: no gap, no stall, continuity and goodput 100 %
        assert row[-15:-5] == ["n/a", "0.000", "/", "0.000", "100%", "/", "100%", "/", "100%", "100%"], row
    manifest = json.loads((real_run / "manifest.json").read_text())
    assert manifest["stream"] is True
    assert "<details><summary>Streamed audio</summary>" in (real_run / "summary.md").read_text()
