"""Forced schedules: the situations of the phase contract, each made to happen on purpose.

A schedule is a list of spans ``[c, c+n)`` and preemptions for one request. After a preemption
the request is replayed from position 0 (vLLM's preemption by recompute: ``num_computed_tokens``
reset to 0, prompt and generated tokens recomputed, the request's intermediate buffer kept, as
vLLM-Omni's runner and the sim keep it). ``unchunked`` is the reference every other schedule is
compared with: the whole prompt in one span, then one-token decode steps.

The vLLM-scheduled runs (``harness.conform.driver.run_deploy``) add the schedules vLLM's own
scheduler makes under a deploy (chunked prefill under a token budget, batching, preemption).
"""

from __future__ import annotations

from dataclasses import dataclass

PREEMPT = (-1, -1)

# The matrix columns for forced schedules, in order, with their headings.
SITUATIONS: dict[str, str] = {
    "chunk": "non-zero-offset chunk",
    "tail": "one-token tail",
    "multi_decode": "multi-position decode",
    "cross_replay": "cross-boundary replay",
    "repeated_replay": "repeated replay",
}


@dataclass(frozen=True)
class Schedule:
    name: str
    situation: str  # a key of SITUATIONS, or "reference"
    ops: tuple[tuple[int, int], ...]  # (c, n) spans; PREEMPT marks a preemption
    description: str

    @property
    def end(self) -> int:
        """One past the last position the schedule feeds."""
        return max(c + n for c, n in self.ops if (c, n) != PREEMPT)


def _decode(a: int, b: int) -> list[tuple[int, int]]:
    return [(p, 1) for p in range(a, b)]


def _chunks(a: int, b: int, size: int) -> list[tuple[int, int]]:
    return [(c, min(size, b - c)) for c in range(a, b, size)]


def _chunk_size(P: int) -> int:
    """16, or the largest size below it whose last chunk is not a single token (that is the tail's
    schedule)."""
    size = 16
    while size > 2 and P % size == 1:
        size -= 1
    return size


def forced_schedules(P: int, T: int) -> list[Schedule]:
    """The forced schedules of a request with prompt length ``P`` fed up to position ``T - 1``."""
    if P < 4:
        raise ValueError(f"prompt length {P} < 4: too short for the forced schedules")
    if T - P < 16:
        raise ValueError(f"{T - P} generated positions < 16: too few for the forced schedules")
    G = T - P
    h = P // 2
    m = G // 4  # decode steps before the first preemption
    k = _chunk_size(P)
    return [
        Schedule("unchunked", "reference", ((0, P), *_decode(P, T)),
                 "the whole prompt in one span, then one-token decode steps (the reference)"),
        Schedule(f"chunked-at-{h}", "chunk", ((0, h), (h, P - h), *_decode(P, T)),
                 f"prompt in two chunks, the second at offset {h}"),
        Schedule(f"chunks-of-{k}", "chunk", (*_chunks(0, P, k), *_decode(P, T)),
                 f"prompt in chunks of {k} (vLLM's chunked prefill under a small budget)"),
        Schedule("one-token-tail", "tail", ((0, P - 1), (P - 1, 1), *_decode(P, T)),
                 f"prompt up to P-1, then the last prompt position alone (c={P - 1}, n=1)"),
        Schedule("multi-decode", "multi_decode", ((0, P), *_decode(P, P + 4), (P + 4, 3), *_decode(P + 7, T)),
                 f"four decode steps, then one span of three generated positions (c={P + 4}, n=3: a "
                 f"replay of generated positions or a speculative verify span)"),
        Schedule("cross-replay", "cross_replay",
                 ((0, P), *_decode(P, P + m), PREEMPT, (0, P - 2), (P - 2, m + 3), *_decode(P + m + 1, T)),
                 f"{m} decode steps, preempted, replayed as [0, P-2) then one span crossing the prompt "
                 f"boundary (c={P - 2}, n={m + 3})"),
        Schedule("repeated-replay", "repeated_replay",
                 ((0, P), *_decode(P, P + m), PREEMPT, (0, P + m + 1), *_decode(P + m + 1, P + 2 * m), PREEMPT,
                  *_chunks(0, P + 2 * m + 1, k), *_decode(P + 2 * m + 1, T)),
                 f"preempted after {m} decode steps and replayed in one span (c=0, n={P + m + 1}), preempted "
                 f"again {m - 1} steps later and replayed in chunks of {k}: the same positions replayed twice"),
    ]
