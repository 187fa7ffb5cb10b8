"""Issue 48 item 4: the client-capacity bench's arithmetic (exact), its server and client end to end at a
few streams (every chunk arrived, errors computed: no timing thresholds here, the targets live in
bench/client_capacity.py), the SSE parser's faster line search against the one it replaced, and the
streamed run's refusal above the measured ceiling."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import yaml

from clikit import SMALL, assert_one_line_error
from conftest import invoke_cli
from harness.config import LoadSettings
from harness.errors import UserError
from harness.serve import capacity
from harness.serve.streaming import SSEEvent, SSEParser

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import client_capacity as bench  # noqa: E402


# ---------------------------------------------------------------------------- the arithmetic


def test_arrivals_are_the_send_plus_ttfa_plus_the_gaps() -> None:
    assert capacity.arrivals(100.0, 0.25, [0.125, 0.5, 0.0]) == [100.25, 100.375, 100.875, 100.875]
    assert capacity.arrivals(2.0, 0.5, []) == [2.5]


def test_arrival_errors_are_arrival_minus_emission_chunk_by_chunk() -> None:
    assert capacity.arrival_errors([100.25, 100.375, 100.875], [100.0, 100.25, 100.875]) == [0.25, 0.125, 0.0]
    assert capacity.arrival_errors([1.0, 1.5], [1.125, 1.5]) == [-0.125, 0.0]  # a clock that disagrees shows
    with pytest.raises(ValueError, match="2 chunks arrived, 3 were emitted"):
        capacity.arrival_errors([1.0, 2.0], [0.5, 1.5, 1.75])


def test_percentile_is_nearest_rank() -> None:
    values = [0.5, 0.25, 0.125, 1.0]  # sorted: 0.125 0.25 0.5 1.0
    assert capacity.percentile(values, 50) == 0.25
    assert capacity.percentile(values, 75) == 0.5
    assert capacity.percentile(values, 76) == 1.0
    assert capacity.percentile(values, 99) == 1.0
    assert capacity.percentile(values, 100) == 1.0
    assert capacity.percentile(values, 1) == 0.125
    assert capacity.percentile(list(range(1, 201)), 99) == 198
    with pytest.raises(ValueError):
        capacity.percentile([], 50)
    with pytest.raises(ValueError):
        capacity.percentile([1.0], 0)


def test_the_ceiling_is_the_last_level_before_one_fell_behind() -> None:
    lv = [{"streams": 1, "fell_behind": False}, {"streams": 16, "fell_behind": False},
          {"streams": 64, "fell_behind": True}, {"streams": 256, "fell_behind": False}]
    assert bench.ceiling(lv) == 16
    assert bench.ceiling([{"streams": 1, "fell_behind": True}]) is None
    runs = [{"streams": 4, "failures": [], "p99_ms": 0.5, "p50_ms": 0.25},
            {"streams": 4, "failures": [], "p99_ms": 2.0, "p50_ms": 0.25},
            {"streams": 4, "failures": [], "p99_ms": 0.75, "p50_ms": 0.25}]
    s = bench.summarize(runs)
    assert s["p99_ms"] == {"min": 0.5, "median": 0.75} and not s["fell_behind"]
    assert bench.summarize([{**runs[0], "failures": ["lost"]}])["fell_behind"]


def test_streams_in_flight_per_load_mode() -> None:
    assert capacity.streams_in_flight("all", None, 100) == 100
    assert capacity.streams_in_flight("concurrency", 8, 100) == 8
    assert capacity.streams_in_flight("concurrency", 800, 100) == 100
    assert capacity.streams_in_flight("poisson", None, 100) is None


# ---------------------------------------------------------------------------- server and client, 4 streams


def test_the_bench_measures_every_chunk_of_four_streams(tmp_path: Path) -> None:
    with bench.StreamServer() as server:
        r = bench.run_level(server, 4, chunks=6, interval_s=0.02, frames=480, workdir=tmp_path)
    assert r["failures"] == []
    assert r["streams"] == 4 and r["chunks"] == 6 + 7 + 9 + 10  # lengths spread: chunks + chunks * i // streams
    assert r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    assert r["min_ms"] > 0  # an arrival is after its emission on the one clock
    assert r["cpu_s"] > 0 and "server_late_p99_ms" in r
    assert list(tmp_path.iterdir()) == []  # each stream's WAV checked (chunk order) and removed


# ---------------------------------------------------------------------------- the SSE parser


class _OldSSEParser(SSEParser):
    """The parser as it was before the bench (a byte-by-byte line search): the reference."""

    def feed(self, data: bytes) -> list[SSEEvent]:
        self._buf += data
        out: list[SSEEvent] = []
        while True:
            cut = None
            for i, b in enumerate(self._buf):
                if b == 0x0A:
                    cut = self._buf[:i], i + 1
                    break
                if b == 0x0D:
                    if i + 1 < len(self._buf):
                        cut = self._buf[:i], i + 2 if self._buf[i + 1] == 0x0A else i + 1
                    break
            if cut is None:
                return out
            line, used = cut
            self._buf = self._buf[used:]
            event = self._line(line.decode("utf-8", errors="replace"))
            if event is not None:
                out.append(event)


@pytest.mark.parametrize("seed", range(20))
def test_the_sse_parser_reads_what_it_read_before(seed: int) -> None:
    rnd = random.Random(seed)
    ends = [b"\n", b"\r\n", b"\r"]
    parts = []
    for _ in range(rnd.randint(1, 12)):
        end = rnd.choice(ends)
        if rnd.random() < 0.3:
            parts.append(b": comment" + end)
        if rnd.random() < 0.5:
            parts.append(b"event: speech.audio.delta" + rnd.choice(ends))
        for _ in range(rnd.randint(1, 3)):
            parts.append(b"data: " + bytes(rnd.choice(b"ab\xc3\xa9{}\":= ") for _ in range(rnd.randint(0, 40))) + end)
        parts.append(rnd.choice(ends))
    stream = b"".join(parts) + (b"data: tail" if seed % 3 == 0 else b"")
    cuts = sorted(rnd.sample(range(1, len(stream)), min(len(stream) - 1, rnd.randint(0, 15))))
    pieces = [stream[a:b] for a, b in zip([0] + cuts, cuts + [len(stream)])]
    new, old = SSEParser(), _OldSSEParser()
    for piece in pieces:
        assert new.feed(piece) == old.feed(piece)
        assert new.pending == old.pending
    assert new.close() == old.close()


# ---------------------------------------------------------------------------- the refusal


def _many_prompts(tmp_path: Path, n: int) -> Path:
    doc = {**SMALL, "name": "many", "prompts": [{**SMALL["prompts"][i % 4], "id": f"p{i:03d}"} for i in range(n)]}
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_streamed_run_above_the_ceiling_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(capacity.OVERLOAD_ENV, raising=False)
    n = capacity.CLIENT_CEILING_STREAMS + 1
    res = invoke_cli("run", "--backend", "vllm-omni", "--arm", "pr", "--deploy", "cpu-reference", "--prompts",
                     str(_many_prompts(tmp_path, n)), "--asr", "none", "--out", str(tmp_path / "out"), "--stream")
    assert_one_line_error(res, f"--stream: deploy 'cpu-reference' holds {n} streams in flight (load all), above the "
                               f"client's measured ceiling of {capacity.CLIENT_CEILING_STREAMS}",
                          f"{capacity.OVERLOAD_ENV}=1")
    assert not (tmp_path / "out").exists()  # refused before a run directory exists


def test_the_ceiling_check_by_load_and_its_override(monkeypatch: pytest.MonkeyPatch) -> None:
    class D:
        def __init__(self, load: LoadSettings) -> None:
            self.name, self.load = "d", load

    monkeypatch.delenv(capacity.OVERLOAD_ENV, raising=False)
    top = capacity.CLIENT_CEILING_STREAMS
    capacity.check_streams([D(LoadSettings())], top)  # at the ceiling: fine
    capacity.check_streams([D(LoadSettings("concurrency", concurrency=top))], 10 * top)
    capacity.check_streams([D(LoadSettings("poisson", rate=1.0))], 10 * top)  # not known in advance
    with pytest.raises(UserError, match=f"holds {top + 1} streams in flight \\(load concurrency {top + 1}\\)"):
        capacity.check_streams([D(LoadSettings("concurrency", concurrency=top + 1))], 10 * top)
    monkeypatch.setenv(capacity.OVERLOAD_ENV, "1")
    capacity.check_streams([D(LoadSettings())], 10 * top)


# ---------------------------------------------------------------------------- the stamping transport


def test_the_stamping_transport_stamps_reads_and_maps_a_refused_connection(tmp_path: Path) -> None:
    import asyncio
    import socket
    import time

    import httpx

    from harness.serve.netstamp import StampedStream, arrival, stamping_transport

    async def go(url: str) -> tuple[list[float], float, float]:
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=0)
        async with httpx.AsyncClient(trust_env=False, transport=stamping_transport(limits)) as client:
            body = {"stream": True, "capacity": {"chunks": 3, "frames": 48, "interval_s": 0.01, "lead_s": 0.0}}
            sent = time.perf_counter()
            stamps = []
            async with client.stream("POST", url + "/v1/audio/speech", json=body) as resp:
                assert isinstance(resp.extensions["network_stream"], StampedStream)
                async for _ in resp.aiter_raw():
                    stamps.append(arrival(resp))
            return stamps, sent, time.perf_counter()

    with bench.StreamServer() as server:
        stamps, sent, end = asyncio.run(go(server.base_url))
    assert len(stamps) == 4 and all(sent < a <= end for a in stamps) and stamps == sorted(stamps)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there

    async def refused() -> None:
        async with httpx.AsyncClient(transport=stamping_transport(httpx.Limits())) as client:
            await client.get(f"http://127.0.0.1:{port}/health")

    with pytest.raises(httpx.ConnectError):  # a transport error, so run_requests retries it as before
        asyncio.run(refused())
