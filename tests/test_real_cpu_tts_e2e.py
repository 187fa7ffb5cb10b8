"""End to end on a real ``vllm serve --omni`` on CPU with the speaking tiny Qwen3-TTS (docs/families/qwen3_tts.md):
the release's ``preprocess`` (``tts-0.30.0``) and the fix (``tts-fix``, bound into the Talker worker)
under the CPU reference and stress deploys, four texts through ``/v1/audio/speech``, streamed the way the
release deploys it (``async_chunk: true``: Code2Wav decodes the connector's windows while the Talker runs,
several audio chunks per request; docs/streaming.md), and a fix whose chunker drops a frame (one cell).

One run shared by every assertion (module fixture): ``omni-stress tiny-model --family qwen3-tts``, then
``omni-stress run --backend vllm-omni --family qwen3-tts --stream``. What the real Talker *said* is its
codec stream (traced in the worker) read back through the speaking rules (the oracle transcript),
scored against the text sent. Needs the real environment (``scripts/install-real-cpu.sh`` ->
``.venv-omni``); skipped without it, except under ``OMNI_STRESS_REQUIRE_REAL=1``, where its absence fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.config import load_prompts
from harness.families.qwen3_tts import speaking as sp

from conftest import build_tiny, records_by_cell, require_real_env, run_real, spans_by_cell

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "harness.cli"]
ARMS = ("tts-0.30.0", "tts-fix")
REF, STRESS = "qwen3-tts-cpu-reference", "qwen3-tts-cpu-stress"
PROMPTS = "qwen3_tts_cpu_smoke"
CHUNKER_ARMS = ROOT / "tests" / "fixtures" / "arms_chunkers.yaml"
DROPS = "tts-fix-drops-a-frame"  # tests/fixtures/chunkers.py: drops the 6th new frame of each second window
VOICE = "tts-fix-voice-of-first"  # tests/fixtures/tts_mutants.py VoiceOfFirstRequest: a voice kept across requests
WINDOWS = [1, 25, 25, 23]  # 74 codec frames (72 bytes, then the two end-region frames) in the release's windows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_real_env()
    tmp = tmp_path_factory.mktemp("tts-real")
    model = build_tiny(tmp, "qwen3-tts", "tts e2e")
    real = run_real(tmp, model, "qwen3-tts", "real", "--arm", ARMS[0], "--arm", ARMS[1], "--deploy", REF, "--deploy",
                    STRESS, "--prompts", PROMPTS, label="tts e2e")
    # a chunker that corrupts the windows, and a voice kept across requests: one cell each, unpreempted (cwd: their
    # modules import)
    run_real(tmp, model, "qwen3-tts", "drops", "--arms-file", str(CHUNKER_ARMS), "--arm", DROPS, "--arm", VOICE,
             "--deploy", REF, "--prompts", PROMPTS, label="tts e2e", cwd=ROOT, timeout=1800)
    return real




def test_every_request_answered_with_streamed_audio(real_run: Path) -> None:
    texts = {p.id: p.reply for p in load_prompts(PROMPTS).prompts}
    cells = records_by_cell(real_run)
    assert sorted(cells) == sorted((a, d) for a in ARMS for d in (REF, STRESS))
    for cell, recs in cells.items():
        assert sorted(recs) == sorted(texts), cell
        for pid, r in recs.items():
            assert r.error is None and r.backend == "vllm-omni", (cell, pid, r.error)
            assert r.reference_text == texts[pid] and r.talker_prompt_len == sp.PROMPT_LEN, (cell, pid)
            assert (real_run / r.audio_path).read_bytes()[:4] == b"RIFF"
            # streamed: the first audio bytes came, every gap and underrun is recorded
            assert r.stream_ttfa_s is not None and 0 < r.stream_ttfa_s <= r.stream_end_s, (cell, pid)
            assert r.stream_chunks >= 1 and len(r.stream_gaps_s) == r.stream_chunks - 1, (cell, pid)
            assert r.stream_sample_rate == 24000 and r.stream_underrun_s >= 0.0, (cell, pid)
            assert r.stream_sent_at is not None and r.chunk_windows is not None, (cell, pid)


def test_every_stream_arrives_in_the_connectors_windows(real_run: Path) -> None:
    """``async_chunk: true`` as the release ships it: the first window holds one frame, then 25 a window; each
    window is one audio chunk of 1920 samples a frame, so a whole request streams in four chunks."""
    for cell, recs in records_by_cell(real_run).items():
        for pid, r in recs.items():
            if r.stream_failed is None:  # whole: its audio is its codec stream's frames, window by window
                assert r.chunk_frames_sent == sp_windows(len(r.codec_tokens)), (cell, pid)
                assert [f // 1920 for f in r.stream_chunk_frames] == r.chunk_frames_sent, (cell, pid)
            assert r.stream_chunks > 1 and r.chunk_windows == len(r.chunk_frames_sent), (cell, pid)
        if cell[1] == REF:
            assert all(r.chunk_frames_sent == WINDOWS for r in recs.values()), cell


def sp_windows(frames: int) -> list[int]:
    from harness.chunk_contract import SHIPPED

    return SHIPPED.boundaries(frames)


def test_the_chunk_contract_holds_unpreempted_and_breaks_once_per_replay(real_run: Path) -> None:
    """Unpreempted, every window of both arms carries its request's frames in order (0 violations). A replay
    (preemption by recompute) breaks one window of its request under 0.30.0's runner, whatever the arm: the
    fix's window holds the recomputed frames wrong (codebook 0 reads 0 where the Talker fed its token), the
    release's loses the request's last frames (its audio is short of its codec stream: a failed stream)."""
    cells = records_by_cell(real_run)
    for arm in ARMS:
        assert [(r.chunk_violations, r.stream_failed) for r in cells[(arm, REF)].values()] == [(0, None)] * 4, arm
        for pid, r in cells[(arm, STRESS)].items():
            assert r.chunk_violations == (1 if r.preemptions else 0), (arm, pid, r.chunk_violation)
    for pid, r in cells[("tts-fix", STRESS)].items():
        assert r.stream_failed is None, pid
        assert r.chunk_violation is None or (" frames wrong in frames " in r.chunk_violation
                                             and ": 0 where the Talker fed " in r.chunk_violation), pid
    for pid, r in cells[("tts-0.30.0", STRESS)].items():
        assert (r.stream_failed is not None) == (r.preemptions > 0), (pid, r.stream_failed)
        assert r.stream_failed is None or r.stream_failed.startswith("truncated audio: "), pid


def test_a_chunker_that_drops_a_frame_is_caught_and_fails_the_gate(real_run: Path) -> None:
    drops = real_run.parent / "drops"
    recs = records_by_cell(drops)[(DROPS, REF)]
    assert len(recs) == 4
    for pid, r in recs.items():
        assert (r.chunk_violations, r.chunk_violation) == (1, "window 1: 1 frame lost inside frames 1-25"), pid
        assert r.chunk_frames_sent == [1, 24, 25, 23] and r.codec_tokens == sp.encode_reply(r.reference_text), pid
        assert r.stream_failed == ("truncated audio: 140160 samples, its 74 codec frames decode to 142080 "
                                   "(1 frames missing)"), pid
        assert r.oracle_wer == 0.0, pid  # what the Talker said is right: only what Code2Wav was sent is not
    gate = subprocess.run([*CLI, "gate", str(drops)], cwd=drops, capture_output=True, text=True, timeout=600)
    assert gate.returncode == 1, gate.stdout[-3000:]
    assert (f"FAIL   candidate-chunk-contract-unpreempted: {DROPS}/{REF} run 1 [candidate]\n"
            "         FAIL  max_chunk_violations: Code2Wav windows that broke the chunk contract = 4 > 0") in gate.stdout
    assert f"FAIL   candidate-streams-whole: {DROPS}/{REF} run 1 [candidate]" in gate.stdout
    assert f"FAIL   candidate-chunk-contract: {DROPS}/{REF} run 1 [candidate]" in gate.stdout


def test_a_voice_kept_across_requests_is_caught_by_the_worker(real_run: Path) -> None:
    """Issue 45, items 3 and 6: an arm whose state outlives a request on the real server. The smoke set mixes four
    voices; whichever request the server builds first (they arrive concurrently), the other three run their
    speaker row (position P - 3 = 6) in its voice: one misaligned position each, seen by the worker's value
    comparison (the tiny checkpoint's speaker rows are distinct). The speech is unchanged (the speaking rules
    hear no voice): only the contract catches it, and the gate fails the arm on it."""
    drops = real_run.parent / "drops"
    recs = records_by_cell(drops)[(VOICE, REF)]
    assert sorted((r.events.misaligned_text_positions, r.events.misaligned_end_positions) for r in recs.values()) == [
        (0, 0), (1, 0), (1, 0), (1, 0)]
    assert all(r.oracle_wer == 0.0 and r.error is None for r in recs.values())
    spans = [s for s in spans_by_cell(drops)[(VOICE, REF)] if s.misaligned_text]
    assert [(s.c <= 6 < s.c + s.n, s.misaligned_text) for s in spans] == [(True, 1)] * 3
    gate = subprocess.run([*CLI, "gate", str(drops)], cwd=drops, capture_output=True, text=True, timeout=600)
    assert (f"FAIL   candidate-contract: {VOICE}/{REF} run 1 [candidate]\n"
            "         FAIL  max_misaligned_text_positions: misaligned positions in the text region = 3 > 0"
            ) in gate.stdout


def test_the_streaming_figures_are_reported(real_run: Path) -> None:
    data = json.loads((real_run / "streaming.json").read_text())
    cells = {(c["arm"], c["deploy"]): c for c in data["cells"]}
    assert sorted(cells) == sorted((a, d) for a in ARMS for d in (REF, STRESS))
    for key, c in cells.items():
        assert c["slo"] == {"ttfp_s": 10.0, "max_stall_s": None}, key
        assert 0 < c["median_audio_ttfp_ms"] <= c["p99_audio_ttfp_ms"] <= c["max_audio_ttfp_ms"], key
        assert c["audio_throughput"] > 0 and c["benchmark_duration_s"] > 0, key
        assert [q["chunk_windows"] for q in c["requests"]] == [len(q["chunk_frames_sent"]) for q in c["requests"]]
    assert cells[("tts-fix", STRESS)]["failed"] == 0 and cells[("tts-fix", STRESS)]["request_goodput_rate"] == 1.0
    release = cells[("tts-0.30.0", STRESS)]
    assert release["failed"] == sum(r.preemptions > 0 for r in records_by_cell(real_run)[("tts-0.30.0", STRESS)].values())
    assert release["request_goodput_rate"] == 1 - release["failed"] / 4
    summary = (real_run / "summary.md").read_text()
    assert "TTFP p50 / p90 / p99 / max (s)" in summary and "goodput SLO: TTFP <= 10 s" in summary


def test_both_arms_say_every_text_unstressed(real_run: Path) -> None:
    texts = {p.id: p.reply for p in load_prompts(PROMPTS).prompts}
    cells = records_by_cell(real_run)
    for arm in ARMS:
        for pid, r in cells[(arm, REF)].items():
            assert r.codec_tokens == sp.encode_reply(texts[pid]), (arm, pid)
            assert (r.oracle_transcript, r.oracle_wer) == (texts[pid], 0.0), (arm, pid)


def test_the_fix_says_every_text_under_stress_and_the_release_does_not(real_run: Path) -> None:
    texts = {p.id: p.reply for p in load_prompts(PROMPTS).prompts}
    cells = records_by_cell(real_run)
    for pid, r in cells[("tts-fix", STRESS)].items():
        assert r.codec_tokens == sp.encode_reply(texts[pid]), pid
        assert (r.oracle_transcript, r.oracle_wer) == (texts[pid], 0.0), pid
    # 0.30.0 on V1: a preempted request's replay gets tts_pad rows without the codec-BOS row (and, past
    # the prompt, bare codec rows): from there the Talker either babbles to the end of its text (then the
    # end region as usual) or stops at once (a bare row at the replay's last position: codec EOS). Its
    # codec stream is the text's first k bytes, said right, then one of those two; never a wrong byte.
    release = cells[("tts-0.30.0", STRESS)]
    for pid, r in release.items():
        n = len(texts[pid].encode())
        said = sp.encode_reply(texts[pid], end=False)
        k = next((i for i, (a, b) in enumerate(zip(r.codec_tokens, said)) if a != b), min(n, len(r.codec_tokens)))
        assert r.codec_tokens[k:] in ([], [sp.BABBLE] * (n - k) + [sp.SILENCE] * 2), (pid, k, r.codec_tokens[k:])
        assert (k < n) == (r.preemptions > 0), (pid, k, r.preemptions)
    assert sum(r.preemptions > 0 for r in release.values()) >= 2
    assert sum(r.oracle_wer > 0.5 for r in release.values()) >= 1, {k: r.oracle_wer for k, r in release.items()}


def test_the_stress_deploy_chunks_preempts_and_replays_across_the_prompt(real_run: Path) -> None:
    """Four 83-position requests in 5 usable KV blocks of 32: when they pass 32 positions the cache runs
    out and three are preempted, each replay crossing the prompt boundary (measured: 3 and 3 for both
    arms; the count follows the cache, not the server's timing); an 8-token budget chunks every prompt."""
    cells, records = spans_by_cell(real_run), records_by_cell(real_run)
    for arm in ARMS:
        ref = cells[(arm, REF)]
        assert ref and sum(s.nonzero_offset for s in ref) == 0 and sum(s.cross_boundary for s in ref) == 0, arm
        assert sum(r.preemptions for r in records[(arm, REF)].values()) == 0, arm
        spans = cells[(arm, STRESS)]
        assert all(s.n <= 8 for s in spans), arm  # max_num_batched_tokens
        assert sum(s.nonzero_offset for s in spans) >= len(records[(arm, STRESS)]), arm  # every prompt chunked
        assert sum(r.preemptions for r in records[(arm, STRESS)].values()) == 3, arm
        assert sum(s.cross_boundary for s in spans) == 3, arm


def test_each_position_is_traced_once_per_schedule(real_run: Path) -> None:
    """One-token decode spans go through ``preprocess_decode_batch``; the fix builds its batch from
    ``preprocess``, which is not traced again: an unpreempted request has one span per position."""
    for arm in ARMS:
        for pid, r in records_by_cell(real_run)[(arm, REF)].items():
            spans = [s for s in spans_by_cell(real_run)[(arm, REF)] if s.request == pid]
            assert sum(s.n for s in spans) == sp.PROMPT_LEN + len(r.codec_tokens), (arm, pid)


def test_the_worker_contract_check_passes_the_fix_and_counts_the_release(real_run: Path) -> None:
    cells = spans_by_cell(real_run)
    for deploy in (REF, STRESS):
        spans = cells[("tts-fix", deploy)]
        assert all(s.error is None and s.misaligned_text == 0 and s.misaligned_end == 0 for s in spans), deploy
    assert all(s.misaligned_text == 0 and s.misaligned_end == 0 for s in cells[("tts-0.30.0", REF)])
    assert sum(s.misaligned_text for s in cells[("tts-0.30.0", STRESS)]) > 0


def test_the_manifest_says_which_implementation_ran(real_run: Path) -> None:
    manifest = json.loads((real_run / "manifest.json").read_text())
    for cell in manifest["cells"]:
        sys.stderr.write(f"[tts e2e] {cell['arm']}/{cell['deploy']}: {json.dumps(cell['serve_seconds'])}\n")
        impl = cell["implementation"]
        assert impl["platform"] == "cpu"
        if cell["arm"] == "tts-fix":
            assert impl["arm"] == "harness.families.qwen3_tts.fix:Qwen3TTSFixedTalker"
            workers = impl["workers"]
            assert workers and all("error" not in w for w in workers), workers
            assert {"preprocess", "preprocess_decode_batch"} <= set(workers[0]["bound_methods"])
        else:
            assert impl["arm"] == "installed vLLM-Omni"


def test_the_shipped_gate_passes_the_fix_and_shows_the_bug(real_run: Path) -> None:
    gate = subprocess.run([*CLI, "gate", str(real_run)], cwd=real_run, capture_output=True, text=True, timeout=600)
    sys.stderr.write(f"[tts e2e] gate:\n{gate.stdout}\n")
    assert gate.returncode == 0, (gate.stdout[-3000:], gate.stderr[-2000:])
    assert f"PASS   candidate-stress-matches-reference: tts-fix/{STRESS} run 1 [candidate]" in gate.stdout
    assert f"PASS   baseline-stress-shows-bug (expected failure): tts-0.30.0/{STRESS} run 1 [baseline]" in gate.stdout
    for rule in ("candidate-streams-whole", "candidate-chunk-contract", "candidate-stress-ttfp",
                 "candidate-goodput-cpu"):
        assert f"PASS   {rule}: tts-fix/{STRESS} run 1 [candidate]" in gate.stdout, rule
    assert f"PASS   candidate-chunk-contract-unpreempted: tts-fix/{REF} run 1 [candidate]" in gate.stdout


def test_the_sim_measured_against_the_real_server(real_run: Path) -> None:
    """Issue 31 item 2: the sim's speaking Talker for this family (``--sim-talker speaking``) on the same arms,
    deploys and texts, compared request by request (``omni-stress fidelity``). The Talker is the same on both
    sides, so identical spans must give identical codec streams; the fix's rows do not depend on the spans,
    so its codes must match everywhere; the release's under stress may part where the schedules differ, and
    the comparison must say so per request (docs/fidelity.md, "Qwen3-TTS")."""
    out = real_run.parent / "sim"
    sim = subprocess.run(
        [*CLI, "run", "--family", "qwen3-tts", "--sim-talker", "speaking", "--arm", ARMS[0], "--arm", ARMS[1],
         "--deploy", REF, "--deploy", STRESS, "--prompts", PROMPTS, "--asr", "none", "--out", str(out),
         "--run-id", "sim", "--quiet"], cwd=real_run.parent, capture_output=True, text=True, timeout=1200)
    assert sim.returncode == 0, (sim.stdout[-2000:], sim.stderr[-2000:])
    fid_json = real_run.parent / "tts-fidelity.json"
    fid = subprocess.run([*CLI, "fidelity", str(out / "sim"), str(real_run), "--json", str(fid_json)],
                         cwd=real_run.parent, capture_output=True, text=True, timeout=600)
    sys.stderr.write(f"[tts e2e] fidelity:\n{fid.stdout}\n")
    assert fid.returncode == 0, fid.stderr[-2000:]
    result = json.loads(fid_json.read_text())
    assert result["only_sim"] == [] and result["only_real"] == [] and len(result["requests"]) == 16
    for req in result["requests"]:
        if req["schedule"] == "same":  # the same Talker on the same spans: the same codes and counts
            assert req["same_codec_tokens"] is True, req
            m = req["metrics"]
            assert m["misaligned_end"]["sim"] == m["misaligned_end"]["real"], req
            # the worker's check compares rows by value; the tiny checkpoint's think-tag and speaker codec rows
            # are distinct (issue 45), so a crossing replay's tts_pad rows at positions 3-6 (0.30.0 drops their
            # codec part) differ from the contract's there, as the sim's identities say: the same count
            assert m["misaligned_text"]["real"] == m["misaligned_text"]["sim"], req
        if req["arm"] == "tts-fix" or req["deploy"] == REF:
            assert req["same_codec_tokens"] is True, req
        if not req["same_codec_tokens"]:  # named, with what each side said
            assert req["said"] is not None and req["first_code_difference"] is not None, req
            assert f"{req['arm']}/{req['deploy']}/{req['repeat']}/{req['prompt_id']}: " in fid.stdout, req
