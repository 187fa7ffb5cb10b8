"""The runner-to-stage phase contract every family shares: event classification and misaligned regions.

Pure functions, no I/O. A *span* is the positions ``[c, c+n)`` the runner schedules for one
request in one step; ``P`` is the Talker prompt length (``_omni_prompt_len``) and ``c`` the
computed-token count before the step (``_omni_num_computed_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

# The span events and the metrics counted from them are defined once, in ``harness.metrics``
# (below records, which computes a span's flags from them); re-exported here for the contract's callers.
from harness.metrics import EVENT_COUNTS, EVENT_FIELDS, EVENTS, MISALIGNED_COUNTS, span_flags

if TYPE_CHECKING:
    from harness.records import EventCounts, SpanRecord

__all__ = ["EVENTS", "EVENT_FIELDS", "EVENT_COUNTS", "MISALIGNED_COUNTS", "span_flags", "SpanEvents", "classify_span",
           "classify_spans", "event_count_columns", "misaligned_regions", "count_events", "ends_in_text", "span_regions",
           "same_hidden", "ContractError", "require_metadata"]


@dataclass(frozen=True)
class SpanEvents:
    is_prefill: bool
    nonzero_offset: bool
    cross_boundary: bool
    multi_decode: bool
    one_token_tail: bool
    row_mismatch: bool  # rows returned != n (None rows: not known)


def classify_span(P: int, c: int, n: int, rows: int | None = None) -> SpanEvents:
    return SpanEvents(**span_flags(P, c, n, rows))


def classify_spans(P: np.ndarray, c: np.ndarray, n: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
    """``classify_span`` over whole columns at once ({field: bool array}): reports count events
    of ~65k spans, where one call per span cost more than the rest of the report."""
    return {name: np.asarray(pred(P, c, n, rows), dtype=bool) for name, pred in EVENTS.items()}


def event_count_columns(flags: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    """{EventCounts field: per-span 0/1 column} from ``classify_spans``' flags (``EVENT_COUNTS``)."""
    out = {}
    for name, needs in EVENT_COUNTS.items():
        col = np.ones(length, dtype=bool)
        for flag in needs:
            col = col & flags[flag]
        out[name] = col
    return out


def misaligned_regions(positions: Iterable[int] | np.ndarray, P: int, reply_len: int) -> tuple[int, int]:
    """(text, end): how many of the misaligned ``positions`` lie in each region.

    The **text** region is the prompt positions and the reply positions up to and including
    text-EOS, ``p < P + reply_len + 1`` with ``reply_len = len(thinker_result[1:])``; the **end**
    region is every position after text-EOS (where the contract wants the persistent text-PAD, and
    vLLM-Omni 0.30.0 feeds a zero text row). Both backends split their counts with this function.
    """
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    text = int((pos < P + reply_len + 1).sum())
    return text, int(pos.size) - text


def ends_in_text(P: int, c: int, n: int, text_len: int) -> bool:
    """Whether a span is a multi-position span whose end falls inside the text region: the next position
    ``c + n`` lies past the prompt and still reads text (the reply rows up to text-EOS, ``p <= P + text_len``;
    ``text_len`` as ``misaligned_regions``' ``reply_len``). A replay (or one of its chunks, or a verify span)
    that ends there hands the decode that follows a text offset it must get right; one that ends past the
    text does not test that."""
    return n > 1 and P < c + n <= P + text_len


def count_events(spans: Iterable[SpanRecord], text_len: int | None = None) -> EventCounts:
    """The events and misaligned positions of ``spans`` (one request's) summed (``EVENT_COUNTS``,
    ``span_regions``); with the request's ``text_len``, its multi-position spans ending inside the text region
    (``ends_in_text``: ``replays_ending_in_text``; 0 without it).

    The flags are counted over whole columns (``classify_spans``): a request's thousand spans cost
    one array pass, not a thousand ``span_flags`` calls."""
    spans = list(spans)
    counts = _count_flags_and_regions(spans)
    if text_len is not None:
        counts.replays_ending_in_text = sum(ends_in_text(s.P, s.c, s.n, text_len) for s in spans)
    return counts


def _count_flags_and_regions(spans: list[SpanRecord]) -> EventCounts:
    from harness.records import EventCounts

    counts = EventCounts()
    cols = [[s.P for s in spans], [s.c for s in spans], [s.n for s in spans],
            [s.n if s.rows is None else s.rows for s in spans]]  # rows None claims no mismatch: as n rows
    if not all({type(v) for v in col} <= {int} for col in cols):  # not plain ints: one span at a time
        return _count_events_each(spans)
    try:
        P, c, n, rows = (np.array(col, dtype=np.int64).reshape(-1) for col in cols)
    except OverflowError:
        return _count_events_each(spans)
    if (P < 0).any() or (c < 0).any() or (n < 1).any():  # span_flags' error, for the first invalid span
        for s in spans:
            span_flags(s.P, s.c, s.n, s.rows)
    columns = event_count_columns(classify_spans(P, c, n, rows), len(spans))
    for name, col in columns.items():
        setattr(counts, name, int(col.sum()))
    text = end = 0
    for s in spans:
        t, e = span_regions(s)
        text += t
        end += e
    counts.misaligned_text_positions = text
    counts.misaligned_end_positions = end
    counts.misaligned_positions = text + end
    return counts


def _count_events_each(spans: Iterable[SpanRecord]) -> EventCounts:
    """``count_events`` one span at a time (spans whose fields are not plain ints)."""
    from harness.records import EventCounts

    counts = EventCounts()
    for s in spans:
        flags = span_flags(s.P, s.c, s.n, s.rows)
        for name, needs in EVENT_COUNTS.items():
            if all(flags[f] for f in needs):
                setattr(counts, name, getattr(counts, name) + 1)
        text, end = span_regions(s)
        counts.misaligned_text_positions += text
        counts.misaligned_end_positions += end
        counts.misaligned_positions += text + end
    return counts


def span_regions(span: SpanRecord) -> tuple[int, int]:
    """(text, end) misaligned positions of one span record; a record written before the split
    (``misaligned`` alone) counts in the text region, the conservative reading."""
    if span.misaligned_text is None and span.misaligned_end is None:
        return span.misaligned or 0, 0
    return span.misaligned_text or 0, span.misaligned_end or 0


def same_hidden(got: object, want: object) -> bool:
    """Whether the past hidden state a decode hands the code predictor (``mtp_inputs[0]``, the batched hook's
    ``past_hidden`` row) is exactly ``want``: the request's hidden state at the previous position, which the
    release's ``postprocess`` left in its buffer as ``hidden_states.last``. ``want`` None (nothing left yet)
    wants zeros, the release's own fill. Any shape holding one row, in any float dtype that holds it; the
    sim's runner and the real worker's check both decide with this."""
    import torch

    if not isinstance(got, torch.Tensor) or not got.dtype.is_floating_point:
        return False
    flat = got.detach().reshape(-1).to(torch.float32).cpu()
    if want is None:
        return bool(flat.numel() > 0 and not flat.any())
    if not isinstance(want, torch.Tensor) or flat.numel() != want.numel():
        return False
    return bool(torch.equal(flat, want.detach().reshape(-1).to(got.dtype).to(torch.float32).cpu()))


class ContractError(ValueError):
    """Missing metadata or a reconstructed prompt whose length differs from P."""


def require_metadata(info: dict, keys: Sequence[str] = ("_omni_prompt_len", "_omni_num_computed_tokens")) -> None:
    missing = [k for k in keys if info.get(k) is None]
    if missing:
        raise ContractError(f"talker_preprocess: missing runner metadata {', '.join(missing)}")
