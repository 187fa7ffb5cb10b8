"""The runner-to-Talker phase contract: event classification and the expected-row oracle.

Pure functions, no I/O. A *span* is the positions ``[c, c+n)`` the runner schedules for one
request in one step; ``P`` is the Talker prompt length (``_omni_prompt_len``) and ``c`` the
computed-token count before the step (``_omni_num_computed_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from harness.records import EventCounts, SpanRecord


@dataclass(frozen=True)
class SpanEvents:
    is_prefill: bool
    nonzero_offset: bool  # 0 < c < P: a prefill chunk that does not start at row 0
    cross_boundary: bool  # c < P < c + n: a replay covering prompt and generated positions
    multi_decode: bool  # c >= P and n > 1: replay of generated positions, or a verify span
    one_token_tail: bool  # 0 < c < P and n == 1
    row_mismatch: bool  # rows returned != n (None rows: not known)


def classify_span(P: int, c: int, n: int, rows: int | None = None) -> SpanEvents:
    if P < 0 or c < 0 or n < 1:
        raise ValueError(f"invalid span: P={P} c={c} n={n}")
    return SpanEvents(
        is_prefill=c < P,
        nonzero_offset=0 < c < P,
        cross_boundary=c < P < c + n,
        multi_decode=c >= P and n > 1,
        one_token_tail=0 < c < P and n == 1,
        row_mismatch=rows is not None and rows != n,
    )


EVENT_FIELDS = ("is_prefill", "nonzero_offset", "cross_boundary", "multi_decode", "one_token_tail", "row_mismatch")


def classify_spans(P: np.ndarray, c: np.ndarray, n: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
    """``classify_span`` over whole columns at once ({field: bool array}): reports count events
    of ~65k spans, where one call per span cost more than the rest of the report."""
    return {
        "is_prefill": c < P,
        "nonzero_offset": (c > 0) & (c < P),
        "cross_boundary": (c < P) & (P < c + n),
        "multi_decode": (c >= P) & (n > 1),
        "one_token_tail": (c > 0) & (c < P) & (n == 1),
        "row_mismatch": rows != n,
    }


def count_events(spans: Iterable[SpanRecord]) -> EventCounts:
    counts = EventCounts()
    for s in spans:
        ev = classify_span(s.P, s.c, s.n, s.rows)
        counts.talker_calls += 1
        counts.prefill_calls += ev.is_prefill
        counts.nonzero_offset_chunks += ev.nonzero_offset
        counts.cross_boundary_replays += ev.cross_boundary
        counts.multi_position_decode_spans += ev.multi_decode
        counts.one_token_tails += ev.one_token_tail
        counts.row_count_mismatches += ev.row_mismatch
        counts.prefill_row_count_mismatches += ev.row_mismatch and ev.is_prefill
        counts.misaligned_positions += s.misaligned or 0
    return counts


# --------------------------------------------------------------------------- expected rows


@dataclass(frozen=True)
class RowRef:
    """Names the row the fixed Talker must condition one position on.

    ``source``: ``prompt`` (row ``index`` of the reconstructed Talker prompt: Thinker prompt
    rows, then speaker + codec-PAD at P-2, then ``thinker_result[0]`` + codec-BOS at P-1),
    ``reply`` (``thinker_result[1 + index]``), ``text_eos`` or ``text_pad``; the last three
    are added to the codec embedding of the position's own input id.
    """

    source: str
    index: int


class ContractError(ValueError):
    """Missing metadata or a reconstructed prompt whose length differs from P."""


def expected_rows(P: int, c: int, n: int, num_thinker_tokens: int) -> list[RowRef]:
    """Which row each position of the span must receive.

    ``p < P``: prompt row ``p``. ``p >= P``: ``reply[k]``, ``k = p - P``, where
    ``reply = thinker_result[1:] ++ [text_eos] ++ [text_pad]`` and the final PAD row persists
    for every ``k`` past the end. Stateless: the same span always gives the same rows.
    """
    if num_thinker_tokens < 1:
        raise ContractError("empty Thinker output: the Talker prompt needs thinker_result[0]")
    if P < 2:
        raise ContractError(f"Talker prompt length {P} < 2 (needs speaker and codec-BOS rows)")
    if c < 0 or n < 1:
        raise ContractError(f"invalid span c={c} n={n}")
    eos_k = num_thinker_tokens - 1  # len(thinker_result[1:])
    out = []
    for p in range(c, c + n):
        k = p - P
        if k < 0:
            out.append(RowRef("prompt", p))
        elif k < eos_k:
            out.append(RowRef("reply", k))
        elif k == eos_k:
            out.append(RowRef("text_eos", k))
        else:
            out.append(RowRef("text_pad", k))
    return out


def require_metadata(info: dict, keys: Sequence[str] = ("_omni_prompt_len", "_omni_num_computed_tokens")) -> None:
    missing = [k for k in keys if info.get(k) is None]
    if missing:
        raise ContractError(f"talker_preprocess: missing runner metadata {', '.join(missing)}")
