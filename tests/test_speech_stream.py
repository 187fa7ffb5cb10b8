"""Issue 31 item 3: the ``/v1/audio/speech`` client against a real local server process
(``tests/fixtures/pcm_speech_server.py``) that streams known PCM with known delays, in the three
envelopes of vLLM-Omni 0.30.0 (whole body, SSE ``speech.audio.delta``, raw audio bytes).

Exact: frames, bytes, chunk counts, the WAV written, and every relation the definitions imply
between measured values (an underrun starts exactly when the audio before it ran out). Timings are
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
    "spaced": [[0.1, 800], [0.3, 800], [0.3, 800]],
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


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_sse_stream_measured_chunk_by_chunk(server: str, fmt: str) -> None:
    r = _send(server, "burst", "sse", fmt)
    assert r.error is None and r.status == 200, r.error
    m = r.metrics
    # a WAV stream's header comes in a delta of its own: a delta without frames, not an audio chunk
    assert (r.deltas, m.chunks, m.frames, m.sample_rate) == (5 if fmt == "wav" else 4, 4, FRAMES["burst"], RATE)
    assert m.chunk_frames == (800, 800, 8000, 800) and r.usage == {"output_tokens": 4}
    assert _pcm_of(r.wav) == (RATE, pcm_bytes(0, FRAMES["burst"]))
    assert m.ttfa_s >= 0.2 and len(m.gaps_s) == 3
    assert m.gaps_s[0] >= 0.6 and m.gaps_s[1] >= 0.05 and m.gaps_s[2] >= 0.05
    assert len(m.underruns) == 1, m.underruns  # the 0.6 s wait after 0.1 s of audio; 1 s of audio covers the rest
    under = m.underruns[0]
    assert abs(under.start_s - (m.ttfa_s + 0.1)) < 1e-9 and abs(under.length_s - (m.gaps_s[0] - 0.1)) < 1e-9
    assert m.underrun_s == under.length_s and m.end_s >= m.ttfa_s + sum(m.gaps_s)
    assert abs(m.rtf - m.end_s / (FRAMES["burst"] / RATE)) < 1e-12


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_raw_audio_stream_measured_read_by_read(server: str, fmt: str) -> None:
    r = _send(server, "spaced", "audio", fmt)
    assert r.error is None, r.error
    m = r.metrics
    assert (m.chunks, m.chunk_frames, m.frames) == (3, (800, 800, 800), 2400)  # the header rode with chunk 1
    assert _pcm_of(r.wav) == (RATE, pcm_bytes(0, 2400))
    assert m.ttfa_s >= 0.1 and all(g >= 0.3 for g in m.gaps_s) and len(m.gaps_s) == 2
    assert len(m.underruns) == 2  # 0.1 s of audio per 0.3 s: the player runs dry before each later chunk
    for under, gap in zip(m.underruns, m.gaps_s):
        assert abs(under.length_s - (gap - 0.1)) < 1e-9
    assert abs(m.underruns[0].start_s - (m.ttfa_s + 0.1)) < 1e-9


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
