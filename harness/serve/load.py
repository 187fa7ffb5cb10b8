"""Client-side load on the real backend, in wall time (the sim's is ``harness/sim/load.py``, in steps).

``all``: every request sent at once (the seed). ``concurrency``: an ``asyncio.Semaphore`` of N, a
request is sent when one in flight finishes. ``poisson``: request i is sent ``t_i`` seconds after the
first, ``t_i`` the sum of i seeded exponential gaps of mean ``1 / rate`` (the run's seed + repeat - 1
draws them, as on the sim). ``jitter`` is the sim's only (the server's own timing varies anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

from harness.config import LoadSettings


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds (the first at 0) of ``n`` requests at ``rate`` per second."""
    rng = random.Random(f"omni-stress-client-load:{seed}")
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class ClientLoad:
    def __init__(self, load: LoadSettings | None, n: int, seed: int) -> None:
        self.mode = load.mode if load is not None else "all"
        self._sem = asyncio.Semaphore(load.concurrency or 1) if self.mode == "concurrency" and load else None
        self._offsets = poisson_offsets(n, load.rate or 1.0, seed) if self.mode == "poisson" and load else []
        self._start = time.monotonic()

    @contextlib.asynccontextmanager
    async def slot(self, index: int) -> AsyncIterator[None]:
        """Waits until request ``index`` may be sent; held while it is in flight."""
        if self._offsets:
            delay = self._start + self._offsets[index] - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        if self._sem is None:
            yield
            return
        async with self._sem:
            yield
