"""When each Talker request of a sim cell arrives, under the deploy's ``load`` (DESIGN.md "Stress as a map").

A request is *sent* by the client (all at once, N in flight, or at seeded Poisson times), waits for a
Thinker sequence (``thinker.max_num_seqs`` of them, first come first served), holds it for
``ceil((1 + K) * thinker_steps_per_token)`` steps, and reaches the Talker when its Thinker finishes.
``load.jitter`` delays each send by a seeded 0..jitter steps. A request that ``streams`` (Qwen3-Omni's
``async_chunk: true``) reaches the Talker with its first chunk, ``ceil(2 * thinker_steps_per_token)`` steps
after its Thinker starts (prefill and first token), while the Thinker goes on. Every draw comes from the cell's seed
(the run's seed + repeat - 1), so repeats and seeds explore different schedules, and the same seed
the same one.

``mode: all`` without jitter is the seed's schedule exactly: every request sent at step 0, so the
arrivals are ``harness.families.qwen2_5_omni.thinker.run_thinker``'s (records of the shipped deploys are unchanged).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.config import LoadSettings
    from harness.sim.cell import SimRequest as ThinkerOutput


def arrival_rng(seed: int) -> random.Random:
    return random.Random(f"omni-stress-load:{seed}")


class Arrivals:
    """``due(step)``: the requests that reach the Talker at ``step`` (call it every step, in order);
    ``finished(rid, step)``: a request left (concurrency mode sends the next); ``pending()``: some
    request has not reached the Talker yet. ``sent[rid]``: the step its client sent it."""

    def __init__(self, outputs: list[ThinkerOutput], load: LoadSettings, steps_per_token: float,
                 thinker_seqs: int, seed: int) -> None:
        self.load = load
        self.fixed = load.mode == "all" and not load.jitter
        self.sent: dict[str, int] = {}
        self.arrived: dict[str, int] = {}
        if self.fixed:  # the seed's schedule, as run_thinker computed it
            self._queue = deque(sorted(outputs, key=lambda o: o.arrival_step))
            self.sent = {o.request_id: 0 for o in outputs}
            return
        self._rng = arrival_rng(seed)
        self._steps_per_token = steps_per_token
        self._free = [0] * max(1, thinker_seqs)  # when each Thinker sequence is free (a heap)
        self._waiting: deque[ThinkerOutput] = deque(outputs)  # not sent yet, in prompt order
        self._sends: list[tuple[int, int, ThinkerOutput]] = []  # (send step, order, output): a heap
        self._thinking: list[tuple[int, int, ThinkerOutput]] = []  # (arrival step, order, output): a heap
        self._order = 0
        if load.mode == "concurrency":
            for _ in range(min(load.concurrency or 1, len(outputs))):
                self._send(self._waiting.popleft(), 0)
        elif load.mode == "poisson":
            t = 0.0
            while self._waiting:
                self._send(self._waiting.popleft(), int(math.floor(t)))
                t += self._rng.expovariate(load.rate or 1.0)
        else:  # all, jittered
            while self._waiting:
                self._send(self._waiting.popleft(), 0)

    def _send(self, out: ThinkerOutput, step: int) -> None:
        if self.load.jitter:
            step += self._rng.randint(0, self.load.jitter)
        heapq.heappush(self._sends, (step, self._order, out))
        self._order += 1

    def due(self, step: int) -> list[ThinkerOutput]:
        if self.fixed:
            got = []
            while self._queue and self._queue[0].arrival_step <= step:
                got.append(self._queue.popleft())
            for o in got:
                self.arrived[o.request_id] = step
            return got
        while self._sends and self._sends[0][0] <= step:  # the Thinker takes sent requests in send order
            sent, order, out = heapq.heappop(self._sends)
            self.sent[out.request_id] = sent
            start = max(sent, heapq.heappop(self._free))
            done = start + math.ceil((1 + len(out.reply_tokens)) * self._steps_per_token)
            heapq.heappush(self._free, done)
            arrive = done
            if getattr(out, "streams", False):  # async_chunk: it reaches the Talker with chunk 0, the Thinker goes on
                out.thinker_start = start
                arrive = start + math.ceil(2 * self._steps_per_token)
            out.arrival_step = arrive
            heapq.heappush(self._thinking, (arrive, order, out))
        got = []
        while self._thinking and self._thinking[0][0] <= step:
            got.append(heapq.heappop(self._thinking)[2])
        for o in got:
            self.arrived[o.request_id] = step
        return got

    def finished(self, rid: str, step: int) -> None:
        if not self.fixed and self.load.mode == "concurrency" and self._waiting:
            self._send(self._waiting.popleft(), step + 1)

    def pending(self) -> bool:
        if self.fixed:
            return bool(self._queue)
        return bool(self._waiting or self._sends or self._thinking)
