"""Issue 47, case 8: the streaming client against a server that misbehaves mid-stream (a real server process,
``tests/fake_vllm/bad_stream_server.py``, and the run's own client, ``harness.serve.client.run_requests``):
each request ends as an error record with its reason, nothing hangs, every request is answered."""

from __future__ import annotations

import asyncio
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from harness.serve import client as chat
from harness.serve.streaming import MAX_SSE_EVENT_BYTES, SSEParser, StreamFormatError, speech_body

SERVER = REPO / "tests" / "fake_vllm" / "bad_stream_server.py"


@pytest.fixture
def bad_server():
    proc = subprocess.Popen([sys.executable, str(SERVER)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("PORT "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.kill()
        proc.wait(timeout=60)


MODES = {
    "ok": None,
    "stall": "stalled mid-stream: nothing for 2 s after ",
    "cut": "RemoteProtocolError: ",
    "malformed": "speech.audio.delta audio: not base64 (",
    "oversized": f"oversized SSE event: over {MAX_SSE_EVENT_BYTES} bytes without its end",
    "noaudio": "the response has no audio",
    "badjson": "SSE event 'speech.audio.delta' is not JSON: '{not json'",
}


def test_every_misbehaving_stream_is_one_error_record_and_the_run_ends(bad_server: str, tmp_path: Path) -> None:
    specs = [chat.RequestSpec(mode, f"omni-stress-{mode}", speech_body("m", mode, mode="sse"),
                              tmp_path / f"{mode}.wav") for mode in MODES]
    t0 = time.monotonic()
    results = asyncio.run(chat.run_requests(bad_server, specs, request_timeout_s=120, retries=0,
                                            on_result=lambda r: None, stall_timeout_s=2,
                                            path="/v1/audio/speech"))
    assert time.monotonic() - t0 < 110  # no request waited for its request timeout
    by = {r.prompt_id: r for r in results}
    assert set(by) == set(MODES)
    assert by["ok"].error is None and by["ok"].audio_file is not None and by["ok"].audio_seconds == 0.3
    for mode, reason in MODES.items():
        if reason is None:
            continue
        assert by[mode].error is not None and by[mode].error.startswith(reason), (mode, by[mode].error)
        assert by[mode].audio_file is None


def test_without_a_stall_timeout_a_stall_ends_at_the_request_timeout(bad_server: str, tmp_path: Path) -> None:
    spec = chat.RequestSpec("stall", "omni-stress-stall", speech_body("m", "stall", mode="sse"), tmp_path / "s.wav")
    results = asyncio.run(chat.run_requests(bad_server, [spec], request_timeout_s=3, retries=0,
                                            on_result=lambda r: None, path="/v1/audio/speech"))
    assert results[0].error == "timed out after 3 s (request timeout)"


def test_a_line_sent_in_many_reads_is_joined_once_and_an_endless_one_refused() -> None:
    p = SSEParser(max_event_bytes=1 << 20)
    assert p.feed(b"event: x\ndata: ") == []
    for _ in range(100):
        assert p.feed(b"a" * 1000) == []
    events = p.feed(b"\n\n")
    assert [(e.event, len(e.data)) for e in events] == [("x", 100_000)]
    with pytest.raises(StreamFormatError, match=r"^oversized SSE event: over 1048576 bytes without its end"):
        for _ in range(2000):
            p.feed(b"data: " + b"b" * 1000)
