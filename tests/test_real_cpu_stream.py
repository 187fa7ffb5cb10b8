"""Issue 31 item 3, end to end on a real ``vllm serve --omni`` on CPU: ``omni-stress run --stream`` sends the
cpu_smoke prompts to the speaking tiny Qwen2.5-Omni with ``stream: true`` (arm pr, cpu-reference: one server)
and measures the audio as it arrives.

What vLLM-Omni 0.30.0 does, pinned exactly: its chat path streams audio (``chat_completion_stream_generator``
builds an audio choice per stage-2 output), but Qwen2.5-Omni's stage chain has no async-chunk path, so
Code2Wav decodes each request once, after its Talker has finished: one audio chunk per request, holding all
of it (codec tokens x 480 frames at 24 kHz, one 50 Hz frame per token), so no gap and no underrun, and the
first audio bytes arrive after the Talker's first codec token (the trace-derived TTFA). Needs
``.venv-omni``; skipped without it unless ``OMNI_STRESS_REQUIRE_REAL=1``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import wave
from pathlib import Path

import pytest

from harness import speaking
from harness.config import load_prompts
from harness.records import read_requests

ROOT = Path(__file__).resolve().parents[1]
REAL_PY = ROOT / ".venv-omni" / "bin" / "python"
CLI = [sys.executable, "-m", "harness.cli"]
FRAMES_PER_CODEC_TOKEN = 480  # 24000 Hz / the codec's 50 Hz

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def streamed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    if not REAL_PY.exists():
        if os.environ.get("OMNI_STRESS_REQUIRE_REAL") == "1":
            pytest.fail(f"OMNI_STRESS_REQUIRE_REAL=1 but {REAL_PY} is missing (scripts/install-real-cpu.sh)")
        pytest.skip("no real CPU environment (.venv-omni): run scripts/install-real-cpu.sh")
    tmp = tmp_path_factory.mktemp("stream")
    built = subprocess.run([*CLI, "tiny-model", str(tmp / "tiny"), "--python", str(REAL_PY)], cwd=tmp,
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-2000:]
    t0 = time.monotonic()
    run = subprocess.run(
        [*CLI, "run", "--backend", "vllm-omni", "--platform", "cpu", "--serve-python", str(REAL_PY),
         "--model", str(tmp / "tiny"), "--arm", "pr", "--deploy", "cpu-reference", "--prompts", "cpu_smoke",
         "--asr", "none", "--stream", "--out", str(tmp), "--run-id", "stream", "--quiet",
         "--health-timeout", "900", "--request-timeout", "900"],
        cwd=tmp, capture_output=True, text=True, timeout=1500)
    sys.stderr.write(f"[real stream] run: {time.monotonic() - t0:.1f} s (load {os.getloadavg()[0]:.1f})\n"
                     f"{run.stdout}\n")
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    return tmp / "stream", run.stdout


def test_every_prompt_streams_its_whole_audio_in_one_chunk(streamed_run: tuple[Path, str]) -> None:
    run_dir, _ = streamed_run
    replies = {p.id: p.reply for p in load_prompts("cpu_smoke").prompts}
    records = read_requests(run_dir)
    assert sorted(r.prompt_id for r in records) == sorted(replies)
    for r in records:
        sys.stderr.write(f"[real stream] {r.prompt_id}: TTFA {r.stream_ttfa_s} s (trace: first codec token "
                         f"{r.ttfa_s} s), end {r.stream_end_s} s, E2E {r.wall_s} s, chunks {r.stream_chunks}, "
                         f"gaps {r.stream_gaps_s}, underruns {r.stream_underruns}, RTF {r.rtf}\n")
        assert r.error is None, (r.prompt_id, r.error)
        # the Thinker's text arrived as text deltas, whole; the Talker said it (pr: the bytes, then the end region)
        assert r.thinker_text == replies[r.prompt_id] and r.oracle_wer == 0.0
        assert r.codec_tokens == speaking.encode_reply(replies[r.prompt_id], end=True) and r.num_codec_tokens == 72
        frames = r.num_codec_tokens * FRAMES_PER_CODEC_TOKEN
        assert (r.stream_chunks, r.stream_audio_events, r.stream_chunk_frames, r.stream_sample_rate) == (
            1, 1, [frames], 24000)
        assert (r.stream_gaps_s, r.stream_underruns, r.stream_underrun_s) == ([], [], 0.0)  # gaps = chunks - 1
        with wave.open(io.BytesIO((run_dir / r.audio_path).read_bytes()), "rb") as w:
            assert (w.getframerate(), w.getnframes(), w.getsampwidth()) == (24000, frames, 2)
        assert r.audio_seconds == frames / 24000
        # the first audio bytes come after the Talker's first codec token and before the stream's end
        assert 0 < r.ttfa_s < r.stream_ttfa_s <= r.stream_end_s <= r.wall_s, r
        assert abs(r.rtf - r.wall_s / r.audio_seconds) < 0.01


def test_the_run_prints_the_streamed_table_and_the_manifest_says_stream(streamed_run: tuple[Path, str]) -> None:
    run_dir, stdout = streamed_run
    assert "Streamed audio (--stream, measured by the client)" in stdout
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("Arm ") and "Streamed" in line)
    row = lines[head + 2].split()
    assert row[:4] == ["pr", "cpu-reference", "1", "4/4"]
    assert row[-5:-1] == ["1", "n/a", "0", "0.000"]  # one chunk per request: no gap, no underrun
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stream"] is True
    assert "<details><summary>Streamed audio</summary>" in (run_dir / "summary.md").read_text()
