"""Client capacity (issue 48 item 4): how many concurrent streams the streaming client stamps faithfully.

    /work/main/.venv/bin/python bench/client_capacity.py [--levels 1,16,64,256] [--repeats 3]
        [--chunks 30] [--interval 0.1] [--frames 2400] [--json bench/client_capacity.json]

A local server process (``bench/stream_server.py``, pinned to CPU 1) streams ``/v1/audio/speech`` SSE
(``speech.audio.delta`` events, 24 kHz PCM, vLLM-Omni 0.30.0's wire format) on a known schedule and logs
each chunk's emission time; this process, pinned to CPU 0, sends N requests at once through the run's
own client (``harness.serve.client.run_requests`` with the speech path: ``_Sender`` ->
``send_speech`` -> ``SpeechStream``, every read stamped with ``perf_counter`` as a run stamps it),
then puts each chunk's measured arrival (``send + TTFA + gaps``, the metrics a record carries) beside
its emission. Both processes read ``perf_counter``, which on Linux is ``CLOCK_MONOTONIC``, one clock
for the machine (checked in both processes).

Schedule per stream: ``--chunks`` chunks of ``--frames`` frames every ``--interval`` s (default 0.1 s
of audio every 0.1 s: a real-time stream), the first at ``received + phase``; the N streams' phases
are spread evenly over one interval (a server's decode steps do not all land on one instant). Per
level: the error of every chunk's arrival against its emission (p50, p99, max; a chunk lost or two read
as one is a failure, never folded in), the client's CPU seconds (``time.process_time``: this process,
which does nothing else while the streams run) per stream and per chunk, the core's share it used,
and the server's own lateness against its schedule (emission - scheduled: a server that could not keep
up would change the load, not the error). A level **falls behind** when the median over the repeats
of its p99 error exceeds ``ERROR_BOUND_S`` (1 ms, ``harness.serve.capacity``); the **ceiling** is the
largest level below which no level fell behind.

The machine is shared (2 cores, other jobs on both): every level runs ``--repeats`` times and the
table gives the min and median over the repeats, with the load average around the run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
import wave
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from harness.serve.capacity import ERROR_BOUND_S, arrival_errors, arrivals, percentile  # noqa: E402
from harness.serve.client import RequestSpec, run_requests  # noqa: E402
from harness.serve.streaming import SPEECH_PATH, speech_body  # noqa: E402

SERVER = Path(__file__).resolve().parent / "stream_server.py"


class StreamServer:
    """``bench/stream_server.py`` as a child process (its port read from its ``PORT n`` line)."""

    def __init__(self, cpu: int | None = None) -> None:
        argv = [sys.executable, str(SERVER)] + (["--cpu", str(cpu)] if cpu is not None else [])
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.close()
            raise RuntimeError(f"stream server did not start (said {line!r})")
        self.base_url = f"http://127.0.0.1:{int(line.split()[1])}"

    def emissions(self) -> dict[str, Any]:
        with httpx.Client(trust_env=False, timeout=30) as c:
            return c.get(self.base_url + "/emissions").json()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> StreamServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chunk_indices(wav_path: Path, frames: int) -> list[int]:
    """Sample 0 of each chunk in the request's WAV (the server writes the chunk's index there)."""
    with wave.open(str(wav_path), "rb") as w:
        pcm = w.readframes(w.getnframes())
    return [struct.unpack_from("<h", pcm, 2 * k * frames)[0] for k in range(len(pcm) // (2 * frames))]


def run_level(server: StreamServer, streams: int, *, chunks: int, interval_s: float, frames: int,
              workdir: Path, lead_s: float = 0.1) -> dict[str, Any]:
    """N streams at once through the run's client; every chunk's arrival error and the client's CPU."""
    run = uuid.uuid4().hex[:8]
    specs = []
    # lengths chunks .. 2 * chunks - 1 and phases spread over one interval, the phase a permutation of the
    # stream's index (37 is prime to every level): streams of one length do not end together
    lengths = [chunks + chunks * i // streams for i in range(streams)]
    for i in range(streams):
        schedule = {"chunks": lengths[i], "frames": frames, "interval_s": interval_s, "lead_s": lead_s,
                    "phase_s": interval_s * (i * 37 % streams) / streams}
        body = speech_body("capacity-bench", "capacity", mode="sse", response_format="pcm",
                           extra={"capacity": schedule})
        specs.append(RequestSpec(prompt_id=f"s{i}", tag=f"cap-{run}-{i}", body=body,
                                 audio_file=workdir / f"{run}-{i}.wav"))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    results = asyncio.run(run_requests(server.base_url, specs, request_timeout_s=120.0, retries=0,
                                       on_result=lambda r: None, path=SPEECH_PATH))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    log = server.emissions()["requests"]
    errors: list[float] = []
    lateness: list[float] = []
    failures: list[str] = []
    for spec, res, chunks in zip(specs, results, lengths):
        emitted = log.get(spec.tag, {}).get("emitted", [])
        lateness += [e - s for e, s in zip(emitted, log.get(spec.tag, {}).get("scheduled", []))]
        if res.error is not None or res.stream is None or res.stream_sent_at is None:
            failures.append(f"{spec.tag}: {res.error or 'no stream metrics'}")
            continue
        m = res.stream
        if m.chunk_frames != (frames,) * chunks or len(emitted) != chunks:
            failures.append(f"{spec.tag}: {m.chunks} chunks of {set(m.chunk_frames)} frames arrived, "
                            f"{len(emitted)} emitted")
            continue
        if chunk_indices(spec.audio_file, frames) != list(range(chunks)):
            failures.append(f"{spec.tag}: chunks out of order in the WAV")
            continue
        assert m.ttfa_s is not None
        errors += arrival_errors(arrivals(res.stream_sent_at, m.ttfa_s, m.gaps_s), emitted)
        spec.audio_file.unlink()
    out: dict[str, Any] = {"streams": streams, "chunks": len(errors), "failures": failures,
                           "cpu_s": round(cpu, 4), "wall_s": round(wall, 3),
                           "cpu_per_stream_ms": round(1e3 * cpu / streams, 3),
                           "cpu_per_chunk_us": round(1e6 * cpu / sum(lengths), 1),
                           "core_share": round(cpu / wall, 3) if wall else None}
    if errors:
        out.update(p50_ms=round(1e3 * percentile(errors, 50), 4), p99_ms=round(1e3 * percentile(errors, 99), 4),
                   max_ms=round(1e3 * max(errors), 4), min_ms=round(1e3 * min(errors), 4))
    if lateness:
        out["server_late_p99_ms"] = round(1e3 * percentile(lateness, 99), 3)
    return out


class _RawReader(asyncio.Protocol):
    """The floor: one stream read with nothing but a stamp and a count per ``speech.audio.delta`` event."""

    def __init__(self, request: bytes, done: asyncio.Future) -> None:
        self.request, self.done, self.buf, self.stamps = request, done, b"", []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        at = time.perf_counter()
        self.buf += data
        while (cut := self.buf.find(b"\n\n")) >= 0:
            event, self.buf = self.buf[:cut], self.buf[cut + 2:]
            if b"speech.audio.delta" in event:
                self.stamps.append(at)
            elif b"speech.audio.done" in event and not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


def floor_level(server: StreamServer, streams: int, *, chunks: int, interval_s: float, frames: int,
                lead_s: float = 0.1) -> dict[str, Any]:
    """The same schedule read by ``_RawReader`` (asyncio, no HTTP library, no parsing): what the machine,
    the loopback and the event loop cost, whatever the client. Not the client: the floor under it."""
    run = uuid.uuid4().hex[:8]
    port = int(server.base_url.rsplit(":", 1)[1])
    lengths = [chunks + chunks * i // streams for i in range(streams)]

    async def go() -> list[_RawReader]:
        loop = asyncio.get_running_loop()
        readers = []
        for i in range(streams):
            schedule = {"chunks": lengths[i], "frames": frames, "interval_s": interval_s, "lead_s": lead_s,
                        "phase_s": interval_s * (i * 37 % streams) / streams}
            body = json.dumps(speech_body("capacity-bench", "capacity", mode="sse", response_format="pcm",
                                          extra={"capacity": schedule})).encode()
            head = (f"POST {SPEECH_PATH} HTTP/1.1\r\nhost: 127.0.0.1\r\nx-request-id: raw-{run}-{i}\r\n"
                    f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")
            readers.append(_RawReader(head.encode() + body, loop.create_future()))
        await asyncio.gather(*(loop.create_connection(lambda r=r: r, "127.0.0.1", port) for r in readers))
        await asyncio.gather(*(r.done for r in readers))
        return readers

    cpu0 = time.process_time()
    readers = asyncio.run(go())
    cpu = time.process_time() - cpu0
    log = server.emissions()["requests"]
    errors: list[float] = []
    failures = []
    for i, r in enumerate(readers):
        emitted = log.get(f"raw-{run}-{i}", {}).get("emitted", [])
        if len(r.stamps) != len(emitted) or len(emitted) != lengths[i]:
            failures.append(f"raw-{run}-{i}: {len(r.stamps)} stamped, {len(emitted)} emitted")
            continue
        errors += arrival_errors(r.stamps, emitted)
    out: dict[str, Any] = {"streams": streams, "chunks": len(errors), "failures": failures,
                           "cpu_per_chunk_us": round(1e6 * cpu / sum(lengths), 1)}
    if errors:
        out.update(p50_ms=round(1e3 * percentile(errors, 50), 4), p99_ms=round(1e3 * percentile(errors, 99), 4),
                   max_ms=round(1e3 * max(errors), 4))
    return out


def summarize(level_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Min and median over the repeats; a level with a failed stream always falls behind."""
    def stat(key: str) -> dict[str, float] | None:
        vals = [r[key] for r in level_runs if r.get(key) is not None]
        return {"min": min(vals), "median": round(statistics.median(vals), 4)} if vals else None

    p99 = stat("p99_ms")
    failed = any(r["failures"] for r in level_runs)
    return {"streams": level_runs[0]["streams"], "repeats": len(level_runs),
            "p50_ms": stat("p50_ms"), "p99_ms": p99, "max_ms": stat("max_ms"),
            "cpu_per_stream_ms": stat("cpu_per_stream_ms"), "cpu_per_chunk_us": stat("cpu_per_chunk_us"),
            "core_share": stat("core_share"), "server_late_p99_ms": stat("server_late_p99_ms"),
            "failures": sum(len(r["failures"]) for r in level_runs),
            "fell_behind": failed or p99 is None or p99["median"] > 1e3 * ERROR_BOUND_S}


def ceiling(levels: list[dict[str, Any]]) -> int | None:
    """The largest level with no level at or below it fallen behind (None: the first one already did)."""
    best = None
    for lv in sorted(levels, key=lambda x: x["streams"]):
        if lv["fell_behind"]:
            break
        best = lv["streams"]
    return best


def table(levels: list[dict[str, Any]]) -> str:
    head = ("| Streams | p50 error ms (min / med) | p99 error ms (min / med) | max ms (med) | CPU per stream ms (med) "
            "| CPU per chunk us (med) | core share (med) | floor p99 ms | Fell behind |")
    lines = [head, "|" + "---|" * 9]

    def mm(s: dict[str, float] | None) -> str:
        return f"{s['min']:.3f} / {s['median']:.3f}" if s else "-"

    def med(s: dict[str, float] | None, fmt: str = ".3f") -> str:
        return format(s["median"], fmt) if s else "-"

    for lv in levels:
        fl = lv.get("floor") or {}
        floor = f"{fl['p99_ms']:.3f}" if fl.get("p99_ms") is not None else "-"
        behind = "yes" if lv["fell_behind"] else "no"
        if lv["failures"]:
            behind += f" ({lv['failures']} failed streams)"
        lines.append(f"| {lv['streams']} | {mm(lv['p50_ms'])} | {mm(lv['p99_ms'])} | {med(lv['max_ms'])} "
                     f"| {med(lv['cpu_per_stream_ms'])} | {med(lv['cpu_per_chunk_us'], '.1f')} "
                     f"| {med(lv['core_share'], '.2f')} | {floor} | {behind} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,16,64,256", help="comma-separated concurrent stream counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=30, help="chunks per stream")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between a stream's chunks")
    ap.add_argument("--frames", type=int, default=2400, help="24 kHz frames per chunk")
    ap.add_argument("--client-cpu", type=int, default=0)
    ap.add_argument("--server-cpu", type=int, default=1)
    ap.add_argument("--no-floor", action="store_true", help="skip the raw-reader floor (one run per level)")
    ap.add_argument("--no-rt", action="store_true",
                    help="leave both processes in the normal scheduling class (default: SCHED_FIFO priority 1, "
                         "so that the neighbours' time slices on a shared core are not measured as the client's)")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "client_capacity.json")
    ap.add_argument("--no-json", action="store_true")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    clock = time.get_clock_info("perf_counter").implementation
    if clock != "clock_gettime(CLOCK_MONOTONIC)":
        print(f"perf_counter is {clock}, not CLOCK_MONOTONIC: the two processes' stamps are not comparable",
              file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {args.client_cpu})
    load_before = os.getloadavg()
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in levels}
    with StreamServer(args.server_cpu) as server, tempfile.TemporaryDirectory(prefix="client-capacity-") as tmp:
        rt = not args.no_rt
        if rt:
            try:
                for pid in (0, server.proc.pid):
                    os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(1))
            except PermissionError:
                print("SCHED_FIFO refused (not root?): measuring in the normal scheduling class", file=sys.stderr)
                rt = False
        if server.emissions()["clock"] != clock:
            print("the server's perf_counter is not the client's clock", file=sys.stderr)
            return 2
        run_level(server, 4, chunks=5, interval_s=args.interval, frames=args.frames, workdir=Path(tmp))  # warm-up
        floors = {}
        for rep in range(args.repeats):  # interleaved: a noisy minute spreads over every level
            for n in levels:
                if rep == 0 and not args.no_floor:
                    floors[n] = floor_level(server, n, chunks=args.chunks, interval_s=args.interval,
                                            frames=args.frames)
                    print(f"floor streams {n}: p50 {floors[n].get('p50_ms')} ms p99 {floors[n].get('p99_ms')} ms",
                          file=sys.stderr, flush=True)
                r = run_level(server, n, chunks=args.chunks, interval_s=args.interval, frames=args.frames,
                              workdir=Path(tmp))
                r["loadavg_1m"] = round(os.getloadavg()[0], 2)
                runs[n].append(r)
                print(f"rep {rep + 1} streams {n}: p50 {r.get('p50_ms')} ms p99 {r.get('p99_ms')} ms "
                      f"max {r.get('max_ms')} ms cpu/stream {r['cpu_per_stream_ms']} ms share {r['core_share']} "
                      f"load {r['loadavg_1m']}" + (f" FAILURES {r['failures'][:2]}" if r["failures"] else ""),
                      file=sys.stderr, flush=True)
    summary = [summarize(runs[n]) for n in levels]
    for lv in summary:
        fl = floors.get(lv["streams"])
        lv["floor"] = {k: fl[k] for k in ("p50_ms", "p99_ms", "max_ms", "cpu_per_chunk_us", "failures") if k in fl} \
            if fl else None
    ceil = ceiling(summary)
    print(table(summary))
    print(f"\nceiling: {ceil} streams (largest level whose median p99 error <= {1e3 * ERROR_BOUND_S:g} ms, "
          f"none below it over)")
    if not args.no_json:
        doc = {
            "bench": "bench/client_capacity.py", "issue": "48 item 4",
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "clock": clock,
                     "httpx": httpx.__version__, "loadavg_before": [round(x, 2) for x in load_before],
                     "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                     "client_cpu": args.client_cpu, "server_cpu": args.server_cpu, "shared": True,
                     "scheduling": "SCHED_FIFO 1 (client and server)" if rt else "SCHED_OTHER"},
            "schedule": {"chunks": args.chunks, "interval_s": args.interval, "frames": args.frames,
                         "sample_rate": 24000, "wire": "/v1/audio/speech SSE speech.audio.delta, pcm",
                         "lengths": "stream i: chunks + chunks * i // streams", "lead_s": 0.1,
                         "phases": "phase of stream i: interval * (37 * i mod streams) / streams"},
            "bound_ms": 1e3 * ERROR_BOUND_S, "levels": summary, "ceiling": ceil, "runs": runs,
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
