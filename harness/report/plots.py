"""PNG plots for a run (matplotlib, Agg): people look at these before the tables.

* ``wer``: every request's WER per cell, with the 0.5 line and the cell mean;
* ``events``: the scheduler events per cell (the seed's columns and what explains them), and the
  misaligned positions per cell in their two regions (text: up to and including text-EOS; end:
  after it);
* ``timeline``: the spans of one stressed request, positions on x and steps on y, one panel per
  arm for the same prompt/deploy/run, so a reader sees *why* one arm failed and the other did not.

Each function returns PNG bytes; ``report.write_reports`` writes them and inlines them in the HTML.
"""

from __future__ import annotations

import io
import os
import re
import zlib
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import PathCollection, PolyCollection
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.path import Path
from matplotlib.ticker import FuncFormatter

from harness.metrics import METRICS
from harness.contract import span_regions
from harness.records import SpanRecord
from harness.report.summary import WER_THRESHOLD, CellSummary, Run, SpanTable

matplotlib.use("Agg")  # headless: CI and servers have no display (safe here: no figure exists yet)

DPI = 110
DEPLOY_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#17becf"]

# span kind -> (legend label, colour); drawn in this order
SPAN_KINDS: dict[str, tuple[str, str]] = {
    "prefill": ("prefill from position 0", "#4c72b0"),
    "chunk": ("non-zero-offset prefill chunk", "#f28e2b"),
    "replay": ("replay crossing P", "#d62728"),
    "decode": ("decode (1 position)", "#b8b8b8"),
    "multi": ("multi-position decode", "#8c4fc1"),
}


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


LABEL_WIDTH = 14  # characters per line of a tick label: longer names wrap at their hyphens


def _wrap(name: str, width: int = LABEL_WIDTH) -> str:
    """``name`` on lines of at most ``width`` characters, broken after a hyphen where it can be (a part
    longer than ``width`` keeps its own line): ``qwen3-tts-mrv2-stress`` -> ``qwen3-tts-\nmrv2-stress``."""
    lines: list[str] = []
    for part in re.findall(r"[^-]*-|[^-]+$", name) or [name]:
        if lines and len(lines[-1]) + len(part) <= width:
            lines[-1] += part
        else:
            lines.append(part)
    return "\n".join(lines)


def deploy_prefix(cells: list[CellSummary]) -> str:
    """The hyphen-ended prefix every deploy's name shares (``qwen3-tts-``), said once under the axis
    and left out of the tick labels so that four or more deploys' labels do not run into each other;
    "" when there is none or one deploy."""
    deploys = list(dict.fromkeys(c.deploy for c in cells))
    common = os.path.commonprefix(deploys)
    prefix = common[:common.rfind("-") + 1]
    return prefix if len(deploys) > 1 and all(d != prefix for d in deploys) else ""


def _cell_label(cell: CellSummary, prefix: str = "") -> str:
    """The tick label of a cell: its arm, its deploy (without ``prefix``) and its run, each wrapped."""
    runs = getattr(cell, "pooled_runs", None)
    return (f"{_wrap(cell.arm)}\n{_wrap(cell.deploy[len(prefix):])}\n"
            f"{f'{runs} runs' if runs else f'run {cell.run_number}'}")


def _set_cell_ticks(ax: Any, cells: list[CellSummary]) -> None:
    """One tick per cell, labelled by ``_cell_label``; the deploys' shared prefix said under the axis."""
    prefix = deploy_prefix(cells)
    ax.set_xticks(range(len(cells)), [_cell_label(c, prefix) for c in cells], fontsize=8)
    if prefix:
        ax.set_xlabel(f"deploy names after their shared prefix {prefix}", fontsize=8, color="#444")


# Above this many cells the per-cell plots pool each arm x deploy's runs into one column: a bar per
# cell of a run of hundreds of cells is unreadable, and its figure (one column of pixels per cell) took
# over a minute to draw at 600 cells (bench/scaling.py). The tables keep every cell.
MAX_PLOT_CELLS = 32


def plotted_cells(cells: list[CellSummary]) -> list[CellSummary]:
    """``cells``, or with more than ``MAX_PLOT_CELLS`` of them, one per arm x deploy: the runs' scores
    together, their events and preemptions summed (``pooled_runs``: how many runs)."""
    if len(cells) <= MAX_PLOT_CELLS:
        return cells
    import dataclasses

    from harness.records import EventCounts

    pooled: dict[tuple[str, str], CellSummary] = {}
    counts: dict[tuple[str, str], int] = {}
    for c in cells:
        key = (c.arm, c.deploy)
        if key not in pooled:
            pooled[key] = dataclasses.replace(c, scores=[], oracle_scores=[], events=EventCounts(), preemptions=0,
                                              misaligned_known=False, records=[], requests=0, errors=0)
            counts[key] = 0
        p = pooled[key]
        p.scores += c.scores
        p.oracle_scores += c.oracle_scores
        p.events.add(c.events)
        p.preemptions += c.preemptions
        p.misaligned_known = p.misaligned_known or c.misaligned_known
        p.requests += c.requests
        p.errors += c.errors
        counts[key] += 1
    for key, p in pooled.items():
        p.pooled_runs = counts[key]  # type: ignore[attr-defined]
    return list(pooled.values())


def _jitter(key: str, i: int) -> float:
    """Deterministic horizontal jitter, so the same run always draws the same picture."""
    return ((zlib.crc32(f"{key}/{i}".encode()) % 1000) / 1000 - 0.5) * 0.5


def plot_wer(cells: list[CellSummary], threshold: float = WER_THRESHOLD) -> bytes:
    """Strip plot of per-request WER for each cell, the threshold line and each cell's mean."""
    pooled = len(plotted_cells(cells)) < len(cells)
    cells = plotted_cells(cells)
    deploys = list(dict.fromkeys(c.deploy for c in cells))
    colour = {d: DEPLOY_COLOURS[i % len(DEPLOY_COLOURS)] for i, d in enumerate(deploys)}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.25 * len(cells) + 2), 4.6))
    top = max([1.0] + [s for c in cells for s in c.scores])
    for x, cell in enumerate(cells):
        xs = [x + _jitter(f"{cell.key}", i) for i in range(cell.scored)]
        ax.scatter(xs, cell.scores, s=26, color=colour[cell.deploy], alpha=0.75, edgecolors="white",
                   linewidths=0.5, zorder=3)
        if cell.mean_wer is not None:
            ax.hlines(cell.mean_wer, x - 0.35, x + 0.35, color="black", linewidth=2, zorder=4)
            text = f"mean {cell.mean_wer:.3f}\n{cell.requests_over(threshold)}/{cell.scored} > {threshold}"
        else:
            text = "no scored\nrequests"
        ax.annotate(text, (x, top * 1.06), ha="center", va="bottom", fontsize=8)
    ax.axhline(threshold, color="#444", linestyle="--", linewidth=1, zorder=2)
    ax.annotate(f"WER {threshold}", (-0.55, threshold), xytext=(0, 2), textcoords="offset points", va="bottom",
                ha="left", fontsize=8, color="#444")
    _set_cell_ticks(ax, cells)
    ax.set_xlim(-0.6, len(cells) - 0.4)
    ax.set_ylim(-0.03 * top, top * 1.2)
    ax.set_ylabel("WER per request")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(handles=[Patch(color=colour[d], label=f"{d} deploy") for d in deploys]
              + [Line2D([], [], color="black", linewidth=2, label="cell mean")],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_title("WER of every request, per arm x deploy" + (" (runs pooled)" if pooled else " x run"))
    return _png(fig)


# the counts harness.metrics marks for the events plot, then the cell's preemptions
EVENT_METRICS = [*((m.name, m.label) for m in METRICS if m.plot), ("preemptions", "preemptions")]


def plot_events(cells: list[CellSummary]) -> bytes:
    """Grouped bars of each cell's scheduler events: a stress run that stressed nothing shows flat.
    Below them, where the backend measures them, the misaligned positions per region."""
    pooled = len(plotted_cells(cells)) < len(cells)
    cells = plotted_cells(cells)
    measured = [c for c in cells if c.misaligned_known]
    width_in = max(6.0, 1.6 * len(cells) + 2)
    if measured:
        fig, (ax, ax_mis) = plt.subplots(2, 1, figsize=(width_in, 8.0), gridspec_kw={"height_ratios": [3, 2]})
        _plot_misaligned(ax_mis, cells)
    else:
        fig, ax = plt.subplots(figsize=(width_in, 4.6))
    width = 0.8 / len(EVENT_METRICS)
    cmap = plt.get_cmap("tab10")
    top = 0
    for j, (name, label) in enumerate(EVENT_METRICS):
        values = [c.preemptions if name == "preemptions" else getattr(c.events, name) for c in cells]
        top = max([top] + values)
        xs = [x - 0.4 + width * (j + 0.5) for x in range(len(cells))]
        bars = ax.bar(xs, values, width=width * 0.92, color=cmap(j), label=label)
        ax.bar_label(bars, labels=[str(v) if v else "" for v in values], fontsize=7, padding=1)
    for x, cell in enumerate(cells):
        if not any(getattr(cell.events, n, 0) for n, _ in EVENT_METRICS) and not cell.preemptions:
            ax.annotate("no events", (x, 0), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8,
                        color="#777")
    _set_cell_ticks(ax, cells)
    ax.set_ylim(0, max(1, top) * 1.15)
    ax.set_ylabel("count per cell")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("Scheduler events per arm x deploy" + (" (sums over runs)" if pooled else " x run"))
    fig.tight_layout()
    return _png(fig)


MISALIGNED_REGIONS = [
    ("misaligned_text_positions", "text region (prompt, reply up to text-EOS)", "#c44e52"),
    ("misaligned_end_positions", "end region (after text-EOS)", "#dd8452"),
]


def _plot_misaligned(ax: Any, cells: list[CellSummary]) -> None:
    """Side-by-side bars of each cell's misaligned positions in the text and the end region
    (symlog scale: 0.30.0's end region runs to thousands while a text-region bug may be a handful)."""
    width = 0.35
    top = 0
    for j, (name, label, colour) in enumerate(MISALIGNED_REGIONS):
        values = [getattr(c.events, name) if c.misaligned_known else 0 for c in cells]
        top = max([top] + values)
        xs = [x - width / 2 + j * width for x in range(len(cells))]
        bars = ax.bar(xs, values, width=width * 0.92, color=colour, label=label)
        ax.bar_label(bars, labels=[str(v) if c.misaligned_known and v else "" for v, c in zip(values, cells)],
                     fontsize=7, padding=1)
    for x, cell in enumerate(cells):
        text = "not measured" if not cell.misaligned_known else (
            "none" if not any(getattr(cell.events, n) for n, _, _ in MISALIGNED_REGIONS) else "")
        if text:
            ax.annotate(text, (x, 0), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8,
                        color="#777")
    ax.set_yscale("symlog", linthresh=1)
    # Plain numbers (1, 10, 100) instead of the symlog default's 10^k: those labels go through
    # mathtext, whose first parse was about a fifth of this figure's time (issue 23).
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
    ax.set_ylim(0, max(10, top) * 3)
    _set_cell_ticks(ax, cells)
    ax.set_ylabel("misaligned positions")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("Misaligned positions per region (rows that differ from the contract's)")


def _span_kinds(spans: SpanTable, indices: np.ndarray) -> list[str]:
    """What the timeline colours each span at ``indices`` as, from the table's event flags:
    replay (crosses the prompt boundary) over chunk (non-zero offset) over prefill, else a
    multi-position or single decode."""
    f = {k: v[indices] for k, v in spans.flags.items()}
    kinds = np.where(f["multi_decode"], "multi", "decode").astype(object)
    kinds[f["is_prefill"]] = "prefill"
    kinds[f["nonzero_offset"]] = "chunk"
    kinds[f["cross_boundary"]] = "replay"
    return kinds.tolist()


def pick_stressed_request(run: Run) -> tuple[str, int, str] | None:
    """The (deploy, repeat, prompt) whose spans show the most replays, then chunks, over all arms."""
    score: dict[tuple[str, int, str], list[int]] = {}
    # the request's event counts (the table reads them file by file): cross-boundary replays, non-zero
    # offset chunks and multi-position decodes are the counts of those flags (metrics.EVENT_COUNTS)
    for (_, deploy, repeat, request), (counts, _known) in run.spans.group_events.items():  # summed over arms
        entry = score.setdefault((deploy, repeat, request), [0, 0, 0])
        entry[0] += counts.cross_boundary_replays
        entry[1] += counts.nonzero_offset_chunks
        entry[2] += counts.multi_position_decode_spans
    if not score:
        return None
    best = max(sorted(score), key=lambda k: tuple(score[k]))
    return best if any(score[best]) else None  # nothing was stressed: no timeline worth drawing


def _hatched_boxes(boxes: list[list[tuple[float, float]]], hatch: str = "////") -> PathCollection:
    """All boxes as one compound path: Agg hatches a collection path by path (~0.25 s for the
    ~1800 misaligned decode boxes of main under stress), a single path once; the picture is the
    same (only the anti-aliasing where outlines overlap differs)."""
    verts = np.asarray(boxes, dtype=float)  # (boxes, 4, 2)
    verts = np.concatenate([verts, verts[:, :1]], axis=1).reshape(-1, 2)  # close each box
    codes = np.tile([Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY], len(boxes))
    return PathCollection([Path(verts, codes)], facecolors="none", edgecolors="black", hatch=hatch,
                          linewidths=0.6, zorder=3)


def plot_timeline(run: Run, cells: list[CellSummary], max_arms: int = 4) -> bytes | None:
    """Spans of one stressed request, one panel per arm; None when no request was stressed."""
    picked = pick_stressed_request(run)
    if picked is None:
        return None
    deploy, repeat, prompt = picked
    by_arm: dict[str, list[SpanRecord]] = {}
    kind_of: dict[int, str] = {}  # id(span) -> kind, from the table's flags (no classify_span per draw)
    picked_spans = run.spans.subset(k for k in run.spans.group_events if k[1:] == picked)  # file order
    indices = np.arange(len(picked_spans))
    for s, kind in zip(picked_spans.records(indices), _span_kinds(picked_spans, indices)):
        by_arm.setdefault(s.arm, []).append(s)
        kind_of[id(s)] = kind

    arm_order = list(dict.fromkeys(c.arm for c in cells)) + sorted(by_arm)
    arms = [a for a in dict.fromkeys(arm_order) if a in by_arm][:max_arms]
    records = {(r.arm, r.deploy, r.repeat, r.prompt_id): r for r in run.requests}
    run_number = {c.key: c.run_number for c in cells}

    firsts = {a: min(s.step for s in by_arm[a]) for a in arms}
    # The story is in the prefill chunks and replays: show the steps up to the last of them (plus a
    # margin), shared by all panels so arms stay comparable; the plain decode tail is summarised.
    last_event = max((s.step - firsts[a] for a in arms for s in by_arm[a] if kind_of[id(s)] != "decode"), default=0)
    y_max = max(20, int(last_event * 1.3) + 10)
    visible = {a: [s for s in by_arm[a] if s.step - firsts[a] <= y_max] for a in arms}
    x_max = max(max(s.c + s.n, s.P) for a in arms for s in visible[a])
    half = max(0.45, y_max / 240)  # a minimum bar height keeps one-step spans visible
    fig, axes = plt.subplots(1, len(arms), figsize=(5.6 * len(arms), 7.0), squeeze=False)
    for ax, arm in zip(axes[0], arms):
        spans = sorted(visible[arm], key=lambda s: s.step)
        hidden = [s for s in by_arm[arm] if s.step - firsts[arm] > y_max]
        first = firsts[arm]
        polys: dict[str, list[list[tuple[float, float]]]] = {k: [] for k in SPAN_KINDS}
        bad: list[list[tuple[float, float]]] = []  # text region misaligned
        bad_end: list[list[tuple[float, float]]] = []  # only the end region
        for s in spans:
            y = s.step - first
            box = [(s.c, y - half), (s.c + s.n, y - half), (s.c + s.n, y + half), (s.c, y + half)]
            polys[kind_of[id(s)]].append(box)
            text, end = span_regions(s)
            if text:
                bad.append(box)
            elif end:
                bad_end.append(box)
        totals = {k: 0 for k in SPAN_KINDS}  # legend counts cover the whole request, not just the window
        for s in by_arm[arm]:
            totals[kind_of[id(s)]] += 1
        handles = []
        for kind, boxes in polys.items():
            if boxes:
                label, colour = SPAN_KINDS[kind]
                ax.add_collection(PolyCollection(boxes, facecolors=colour, edgecolors=colour, linewidths=0.4))
                handles.append(Patch(color=colour, label=f"{label} ({totals[kind]})"))
        regions = [span_regions(s) for s in spans]
        if bad:
            ax.add_collection(_hatched_boxes(bad))
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="////",
                                 label=f"misaligned rows, text region ({sum(t for t, _ in regions)} positions)"))
        if bad_end:
            ax.add_collection(_hatched_boxes(bad_end, "...."))
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="....",
                                 label=f"misaligned rows, end region only "
                                       f"({sum(e for t, e in regions if not t)} positions)"))
        mism = [s for s in spans if s.rows != s.n]
        if mism:
            ax.scatter([s.c + s.n for s in mism], [s.step - first for s in mism], marker="x", s=22, color="black",
                       linewidths=1.2, zorder=4)
            handles.append(Line2D([], [], marker="x", color="black", linestyle="",
                                  label=f"rows returned != n ({len(mism)})"))
        P = spans[0].P
        ax.axvline(P, color="black", linestyle="--", linewidth=1)
        handles.append(Line2D([], [], color="black", linestyle="--", label=f"prompt boundary P = {P}"))
        if hidden:
            end = max(s.c + s.n for s in hidden)
            ax.annotate(f"... then {len(hidden)} more decode steps, to position {end}", (0.02, 0.02),
                        xycoords="axes fraction", fontsize=8, color="#555")
        ax.set_xlim(0, x_max * 1.03 + 1)
        ax.set_ylim(y_max + 2 * half + 1, -2 * half - 1)  # time runs downwards
        ax.set_xlabel("position")
        ax.set_ylabel(f"scheduler step (from step {first})")
        ax.grid(alpha=0.25)
        rec = records.get((arm, deploy, repeat, prompt))
        wer = f"WER {rec.score:.3f}" if rec is not None and rec.score is not None else "WER n/a"
        pre = ""
        if rec is not None:
            pre = f", {rec.preemptions} preemption{'' if rec.preemptions == 1 else 's'}"
        ax.set_title(f"{arm}: {deploy} deploy, run {run_number.get((arm, deploy, repeat), repeat)}\n"
                     f"{prompt}: {wer}{pre}", fontsize=10)
        ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2,
                  frameon=False)
    fig.suptitle("Talker spans of one stressed request: which positions each step computed", fontsize=11)
    fig.tight_layout()
    return _png(fig)


def render_all(run: Run, cells: list[CellSummary]) -> dict[str, bytes]:
    """{name: PNG bytes}; the timeline is left out when no recorded span shows stress.

    The timeline, about half of the drawing time, is drawn in a forked child while this process draws
    the other two (``harness.proc.fork_call``: same state, same bytes); where a fork is not safe, or the
    child fails, it is drawn here after them."""
    from harness.proc import fork_call

    child = fork_call(lambda: plot_timeline(run, cells))
    try:
        out = {"wer": plot_wer(cells), "events": plot_events(cells)}
        drawn, timeline = child.result() if child is not None else (False, None)
    finally:
        if child is not None:
            child.close()
    if not drawn:
        timeline = plot_timeline(run, cells)
    if timeline is not None:
        out["timeline"] = timeline
    return out
