"""One model through every schedule: the matrix row.

For each request: the ``unchunked`` reference (fed far enough for the vLLM runs too), then every
forced schedule (``harness.conform.schedules``), each on a fresh model instance. Then all
requests together through vLLM's scheduler under each deploy, on one model instance (as in one
server). Each situation's cell is the first difference from the reference, in schedule order;
the row-count cell covers every call of every run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.conform.adapter import Adapter, Provenance
from harness.conform.compare import (
    Cell,
    RowNamer,
    baseline_table,
    first_error,
    restart_cell,
    row_count_cell,
    situation_cell,
    span_kind,
)
from harness.conform.driver import Feed, run_deploy, run_forced
from harness.conform.reach import ModelReach, load_shipped, model_reach
from harness.conform.schedules import SITUATIONS, Schedule, forced_schedules
from harness.conform.upstream_report import findings
from harness.config import Deploy, load_deploy

DEFAULT_DEPLOYS = ("reference", "stress")
FORCED_GENERATED = 40  # generated positions the forced schedules feed
DEPLOY_GENERATED = 480  # generated positions per request in the vLLM runs: 4 x (P + 480) overflows stress's KV
REQUESTS = 4  # stress's Talker max_num_seqs
RUNNER_TAG = {"v1": "v1", "v2": "mrv2"}


@dataclass
class ModelResult:
    model: str
    title: str
    provenance: Provenance | None
    cells: dict[str, Cell] = field(default_factory=dict)  # column -> cell
    error: str | None = None  # could not check (load failure)
    stats: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    reach: ModelReach | None = None  # which shipped deploy reaches the failure (harness.conform.reach)
    upstream: list[dict[str, Any]] = field(default_factory=list)  # the report for upstream (harness.conform.upstream_report)

    @property
    def reach_status(self) -> str:
        """conforms | shipped | only | unknown | error."""
        if self.error is not None:
            return "error"
        if self.status == "conforms":
            return "conforms"
        return self.reach.status if self.reach is not None else "unknown"

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return "could not check"
        if self.status == "conforms":
            return "conforms"
        return self.reach.text if self.reach is not None else "fails"

    @property
    def restart_verdict(self) -> str | None:
        """The #6179 check as its own verdict: "restarts after a preemption ..." (None: not run, or an error)."""
        cell = self.cells.get("restart")
        if self.error is not None or cell is None or cell.status == "not-run":
            return None
        if cell.status != "differs":
            return "no restart after a preemption"
        reach = self.reach.cells.get("restart") if self.reach is not None else None
        what = ("is counted as frame 0 again (the model's own frame count restarted)" if "generated frame(s)" in
                cell.detail else "re-receives a start row")
        return (f"restarts after a preemption: generated position {cell.summary.split('@')[-1]} {what} "
                f"(the upstream #6179 class)" + (f"; {reach.text}" if reach is not None else ""))

    @property
    def status(self) -> str:
        if self.error is not None:
            return "error"
        return "conforms" if all(c.status in ("conforms", "not-run") for c in self.cells.values()) else "fails"

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "title": self.title, "status": self.status, "error": self.error,
            "provenance": None if self.provenance is None else {"what": self.provenance.what,
                                                                "files": self.provenance.files},
            "verdict": self.verdict, "reach_status": self.reach_status, "restart_verdict": self.restart_verdict,
            "reach": None if self.reach is None else self.reach.to_json(), "upstream": self.upstream,
            "cells": {k: v.to_json() for k, v in self.cells.items()}, "stats": self.stats,
            "seconds": round(self.seconds, 2),
        }


def columns(deploys: tuple[str, ...]) -> dict[str, str]:
    """Matrix column key -> heading."""
    return {**SITUATIONS, "row_count": "row count", "restart": "restart after preemption",
            **{f"vllm:{d}": f"vLLM {d}" for d in deploys}}


def check_model(adapter: Adapter, source: str, deploys: tuple[Deploy, ...] | None = None, *,
                requests: int = REQUESTS, forced_generated: int = FORCED_GENERATED,
                deploy_generated: int = DEPLOY_GENERATED, base_dir: Path | None = None,
                wheel_dir: Path | None = None, progress: Callable[[str], None] | None = None,
                runner: str = "v1", async_chunk: bool | None = None) -> ModelResult:
    """The model's matrix row under one model runner's buffer rules (``v1``, or ``v2``: MRV2). A source
    that cannot be loaded is ``error`` (the caller exits 2)."""
    from harness.errors import UserError

    t0 = time.perf_counter()
    if adapter.chunk_modes:
        adapter.async_chunk = bool(async_chunk)
    name = row_name(adapter, runner, adapter.async_chunk if adapter.chunk_modes else None)
    say = progress or (lambda _m: None)
    if deploys is None:
        deploys = tuple(load_deploy(d) for d in DEFAULT_DEPLOYS)
    try:
        impl, prov = adapter.load_checked(source, base_dir, wheel_dir)
    except UserError as exc:
        return ModelResult(name, adapter.title, None, error=str(exc), seconds=time.perf_counter() - t0)
    result = ModelResult(name, adapter.title + (" (async_chunk: streamed decode rows)" if name.count("async") else "")
                         + ("" if runner == "v1" else " (MRV2 buffer rules)"), prov)
    generated = max(forced_generated, deploy_generated if deploys else 0)
    try:
        reqs = adapter.requests(requests, generated)
    except Exception as exc:  # noqa: BLE001 -- e.g. a newer stage input processor the stand-in does not fit
        return ModelResult(name, adapter.title, prov, error=f"building the payload failed: "
                           f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - t0)
    # reference rows, far enough for every run
    baselines = {}
    ref_feeds: list[Feed] = []
    for r in reqs:
        sched = Schedule("unchunked", "reference", ((0, r.P), *[(p, 1) for p in range(r.P, r.P + generated)]), "")
        feeds = run_forced(adapter, impl, r, sched, runner)
        err = first_error(feeds)
        if err is not None:  # no reference: every cell says why
            _unavailable(result, [err])
            detail = (f"the reference schedule raised at {r.request_id}, span c={err.c} n={err.n} "
                      f"({span_kind(err.P, err.c, err.n, 0)}): {err.error}")
            for key in columns(tuple(d.name for d in deploys)):
                result.cells[key] = Cell("raised", "raised", detail, trigger={"P": err.P, "c": err.c, "n": err.n,
                                                                              "replay": err.replay})
            _reach(result, adapter, source, base_dir, wheel_dir, runner)
            result.seconds = time.perf_counter() - t0
            return result
        ref_feeds += feeds
        baselines[r.request_id] = baseline_table(feeds)
    say(f"{adapter.name}: reference rows for {len(reqs)} requests (P {min(r.P for r in reqs)}-"
        f"{max(r.P for r in reqs)}, {generated} generated positions)")
    stale = adapter.stale_rows and runner == "v1"
    namer = RowNamer(baselines, adapter.named_rows(adapter.make_model(impl)),
                     {r.request_id: adapter.request_tables(r) for r in reqs}, stale)
    model_for_bare = adapter.make_model(impl)

    def bare_of(ids: Any) -> Any:
        return adapter.embed(model_for_bare, ids)

    all_feeds: list[Feed] = list(ref_feeds)
    by_situation: dict[str, list[tuple[str, list[Feed]]]] = {k: [] for k in SITUATIONS}
    for r in reqs:
        for sched in forced_schedules(r.P, r.P + forced_generated):
            if sched.situation == "reference":
                continue
            feeds = run_forced(adapter, impl, r, sched, runner)
            all_feeds += feeds
            by_situation[sched.situation].append((sched.name, feeds))
    for key, runs in by_situation.items():
        result.cells[key] = situation_cell(runs, baselines, namer, bare_of)
    say(f"{adapter.name}: forced schedules done")
    vllm_runs: list[tuple[str, list[Feed]]] = []
    for d in deploys:
        ran = adapter.own_deploy(d, runner)  # the model family's own deploy of that role, if it has one
        feeds, counts = run_deploy(adapter, impl, [_truncate(r, deploy_generated) for r in reqs], ran,
                                   runner_kind=runner)
        all_feeds += feeds
        vllm_runs.append((f"vllm:{d.name}", feeds))
        cell = situation_cell([(f"vllm:{d.name}", feeds)], baselines, namer, bare_of)
        events = _events(feeds)
        cell.detail += f" [{'' if ran is d else f'ran {ran.name}: '}{_describe_events(events, counts)}]"
        result.cells[f"vllm:{d.name}"] = cell
        result.stats[f"vllm:{d.name}"] = {**counts, **events}
        say(f"{adapter.name}: vLLM {d.name} deploy: {cell.summary}")
    result.cells["row_count"] = row_count_cell(all_feeds, stale)
    replay_runs = by_situation["cross_replay"] + by_situation["repeated_replay"] + vllm_runs
    result.cells["restart"] = restart_cell(replay_runs, baselines, bare_of)
    _unavailable(result, all_feeds)
    _reach(result, adapter, source, base_dir, wheel_dir, runner)
    if adapter.upstream and not adapter.plugin:
        result.upstream = findings(result, lambda member: _release_text(source, member, base_dir, wheel_dir))
    result.seconds = time.perf_counter() - t0
    return result


def _release_text(source: str, member: str, base_dir: Path | None, wheel_dir: Path | None) -> str | None:
    from harness.conform.adapter import read_model_source
    from harness.errors import ConfigError

    try:
        return read_model_source(source, member, base_dir, wheel_dir).text
    except ConfigError:
        return None


def _reach(result: ModelResult, adapter: Adapter, source: str, base_dir: Path | None,
           wheel_dir: Path | None, runner: str = "v1") -> None:
    """Which shipped deploy of the release reaches each failing cell (``harness.conform.reach``). A model
    checked under each of its runners counts, per row, only the (deploy, platform)s that use that runner."""
    failing = {k: c.trigger for k, c in result.cells.items() if c.status not in ("conforms", "not-run")}
    shipped = load_shipped(adapter.deploys, source, base_dir, wheel_dir)
    modes = modes_for(adapter, source, base_dir, wheel_dir)
    mine = (runner, adapter.async_chunk if adapter.chunk_modes else None)
    # a row counts the (deploy, platform)s of its own mode, and those of modes no row checks (not modelled)
    all_targets = list(shipped.targets)
    shipped.targets = [t for t in shipped.targets if target_mode(adapter, t) == mine
                       or target_mode(adapter, t) not in modes]
    result.reach = model_reach(failing, shipped, adapter.deploys)
    if adapter.chunk_modes and all_targets and not any(target_mode(adapter, t) == mine for t in all_targets):
        others = sorted({f"async_chunk: {str(t.async_chunk).lower()}" for t in all_targets})
        why = (f"no shipped deploy runs async_chunk: {str(bool(mine[1])).lower()} on the {runner} runner "
               f"(they run {', '.join(others)})")
        if result.reach.status == "only":
            result.reach.text += f"; {why}"
        result.reach.note = why + (f"\n  {result.reach.note}" if result.reach.note else "")


Mode = tuple[str, "bool | None"]  # (model runner, async_chunk; None where chunking does not change the model's path)


def target_mode(adapter: Adapter, t: Any) -> Mode:
    return (t.runner, t.async_chunk if adapter.chunk_modes else None)


def modes_for(adapter: Adapter, source: str, base_dir: Path | None = None,
              wheel_dir: Path | None = None) -> list[Mode]:
    """The (runner, async_chunk) modes the model is checked under, one matrix row each: those its shipped
    deploys run the hooked stage with in this release (V1 first), less the modes the adapter does not model,
    plus its ``extra_modes``; the adapter's own ``runners`` list when it sets one; ``[("v1", ...)]`` when no
    deploy file is there."""
    default_async = None if not adapter.chunk_modes else False
    if adapter.runners:
        return [(r, default_async) for r in adapter.runners]
    try:
        shipped = load_shipped(adapter.deploys, source, base_dir, wheel_dir)
    except Exception:  # noqa: BLE001 -- unreadable deploys: the reach says why; check V1
        shipped = None
    used = {target_mode(adapter, t) for t in shipped.targets} if shipped is not None else set()
    used = {m for m in used if m not in adapter.unmodelled_modes} | set(adapter.extra_modes)
    order = [("v1", None), ("v1", False), ("v1", True), ("v2", None), ("v2", False), ("v2", True)]
    return [m for m in order if m in used] or [("v1", default_async)]


def runners_for(adapter: Adapter, source: str, base_dir: Path | None = None,
                wheel_dir: Path | None = None) -> tuple[str, ...]:
    """The model runners of ``modes_for``."""
    return tuple(dict.fromkeys(r for r, _ in modes_for(adapter, source, base_dir, wheel_dir)))


def row_name(adapter: Adapter, runner: str, async_chunk: bool | None) -> str:
    tags = (["async"] if async_chunk else []) + ([RUNNER_TAG[runner]] if runner != "v1" else [])
    return adapter.name + (f"@{'+'.join(tags)}" if tags else "")


def _unavailable(result: ModelResult, feeds: list[Feed]) -> None:
    """A call that reached a vLLM-only name the stand-in cannot provide is the check's limit, not the
    model's failure: the model could not be checked (exit 2)."""
    hit = next((f for f in feeds if f.error and f.error.startswith("UpstreamUnavailable")), None)
    if hit is not None:
        result.error = (f"{hit.request}, {hit.schedule}, span c={hit.c} n={hit.n}: {hit.error} "
                        f"(extend the adapter's stand-in)")


def _truncate(r: Any, generated: int) -> Any:
    from harness.conform.adapter import ConformRequest

    return ConformRequest(r.request_id, r.prompt_ids, r.payload, r.generated[:generated])


def _events(feeds: list[Feed]) -> dict[str, int]:
    from harness.contract import classify_span

    out = {"calls": len(feeds), "nonzero_offset_chunks": 0, "one_token_tails": 0, "multi_position_decode_spans": 0,
           "cross_boundary_replays": 0, "replayed_calls": 0}
    for f in feeds:
        ev = classify_span(f.P, f.c, f.n)
        out["nonzero_offset_chunks"] += ev.nonzero_offset
        out["one_token_tails"] += ev.one_token_tail
        out["multi_position_decode_spans"] += ev.multi_decode
        out["cross_boundary_replays"] += ev.cross_boundary
        out["replayed_calls"] += f.replay > 0
    return out


def _describe_events(ev: dict[str, int], counts: dict[str, int]) -> str:
    return (f"{ev['calls']} calls in {counts['steps']} steps: {ev['nonzero_offset_chunks']} non-zero-offset chunks, "
            f"{ev['cross_boundary_replays']} cross-boundary spans, {ev['multi_position_decode_spans']} "
            f"multi-position decode spans, {counts['preemptions']} preemptions")
