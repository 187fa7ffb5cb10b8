"""Stamping bytes when the event loop receives them, not when the reading task gets to them.

Why: with N streams in one event loop, a read's bytes wait in the loop until the task reading that
stream runs, and it runs after every task woken before it has parsed its own chunk (httpx, httpcore,
h11, the SSE and JSON parsing, base64): a stamp taken in the reading task (``perf_counter()`` as the
piece reaches ``aiter_raw``) is late by the parsing of every other stream read at the same moment. The
client-capacity bench (``bench/client_capacity.py``) measured that queue: p99 above 1 ms from about
128 streams on one core. Here the stamp is taken in ``data_received``, which the loop calls for
every ready socket before any task runs, so the parsing moves off the stamping path.

``stamping_transport(limits, ...)`` is httpx's own ``AsyncHTTPTransport`` whose connection pool opens
its plain-TCP connections through ``StampingBackend``: an asyncio ``Protocol`` per connection that keeps
each received piece of bytes with its ``perf_counter()``. ``arrival(response)`` is the stamp of the
bytes the last read of that response's connection returned: an ``aiter_raw`` piece is yielded right
after the read that completed it (h11 yields a chunk's data as soon as it has it), so that is when the
piece's last byte arrived, as before, without the queue. Anything else (TLS, a transport without the
backend, an httpx whose transport is built otherwise) leaves ``arrival`` None and the caller stamps
as before.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from typing import Any

import httpcore
import httpx


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.pieces: collections.deque[tuple[bytes, float]] = collections.deque()
        self.eof = False
        self.exc: Exception | None = None
        self.waiter: asyncio.Future | None = None
        self.paused = False
        self.drained: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.pieces.append((data, time.perf_counter()))
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.exc = exc
        self._wake()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class StampedStream(httpcore.AsyncNetworkStream):
    """One plain-TCP connection; ``last_read_at``: when the bytes of the last ``read`` arrived."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport, self._protocol = transport, protocol
        self.last_read_at: float | None = None

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        p = self._protocol
        if not p.pieces and not p.eof:
            p.waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(p.waiter, timeout)
            except asyncio.TimeoutError:
                raise httpcore.ReadTimeout("timed out reading") from None
            finally:
                p.waiter = None
        if not p.pieces:
            if p.exc is not None:
                raise httpcore.ReadError(str(p.exc) or type(p.exc).__name__)
            return b""
        data, at = p.pieces.popleft()
        if len(data) > max_bytes:
            p.pieces.appendleft((data[max_bytes:], at))
            data = data[:max_bytes]
        self.last_read_at = at
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        p = self._protocol
        if self._transport.is_closing():
            raise httpcore.WriteError("connection closed")
        self._transport.write(buffer)
        if p.paused:
            p.drained = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(p.drained, timeout)
            except asyncio.TimeoutError:
                raise httpcore.WriteTimeout("timed out writing") from None
            finally:
                p.drained = None

    async def aclose(self) -> None:
        self._transport.close()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("the stamping backend carries plain TCP only (a local server)")

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # httpcore asks before reusing a kept connection: data or EOF waiting
            return bool(self._protocol.pieces) or self._protocol.eof
        if info == "socket":
            return self._transport.get_extra_info("socket")
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        return None


class StampingBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None, socket_options: Any = None) -> StampedStream:
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await asyncio.wait_for(
                loop.create_connection(_Protocol, host, port,
                                       local_addr=(local_address, 0) if local_address else None), timeout)
        except asyncio.TimeoutError:
            raise httpcore.ConnectTimeout(f"timed out connecting to {host}:{port}") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc) or type(exc).__name__) from None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in socket_options or ():
                sock.setsockopt(*option)
        return StampedStream(transport, protocol)  # type: ignore[arg-type]

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("the stamping backend carries TCP only")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def stamping_transport(limits: httpx.Limits) -> httpx.AsyncBaseTransport:
    """httpx's transport with the stamping backend under its pool (plain HTTP: the servers measured are
    local); httpx's own transport unchanged when its pool is not where this httpx keeps it."""
    transport = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)
    pool = getattr(transport, "_pool", None)
    if isinstance(pool, httpcore.AsyncConnectionPool) and hasattr(pool, "_network_backend"):
        pool._network_backend = StampingBackend()
    return transport


def arrival(response: httpx.Response) -> float | None:
    """When the bytes of the response's last read arrived (None: not a stamped connection)."""
    stream = response.extensions.get("network_stream")
    return getattr(stream, "last_read_at", None)


class StreamStalled(Exception):
    """A streamed answer sent nothing for the stall timeout after its first bytes."""


async def pieces(resp: httpx.Response, stall_s: float = 0.0):
    """``resp.aiter_raw()``, failing with ``StreamStalled`` when ``stall_s`` (> 0) passes with no byte after
    the body's first (a server stuck mid-stream). The wait for the first bytes is the request timeout's: a
    request queued behind others legitimately waits for its first bytes (``--stall-timeout``)."""
    it = resp.aiter_raw().__aiter__()
    received = 0
    while True:
        try:
            if stall_s > 0 and received:
                piece = await asyncio.wait_for(it.__anext__(), stall_s)
            else:
                piece = await it.__anext__()
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise StreamStalled(f"stalled mid-stream: nothing for {stall_s:g} s after {received} bytes "
                                f"(--stall-timeout)") from None
        received += len(piece)
        yield piece
