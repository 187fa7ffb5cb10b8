"""How many concurrent streams the streaming client measures faithfully (issue 48 item 4), and the
arithmetic of the bench that measured it (``bench/client_capacity.py``).

With ``--stream`` the client's own stamps are the measurement: a client that falls behind reads chunks
late and reports gaps and underruns the server never made. The bench runs this client (``run_requests``
on ``/v1/audio/speech``, the code path of a run) against a local server emitting PCM on a known
schedule and compares every chunk's measured arrival with its emission on the machine's one monotonic
clock; ``CLIENT_CEILING_STREAMS`` is the largest concurrency at which the p99 of that error stayed
within ``ERROR_BOUND_S`` with the client on one core. A streamed real run whose streams in flight
exceed it is refused (``check_streams``) unless ``OMNI_STRESS_ALLOW_CLIENT_OVERLOAD=1``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

# Source: bench/client_capacity.json ("ceiling": 128), `bench/client_capacity.py --levels
# 1,16,32,64,128,256,512 --repeats 3` on 2 shared cores, the client pinned to one (SCHED_FIFO); each
# stream 30 to 59 chunks of 0.1 s of 24 kHz PCM every 0.1 s, phases spread over the interval. Median
# p99 error 0.888 ms at 128 streams, 1.659 ms at 256 (docs/streaming.md#client-capacity).
CLIENT_CEILING_STREAMS = 128
ERROR_BOUND_S = 0.001  # a client "falls behind" when the p99 of arrival - emission exceeds this
OVERLOAD_ENV = "OMNI_STRESS_ALLOW_CLIENT_OVERLOAD"


def arrivals(sent_at: float, ttfa_s: float, gaps_s: Sequence[float]) -> list[float]:
    """A stream's audio chunks' arrival times on the send's clock, from its metrics (TTFA and gaps are
    seconds since the send and between chunks: ``harness.stream_metrics``)."""
    out = [sent_at + ttfa_s]
    for g in gaps_s:
        out.append(out[-1] + g)
    return out


def arrival_errors(arrived: Sequence[float], emitted: Sequence[float]) -> list[float]:
    """Each chunk's arrival minus its emission (same clock, same order); ``ValueError`` when the counts
    differ (a chunk lost, or two read as one)."""
    if len(arrived) != len(emitted):
        raise ValueError(f"{len(arrived)} chunks arrived, {len(emitted)} were emitted")
    return [a - e for a, e in zip(arrived, emitted)]


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``p`` % of the values at or below it."""
    if not values:
        raise ValueError("no values")
    if not 0 < p <= 100:
        raise ValueError(f"percentile {p!r} outside (0, 100]")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def streams_in_flight(mode: str, concurrency: int | None, requests: int) -> int | None:
    """The most streams a cell holds open at once: every request (load ``all``), at most
    ``concurrency`` of them (``concurrency``); None for ``poisson`` (it depends on the server's pace)."""
    if mode == "all":
        return requests
    if mode == "concurrency":
        return min(concurrency or 1, requests)
    return None


def overload_allowed() -> bool:
    return os.environ.get(OVERLOAD_ENV, "") not in ("", "0")


def check_streams(deploys: Sequence, requests: int) -> None:
    """``UserError`` (one line) when a deploy's load holds more streams open than the client's ceiling."""
    if overload_allowed():
        return
    from harness.errors import UserError

    for d in deploys:
        n = streams_in_flight(d.load.mode, d.load.concurrency, requests)
        if n is not None and n > CLIENT_CEILING_STREAMS:
            load = "all" if d.load.mode == "all" else f"concurrency {d.load.concurrency}"
            raise UserError(f"--stream: deploy {d.name!r} holds {n} streams in flight (load {load}), above the "
                            f"client's measured ceiling of {CLIENT_CEILING_STREAMS} (docs/streaming.md#client-capacity): "
                            f"its gaps would be the client's; lower the load's concurrency or set {OVERLOAD_ENV}=1")
