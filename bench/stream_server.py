"""A ``/v1/audio/speech`` server that streams PCM on a known schedule and logs when it emitted each chunk
(the client-capacity bench's server, ``bench/client_capacity.py``).

    python bench/stream_server.py [--cpu N]

binds 127.0.0.1 on a free port, prints ``PORT <n>`` on stdout (the caller waits on that line) and serves
until killed. One asyncio process, raw HTTP/1.1 on ``asyncio.Protocol`` (no framework: the server must
cost far less per chunk than the client it measures).

``POST /v1/audio/speech`` with ``stream: true``: the wire format of vLLM-Omni 0.30.0's
``serving_speech.py`` (``docs/streaming.md``): HTTP chunked ``text/event-stream``, one
``event: speech.audio.delta`` / ``data: {"type", "audio": base64, "response_format": "pcm"}`` event per
chunk, then ``speech.audio.done`` with ``usage``, each event in its own HTTP chunk. The schedule is the
body's ``capacity`` object: ``chunks`` events of ``frames`` 16-bit mono frames each, chunk k emitted at
``received + lead_s + phase_s + k * interval_s`` (``lead_s``: the time to the first audio, after the
response's headers have gone). Every chunk's sample 0 holds its index (the rest is a fixed
pattern), so the client's audio says which chunk is which.

Emission times: ``time.perf_counter()`` read immediately before the chunk's bytes are handed to the
socket (no await between). On Linux ``perf_counter`` is ``clock_gettime(CLOCK_MONOTONIC)``, one clock
for every process on the machine, so the client's stamps (``perf_counter`` too) and these are on the
same time line; the bench checks ``time.get_clock_info`` says so in both processes.
``GET /emissions`` returns ``{"clock": ..., "requests": {X-Request-Id: {"received", "scheduled",
"emitted"}}}`` (then forgets them); ``GET /health`` answers 200.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import struct
import sys
import time
from typing import Any

PATTERN = struct.pack("<h", 1000) * 4096  # the fixed samples after each chunk's index


def pcm_chunk(index: int, frames: int) -> bytes:
    """Chunk ``index``: sample 0 is the index (mod 32768), the rest the fixed pattern."""
    body = (PATTERN * (frames // 4096 + 1))[: 2 * (frames - 1)]
    return struct.pack("<h", index % 32768) + body


def http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def sse_event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def delta_event(index: int, frames: int) -> bytes:
    audio = base64.b64encode(pcm_chunk(index, frames)).decode()
    return http_chunk(sse_event("speech.audio.delta", {"type": "speech.audio.delta", "audio": audio,
                                                       "response_format": "pcm"}))


class Server:
    def __init__(self) -> None:
        self.log: dict[str, dict[str, Any]] = {}
        self._events: dict[tuple[int, int], bytes] = {}

    def event(self, index: int, frames: int) -> bytes:
        key = (index, frames)
        if key not in self._events:
            self._events[key] = delta_event(index, frames)
        return self._events[key]


class Conn(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.task: asyncio.Task | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        if self.busy:
            return
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buf[:head_end].decode("latin-1").split("\r\n")
        method, path, _ = head[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
        length = int(headers.get("content-length", "0"))
        if len(self.buf) < head_end + 4 + length:
            return
        body = self.buf[head_end + 4: head_end + 4 + length]
        self.buf = self.buf[head_end + 4 + length:]
        received = time.perf_counter()
        self.busy = True
        if method == "POST" and path == "/v1/audio/speech":
            self.task = asyncio.ensure_future(self._speech(json.loads(body), headers.get("x-request-id", ""), received))
        elif method == "GET" and path == "/emissions":
            log, self.server.log = self.server.log, {}
            self._plain(200, json.dumps({"clock": time.get_clock_info("perf_counter").implementation,
                                         "requests": log}).encode())
        elif method == "GET" and path == "/health":
            self._plain(200, b"{}")
        else:
            self._plain(404, b'{"error":{"message":"not found"}}')

    def _plain(self, status: int, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(data)}\r\n\r\n".encode() + data)
        self._done()

    def _done(self) -> None:
        self.busy = False
        if self.buf:
            self._next()

    async def _speech(self, body: dict[str, Any], rid: str, received: float) -> None:
        assert self.transport is not None
        sched = body.get("capacity") or {}
        n, frames = int(sched.get("chunks", 10)), int(sched.get("frames", 2400))
        interval, phase = float(sched.get("interval_s", 0.1)), float(sched.get("phase_s", 0.0))
        lead = float(sched.get("lead_s", 0.05))
        scheduled = [received + lead + phase + k * interval for k in range(n)]
        emitted: list[float] = []
        self.server.log[rid] = {"received": received, "scheduled": scheduled, "emitted": emitted}
        events = [self.server.event(k, frames) for k in range(n)]  # built before the clock starts
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
        for at, ev in zip(scheduled, events):
            wait = at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            emitted.append(time.perf_counter())
            self.transport.write(ev)
        done = sse_event("speech.audio.done", {"type": "speech.audio.done", "usage": {"output_tokens": n}})
        self.transport.write(http_chunk(done) + b"0\r\n\r\n")
        self.task = None
        self._done()


async def serve() -> None:
    loop = asyncio.get_running_loop()
    server = Server()
    srv = await loop.create_server(lambda: Conn(server), "127.0.0.1", 0, backlog=1024)
    print(f"PORT {srv.sockets[0].getsockname()[1]}", flush=True)
    await srv.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
