"""A ``/v1/audio/speech`` server that streams badly on purpose (issue 47, case 8): the request's ``input``
names what it does. Raw HTTP/1.1 chunked SSE as vLLM-Omni 0.30.0 sends it (``bench/stream_server.py``).

    python tests/fake_vllm/bad_stream_server.py

binds 127.0.0.1 on a free port, prints ``PORT <n>`` (the test waits on that line) and serves until killed.

* ``ok``: three deltas of 2400 frames, then ``speech.audio.done``.
* ``stall``: one delta, then nothing (the connection stays open).
* ``cut``: one delta, then half an event, then the connection closes (no last chunk).
* ``malformed``: a delta whose ``audio`` is not base64.
* ``oversized``: one ``data:`` line that never ends (80 MiB, then the connection closes).
* ``noaudio``: HTTP 200 and ``speech.audio.done``, no delta.
* ``badjson``: an event whose data is not JSON.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys

_sys_path0 = sys.path[0]
sys.path.insert(0, _sys_path0 + "/../../bench")
from stream_server import delta_event, http_chunk, sse_event  # noqa: E402 - the bench's wire format


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = json.loads(await reader.readexactly(length)) if length else {}
        mode = body.get("input", "ok")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        if mode == "noaudio":
            writer.write(http_chunk(sse_event("speech.audio.done", {"type": "speech.audio.done"})) + b"0\r\n\r\n")
        elif mode == "malformed":
            writer.write(http_chunk(sse_event("speech.audio.delta", {"type": "speech.audio.delta",
                                                                      "audio": "!!not base64!!"})))
            writer.write(http_chunk(sse_event("speech.audio.done", {"type": "speech.audio.done"})) + b"0\r\n\r\n")
        elif mode == "badjson":
            writer.write(http_chunk(b"event: speech.audio.delta\ndata: {not json\n\n") + b"0\r\n\r\n")
        elif mode == "oversized":
            writer.write(http_chunk(b"event: speech.audio.delta\ndata: "))
            piece = http_chunk(base64.b64encode(b"\0" * (768 << 10)))  # 1 MiB of base64 per chunk
            for _ in range(80):
                writer.write(piece)
                await writer.drain()
        else:
            for k in range(3 if mode == "ok" else 1):
                writer.write(delta_event(k, 2400))
                await writer.drain()
            if mode == "ok":
                writer.write(http_chunk(sse_event("speech.audio.done", {"type": "speech.audio.done"})) + b"0\r\n\r\n")
            elif mode == "cut":
                writer.write(http_chunk(b'event: speech.audio.delta\ndata: {"type": "speech.audio.de'))
            elif mode == "stall":
                await writer.drain()
                await reader.read()  # until the client gives up and closes
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
