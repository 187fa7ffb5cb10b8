"""The comparison: did every position receive the row the reference schedule gave it?

The oracle is schedule invariance (DESIGN.md "Conformance"): for a model whose correct rows
nobody has written down, the phase contract still implies that position ``p`` of a request
receives the same row however ``p`` is scheduled, and that every call returns exactly ``n``
rows. The reference is the ``unchunked`` schedule (whole prompt, then one-token decodes); every
other feed of every schedule is compared with it position by position, within
``ATOL + RTOL * |reference|`` (float32 stand-ins; models that compute in bfloat16 do so
identically under every schedule, so equal rows come out bit-equal in practice).

Necessary, not sufficient: a model that is consistently wrong (the same wrong row under every
schedule) passes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from harness.conform.driver import Feed
from harness.contract import classify_span

ATOL = 1e-4
RTOL = 1e-3


def span_kind(P: int, c: int, n: int, replay: int) -> str:
    """The contract's name for a span (``harness.contract.classify_span``), plus the replay count."""
    ev = classify_span(P, c, n)
    if ev.cross_boundary:
        kind = "span crossing the prompt boundary"
    elif ev.one_token_tail:
        kind = "one-token prefill tail"
    elif ev.nonzero_offset:
        kind = "non-zero-offset prefill chunk"
    elif ev.is_prefill:
        kind = "prefill from position 0"
    elif ev.multi_decode:
        kind = "multi-position decode span"
    else:
        kind = "one-token decode step"
    return kind + (f", replay {replay}" if replay else "")


@dataclass
class Difference:
    """The first position whose row differs from the reference's."""

    schedule: str
    request: str
    position: int
    c: int
    n: int
    step: int
    span: str  # span_kind
    got: str  # what the row is, as far as it can be named
    want: str
    max_abs_diff: float
    P: int = 0
    replay: int = 0

    def describe(self) -> str:
        return (f"position {self.position} ({self.request}, {self.schedule}, step {self.step}, span c={self.c} "
                f"n={self.n}: {self.span}) got {self.got}, the reference gives {self.want} "
                f"(max |diff| {self.max_abs_diff:.3g})")


@dataclass
class Cell:
    """One model x situation result."""

    status: str  # conforms | differs | raised | row-count | not-run
    summary: str  # short, for the matrix
    detail: str = ""  # one sentence: the first differing position, the call that raised, ...
    first: Difference | None = None
    schedules: list[str] = field(default_factory=list)
    feeds: int = 0
    positions: int = 0
    trigger: dict[str, int] | None = None  # the span that showed it: {P, c, n, replay} (harness.conform.reach)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return d


class RowNamer:
    """Names a row: a position's reference row (this request's or another's), zeros, the bare
    embedding of the position's own id, or one of the adapter's named rows."""

    def __init__(self, baselines: dict[str, torch.Tensor], named: dict[str, torch.Tensor],
                 tables: dict[str, dict[str, torch.Tensor]] | None = None, stale: bool = False) -> None:
        self.bare_label = ("the bare embedding of its own id" if stale  # V1's stale rows: the runner starts elsewhere
                           else "the bare embedding of its own id (the runner's starting row)")
        self.baselines = baselines
        self.named = {k: v.reshape(-1).float() for k, v in named.items()}
        self.tables = {rid: {k: t.float() for k, t in d.items()} for rid, d in (tables or {}).items()}

    def name(self, row: torch.Tensor, request: str, bare: torch.Tensor | None = None,
             start: torch.Tensor | None = None) -> str:
        row = row.float()
        if start is not None and _close(row, start.float()):
            left = self.name(row, request, bare)
            return ("the stale buffer row the span started with (V1's persistent inputs_embeds, never written "
                    "for this position" + (": zeros" if left == "zeros" else f"; left by an earlier step: {left}")
                    + ")")
        if float(row.abs().max()) <= ATOL:
            return "zeros"
        if bare is not None and _close(row, bare):
            return self.bare_label
        for key, vec in self.named.items():
            if vec.shape == row.shape and _close(row, vec):
                return key
            if bare is not None and vec.shape == row.shape and _close(row, bare + vec):
                return f"its id's embedding + {key}"
        for label, table in self.tables.get(request, {}).items():  # the request's payload rows
            index = "" if table.shape[0] == 1 else " {}"  # a one-row table is named by its label alone
            hit = _find(table, row)
            if hit is not None:
                return label + index.format(hit)
            if bare is not None:
                hit = _find(table, row - bare)
                if hit is not None:
                    return f"its id's embedding + {label}" + index.format(hit)
        own = self.baselines.get(request)
        for who, table in ([(request, own)] if own is not None else []) + [
                (r, t) for r, t in self.baselines.items() if r != request]:
            hit = _find(table, row)
            if hit is not None:
                return f"the reference row of position {hit}" + ("" if who == request else f" of request {who}")
            if bare is not None:
                hit = _find(table, row - bare)
                if hit is not None and float((row - bare).abs().max()) > ATOL:
                    return (f"its id's embedding + the reference row of position {hit}"
                            + ("" if who == request else f" of request {who}"))
        return "a row that is no reference row"


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a - b).abs() <= ATOL + RTOL * b.abs()).all())


def _find(table: torch.Tensor, row: torch.Tensor) -> int | None:
    ok = ((table - row.unsqueeze(0)).abs() <= ATOL + RTOL * table.abs()).all(dim=1)
    idx = torch.nonzero(ok).flatten()
    return int(idx[0]) if idx.numel() else None


def baseline_table(feeds: list[Feed]) -> torch.Tensor:
    """Position -> row from the reference schedule's feeds (which must cover 0..T-1 once)."""
    rows = [f.received for f in feeds]
    return torch.cat([r.float() for r in rows], dim=0)


def first_difference(feeds: list[Feed], baselines: dict[str, torch.Tensor], namer: RowNamer,
                     bare_of: Any) -> Difference | None:
    """The first position (in feed order) whose received row differs from its request's reference."""
    for f in feeds:
        if f.received is None:
            continue
        want = baselines[f.request][f.c:f.c + f.n]
        got = f.received.float()[:want.shape[0]]
        bad = ~((got - want).abs() <= ATOL + RTOL * want.abs()).all(dim=1)
        if bool(bad.any()):
            i = int(torch.nonzero(bad).flatten()[0])
            p = f.c + i
            bare = bare_of(f.ids[i:i + 1])[0].float() if f.ids is not None else None
            return Difference(f.schedule, f.request, p, f.c, f.n, f.step, span_kind(f.P, f.c, f.n, f.replay),
                              namer.name(got[i], f.request, bare, f.start[i] if f.start is not None else None),
                              namer.name(want[i], f.request, bare),
                              float((got[i] - want[i]).abs().max()), f.P, f.replay)
    return None


def first_error(feeds: list[Feed]) -> Feed | None:
    return next((f for f in feeds if f.error is not None), None)


def first_row_mismatch(feeds: list[Feed]) -> Feed | None:
    return next((f for f in feeds if f.rows is not None and f.rows != f.n), None)


def situation_cell(runs: list[tuple[str, list[Feed]]], baselines: dict[str, torch.Tensor], namer: RowNamer,
                   bare_of: Any) -> Cell:
    """One situation's cell from its schedules' feeds: the first schedule that raised or differs."""
    return _mark_vllm(_situation_cell(runs, baselines, namer, bare_of), runs)


def _situation_cell(runs: list[tuple[str, list[Feed]]], baselines: dict[str, torch.Tensor], namer: RowNamer,
                    bare_of: Any) -> Cell:
    feeds_n = sum(len(f) for _, f in runs)
    positions = sum(x.n for _, f in runs for x in f)
    schedules = sorted({name for name, _ in runs})
    for _name, feeds in runs:
        err = first_error(feeds)
        clean = feeds if err is None else feeds[:feeds.index(err)]
        diff = first_difference(clean, baselines, namer, bare_of) if clean else None
        if diff is not None:
            return Cell("differs", f"differs @{diff.position}", diff.describe(), diff, schedules, feeds_n, positions,
                        _trigger(diff.P, diff.c, diff.n, diff.replay, _history(feeds, diff.request, diff.step)))
        if err is not None:
            return Cell("raised", "raised", f"{err.request}, {err.schedule}, step {err.step}, span c={err.c} "
                        f"n={err.n} ({span_kind(err.P, err.c, err.n, err.replay)}): {err.error}",
                        None, schedules, feeds_n, positions,
                        _trigger(err.P, err.c, err.n, err.replay, _history(feeds, err.request, err.step)))
    return Cell("conforms", "conforms", f"{positions} positions in {feeds_n} calls received the reference rows",
                None, schedules, feeds_n, positions)


def row_count_cell(all_feeds: list[Feed], stale: bool = False) -> Cell:
    bad = first_row_mismatch(all_feeds)
    calls = sum(1 for f in all_feeds if f.rows is not None)
    mismatches = sum(1 for f in all_feeds if f.rows is not None and f.rows != f.n)
    if bad is None:
        return Cell("conforms", "conforms", f"all {calls} calls returned n rows", feeds=calls)
    return Cell("row-count", f"{mismatches}/{calls} calls",
                f"first: {bad.request}, {bad.schedule}, step {bad.step}, span c={bad.c} n={bad.n} "
                f"({span_kind(bad.P, bad.c, bad.n, bad.replay)}) returned {bad.rows} rows; the runner copies "
                f"min(n, rows) and leaves the rest as "
                + ("the stale rows of its persistent inputs_embeds buffer" if stale else "the bare embedding of their ids"),
                feeds=calls, trigger=_trigger(bad.P, bad.c, bad.n, bad.replay))


def _trigger(P: int, c: int, n: int, replay: int, history: list[list[int]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"P": P, "c": c, "n": n, "replay": replay}
    if history:
        out["history"] = history
    return out


def _mark_vllm(cell: Cell, runs: list[tuple[str, list[Feed]]]) -> Cell:
    if cell.trigger is not None and any(name.startswith("vllm:") for name, _ in runs):
        cell.trigger["vllm"] = 1
    return cell


def _history(feeds: list[Feed], request: str, step: int) -> list[list[int]]:
    """The request's earlier spans in the same run, ``[c, n, replay]`` each: a position can differ in a plain
    one-token decode step because of a chunk or replay before it (Qwen3-Omni's streamed text counter)."""
    return [[f.c, f.n, f.replay] for f in feeds if f.request == request and f.step < step
            and (f.c < f.P or f.n > 1 or f.replay > 0)]  # one-token decode steps need nothing: left out


RESTART_WINDOW = 3  # the start rows: those of the first generated positions P .. P+2


def restart_cell(runs: list[tuple[str, list[Feed]]], baselines: dict[str, torch.Tensor], bare_of: Any) -> Cell:
    """The #6179 class (native-AR TTS that restarts from frame 0 after a recompute preemption): after a
    preemption, a generated position ``p`` re-receives a start row, the conditioning the reference gives one of
    the first generated positions ``P + j`` (``j < p - P``), where its own reference row is another. Rows are
    compared less the position's id embedding, so a decode row (codec embedding + a text or frame row) counts by
    what the preprocess added; start rows that add nothing (zeros) are not taken as evidence."""
    replays = 0
    for name, feeds in runs:
        for f in feeds:
            if f.received is None or f.replay == 0 or f.ids is None or f.c + f.n <= f.P:
                continue
            replays += 1
            base = baselines[f.request]
            start_ids = None
            for i in range(max(0, f.P - f.c), f.n):
                p = f.c + i
                if p >= base.shape[0] or p - f.P < 1:
                    continue
                if start_ids is None:  # the ids of the start positions, from the reference table's request
                    start_ids = _start_components(f, base, bare_of)
                got = f.received[i].float() - bare_of(f.ids[i:i + 1])[0].float()
                own = base[p] - bare_of(f.ids[i:i + 1])[0].float()
                for j, comp in enumerate(start_ids):
                    if j >= p - f.P or comp is None:
                        continue
                    if _close(got, comp) and not _close(own, comp):
                        return Cell("differs", f"restarts @{p}",
                                    f"{f.request}, {name}, step {f.step}, span c={f.c} n={f.n} (replay {f.replay}): "
                                    f"generated position {p} re-receives the start row of position {f.P + j} "
                                    f"(what the preprocess adds to its id's embedding there), where the reference "
                                    f"gives it its own: the preprocess restarted its generated sequence after the "
                                    f"preemption (the upstream #6179 class)", None, [name], replays,
                                    trigger=_trigger(f.P, f.c, f.n, f.replay, _history(feeds, f.request, f.step)))
            due = f.c + f.n - f.P + 1  # frames sampled at positions P-1 .. c+n-1, as in the reference
            if f.counter is not None and f.counter < due:
                p = f.c + f.n - 1
                return Cell("differs", f"restarts @{p}",
                            f"{f.request}, {name}, step {f.step}, span c={f.c} n={f.n} (replay {f.replay}): after "
                            f"the span the model counts {f.counter} generated frame(s) where the schedule has "
                            f"generated {due}: the preprocess dropped the frames committed before the preemption, "
                            f"and the frame sampled at generated position {p} is its frame {f.counter - 1} again "
                            f"(restarted from frame 0; the upstream #6179 class)", None, [name], replays,
                            trigger=_trigger(f.P, f.c, f.n, f.replay, _history(feeds, f.request, f.step)))
    if not replays:
        return Cell("not-run", "no replay", "no run replayed a generated position")
    return Cell("conforms", "no restart", f"{replays} replay calls: no generated position re-received a start row")


def _start_components(f: Feed, base: torch.Tensor, bare_of: Any) -> list[torch.Tensor | None]:
    """The reference rows of positions P .. P+W-1 less their ids' embeddings (None: nothing added, or absent)."""
    out: list[torch.Tensor | None] = []
    ids = f.all_ids
    for j in range(RESTART_WINDOW):
        q = f.P + j
        if ids is None or q >= base.shape[0] or q >= len(ids):
            out.append(None)
            continue
        comp = base[q] - bare_of(torch.tensor([ids[q]], dtype=torch.long))[0].float()
        out.append(None if float(comp.abs().max()) <= ATOL else comp)
    return out
