"""Issue 31 item 3: the ``/v1/audio/speech`` client against a real local server process
(``tests/fixtures/pcm_speech_server.py``) that streams known PCM with known delays, in the three
envelopes of vLLM-Omni 0.30.0 (whole body, SSE ``speech.audio.delta``, raw audio bytes).

Exact: frames, bytes, SSE chunk counts, the WAV written, and every relation the definitions imply
between measured values (each underrun recomputed by hand from the measured arrivals). Arrivals are
bounded below by the server's own delays (a loaded machine only makes them later)."""

from __future__ import annotations

import asyncio
import io
import json
import select
import subprocess
import sys
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.serve.speech import main as speech_main
from harness.serve.speech import send_all
from harness.serve.streaming import speech_body

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from pcm_speech_server import RATE, pcm_bytes  # noqa: E402

SCRIPT = {
    # 0.1 s of audio, then 0.6 s of silence on the wire: one underrun; then 1 s of audio 50 ms later,
    # then 0.1 s: no underrun (each arrives before the audio before it has played)
    "burst": [[0.2, 800], [0.6, 800], [0.05, 8000], [0.05, 800]],
    # raw bytes: chunks far enough apart that the client reads each on its own
    "spaced": [[0.1, 800], [0.4, 800], [0.4, 800]],
}
FRAMES = {k: sum(int(f) for _, f in v) for k, v in SCRIPT.items()}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    script = tmp_path_factory.mktemp("speech") / "script.json"
    script.write_text(json.dumps(SCRIPT))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "fixtures" / "pcm_speech_server.py"),
                             str(script)], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # its PORT line, or its exit (EOF)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("PORT "), (line, proc.poll())
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _send(url: str, text: str, mode: str, fmt: str = "pcm") -> object:
    return asyncio.run(send_all(url, [speech_body("m", text, mode=mode, response_format=fmt)], timeout_s=60,
                                pcm_rate=RATE))[0]


def _pcm_of(wav_bytes: bytes) -> tuple[int, bytes]:
    with wave.open(io.BytesIO(wav_bytes), "rb") as w:
        return w.getframerate(), w.readframes(w.getnframes())


def _arrivals(m: object) -> list[float]:
    out = [m.ttfa_s]
    for gap in m.gaps_s:
        out.append(out[-1] + gap)
    return out


def _underruns_by_hand(arrivals: list[float], frames: tuple[int, ...], rate: int) -> list[tuple[float, float]]:
    """The definition once more, written plainly: the player starts at the first arrival, waits when dry."""
    out, start = [], arrivals[0]
    for k in range(1, len(arrivals)):
        due = start + frames[k - 1] / rate
        if arrivals[k] > due:
            out.append((due, arrivals[k] - due))
        start = max(arrivals[k], due)
    return out


def _check_timing(m: object, script: list[list[float]]) -> None:
    """What a loaded machine cannot change: no chunk arrives before the server's delays have passed
    (a gap alone can be shorter than its delay when the chunk before it was read late), and the
    underruns are those the measured arrivals imply."""
    cumulative, total = [], 0.0
    for delay, _ in script:
        total += delay
        cumulative.append(total)
    arrivals = _arrivals(m)
    assert all(a >= c for a, c in zip(arrivals, cumulative)), (arrivals, cumulative)
    assert len(m.gaps_s) == m.chunks - 1 and m.end_s >= arrivals[-1]
    by_hand = _underruns_by_hand(arrivals, m.chunk_frames, m.sample_rate)
    assert len(by_hand) == len(m.underruns)
    for (start, length), u in zip(by_hand, m.underruns):
        assert abs(u.start_s - start) < 1e-9 and abs(u.length_s - length) < 1e-9
    assert abs(m.underrun_s - sum(length for _, length in by_hand)) < 1e-9


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_sse_stream_measured_chunk_by_chunk(server: str, fmt: str) -> None:
    r = _send(server, "burst", "sse", fmt)
    assert r.error is None and r.status == 200, r.error
    m = r.metrics
    # SSE events are the server's chunks whatever the reads: exact counts. A WAV stream's header comes in a
    # delta of its own: a delta without frames, not an audio chunk.
    assert (r.deltas, m.chunks, m.frames, m.sample_rate) == (5 if fmt == "wav" else 4, 4, FRAMES["burst"], RATE)
    assert m.chunk_frames == (800, 800, 8000, 800) and r.usage == {"output_tokens": 4}
    assert _pcm_of(r.wav) == (RATE, pcm_bytes(0, FRAMES["burst"]))
    _check_timing(m, SCRIPT["burst"])
    # the 0.6 s of silence after 0.1 s of audio is an underrun (unless the client read the first chunk
    # 0.5 s late); it starts exactly when that 0.1 s has played
    assert m.underruns and abs(m.underruns[0].start_s - (m.ttfa_s + 0.1)) < 1e-9
    assert abs(m.underruns[0].length_s - (m.gaps_s[0] - 0.1)) < 1e-9
    assert abs(m.rtf - m.end_s / (FRAMES["burst"] / RATE)) < 1e-12


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_raw_audio_stream_measured_read_by_read(server: str, fmt: str) -> None:
    r = _send(server, "spaced", "audio", fmt)
    assert r.error is None, r.error
    m = r.metrics
    assert m.frames == 2400 and _pcm_of(r.wav) == (RATE, pcm_bytes(0, 2400))  # the header rode with chunk 1
    # chunks are the client's reads: 0.4 s apart they come one per read, but a client descheduled that
    # long reads two at once, so the count is bounded, the frames exact
    assert 1 <= m.chunks <= 3 and all(f % 800 == 0 for f in m.chunk_frames), m.chunk_frames
    _check_timing(m, SCRIPT["spaced"])
    assert m.underruns  # 0.1 s of audio per 0.4 s: the player runs dry


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_a_whole_body_is_measured_too(server: str, fmt: str) -> None:
    """``stream: false``: nothing arrives before all the delays have passed; the audio is the same."""
    r = _send(server, "burst", "none", fmt)
    assert r.error is None and r.mode == "none", r.error
    m = r.metrics
    assert m.frames == FRAMES["burst"] and m.ttfa_s >= 0.9 and _pcm_of(r.wav) == (RATE, pcm_bytes(0, FRAMES["burst"]))
    assert m.chunks >= 1 and len(m.gaps_s) == m.chunks - 1 and m.end_s >= m.ttfa_s


def test_server_errors_are_one_line_per_request(server: str) -> None:
    assert _send(server, "error", "sse").error == "server error: engine died"
    bad = _send(server, "nobody", "sse")
    assert (bad.status, bad.error) == (400, "HTTP 400: unknown input 'nobody'")
    mp3 = asyncio.run(send_all(server, [{"input": "burst", "response_format": "mp3"}], timeout_s=10))[0]
    assert mp3.error == "response_format 'mp3': only pcm and wav can be measured" and mp3.status is None


def test_the_command_prints_metrics_and_refuses_bad_input(server: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a.wav"
    assert speech_main([server, "spaced", "--mode", "sse", "--rate", str(RATE), "--wav", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["chunks"], printed["frames"], len(printed["gaps_s"]), printed["error"]) == (3, 2400, 2, None)
    assert _pcm_of(out.read_bytes()) == (RATE, pcm_bytes(0, 2400))
    assert speech_main(["http://example.com", "hi"]) == 2
    assert "only a server on this machine" in capsys.readouterr().err
    assert speech_main([server, "nobody"]) == 2
    assert capsys.readouterr().err.strip().endswith("/v1/audio/speech: HTTP 400: unknown input 'nobody'")
