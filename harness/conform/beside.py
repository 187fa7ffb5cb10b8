"""Conform beside a run: for each situation ``conform`` checks, what a sim (or real) run shows of it.

``conform`` says statically whether a release's hook gives every position the same row under every
schedule (chunk, tail, multi-position decode, cross-boundary replay, restart after preemption). A run
says what the scheduler actually produced under a deploy, and what the Talker then said. This module
puts the two side by side: per situation, the conform verdict of the family's conform model on the
deploy's runner (``qwen3-tts`` for V1, ``qwen3-tts@mrv2`` for MRV2), and for each arm x deploy of the
run the spans of that kind, how many of them delivered misaligned rows, the requests affected and
the worst of them (its WER and its first wrong span). A chunk's evidence includes the decode steps after
the chunked prefill (before any replay), a replay's the decode steps after it: conform's cell is the first
position that differs anywhere in a schedule with that situation, not only inside the span itself.

Pure: the conform matrix as its JSON (``harness.conform.report.Matrix.to_json``) and the run's span
and request records as dicts in, a markdown table out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SITUATIONS: tuple[tuple[str, str], ...] = (  # conform's column key, what the table calls it
    ("chunk", "non-zero-offset chunk"),
    ("tail", "one-token tail"),
    ("multi_decode", "multi-position decode"),
    ("cross_replay", "cross-boundary replay"),
    ("restart", "decode after a replay (conform: restart after preemption)"),
)


@dataclass
class Evidence:
    """What one cell of a run shows of one situation."""

    spans: int = 0  # spans of this kind
    wrong: int = 0  # of them, spans whose rows were misaligned
    requests: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # request -> first wrong (step, c, n)
    # spans whose rows the trace did not check (a real run at ``--trace spans``, or a family whose worker has no
    # contract check): the requests that had one, by their first such span; their WER is then the evidence
    unchecked: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    def describe(self, wer: dict[str, float | None]) -> str:
        if not self.spans:
            return "not reached (0 spans)"
        if self.unchecked and not self.requests:
            text, requests, which = f"{self.spans} spans, rows not checked", self.unchecked, "first such span"
        else:
            text, requests, which = f"{self.spans} spans, {self.wrong} misaligned", self.requests, "first wrong span"
        if not requests:
            return text
        worst = max(requests, key=lambda r: (wer.get(r) or 0.0, r))
        step, c, n = requests[worst]
        w = wer.get(worst)
        return (f"{text}; {len(requests)} requests, worst {worst} (WER {w:.3f}, {which} step {step} c={c} n={n})"
                if w is not None else f"{text}; {len(requests)} requests, worst {worst} (no WER: an error)")


def _kind(span: dict[str, Any], replayed: bool, chunked: bool) -> str | None:
    if span.get("cross_boundary"):
        return "cross_replay"
    if span.get("multi_decode"):
        return "multi_decode"
    if span.get("one_token_tail"):
        return "tail"
    if span.get("nonzero_offset"):
        return "chunk"
    if span["c"] >= span["P"] and span["n"] == 1:
        if replayed:
            return "restart"  # a decode step after the request's first replay: a restarted or shifted hook errs here
        if chunked:
            # a decode step after a chunked prefill: conform's chunk schedule differs at the first position
            # that differs, which is a decode position when the chunking shifted a counter (Qwen3-Omni's
            # streamed rows), so its evidence counts these steps too
            return "chunk"
    return None


def cell_evidence(spans: Iterable[dict[str, Any]]) -> dict[str, Evidence]:
    """Per situation, the evidence of one cell's spans (any order: sorted by step per request here)."""
    out = {key: Evidence() for key, _ in SITUATIONS}
    by_request: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        by_request.setdefault(s["request"], []).append(s)
    for rid, rows in by_request.items():
        rows.sort(key=lambda s: s["step"])
        decoded = replayed = chunked = False
        for s in rows:
            if s["c"] >= s["P"]:
                decoded = True
            elif decoded:  # a prefill span after a decode: a replay after a preemption
                replayed = True
            chunked = chunked or bool(s.get("nonzero_offset"))
            kind = _kind(s, replayed, chunked)
            if kind is None:
                continue
            ev = out[kind]
            ev.spans += 1
            if s.get("error") or (s.get("misaligned") or 0) > 0:
                ev.wrong += 1
                ev.requests.setdefault(rid, (s["step"], s["c"], s["n"]))
            elif s.get("misaligned", 0) is None:
                ev.unchecked.setdefault(rid, (s["step"], s["c"], s["n"]))
    return out


def conform_rows(matrix: dict[str, Any], model: str) -> dict[str, dict[str, str]]:
    """``{mode: {situation: summary}}`` of ``model``'s rows in one conform matrix (JSON form); a mode is the
    runner (``v1``, ``v2``), with ``+async`` for the ``async_chunk: true`` rows (``model@async``)."""
    rows: dict[str, dict[str, str]] = {}
    modes = {model: "v1", f"{model}@mrv2": "v2", f"{model}@async": "v1+async", f"{model}@async+mrv2": "v2+async"}
    for m in matrix.get("models", []):
        runner = modes.get(m.get("model", ""))
        if runner is None:
            continue
        cells = m.get("cells") or {}
        rows[runner] = {key: (cells.get(key) or {}).get("summary", "not checked") for key, _ in SITUATIONS}
    return rows


@dataclass
class BesideRun:
    """One run put beside the conform verdicts: its column label (``sim``, ``real``), its (arm, deploy,
    runner) cells, its span records, each request's WER (by (arm, deploy, prompt)) and, for a real run, each
    cell's release."""

    label: str
    cells: list[tuple[str, str, str]]
    spans: list[dict[str, Any]]
    wer: dict[tuple[str, str, str], float | None]
    # (arm, deploy) -> the vLLM-Omni release a real cell's server ran (the manifest): named in its column, so a
    # release's conform verdicts are read beside the runs of that release
    releases: dict[tuple[str, str], str] = field(default_factory=dict)


def beside_table(matrix: dict[str, Any], model: str, runs: list[BesideRun]) -> str:
    """The markdown table: one row per situation; the conform verdict on each runner the runs' cells use,
    then one column per (arm, deploy) cell of each run, in the order given (e.g. the sim's, then the
    real server's: conform | sim | real, issue 31)."""
    conform = conform_rows(matrix, model)

    def mode(runner: str) -> str:  # a model whose path async_chunk does not change has no @async rows: its runner's
        return runner if runner in conform or "+async" not in runner else runner.replace("+async", "")

    runners = sorted({mode(runner) for run in runs for _a, _d, runner in run.cells})
    columns: list[tuple[str, dict[str, Evidence], dict[str, float | None]]] = []
    quiet: list[str] = []
    for run in runs:
        by_cell: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for s in run.spans:
            by_cell.setdefault((s["arm"], s["deploy"]), []).append(s)
        for a, d, _r in run.cells:
            evidence = cell_evidence(by_cell.get((a, d), []))
            if not any(e.spans for e in evidence.values()):  # a cell that reached none of them says nothing
                quiet.append(f"{run.label} {a} / {d}")
                continue
            cell_wer = {rid: w for (aa, dd, rid), w in run.wer.items() if (aa, dd) == (a, d)}
            on = f" on vLLM-Omni {run.releases[(a, d)]}" if (a, d) in run.releases else ""
            columns.append((f"{run.label} {a} / {d}{on}", evidence, cell_wer))
    label = {"v1": "V1", "v2": "MRV2", "v1+async": "V1, async_chunk", "v2+async": "MRV2, async_chunk"}
    head = ["situation"] + [f"conform {model} ({label[r]})" for r in runners] + [name for name, _e, _w in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, name in SITUATIONS:
        row = [name] + [conform.get(r, {}).get(key, "not checked") for r in runners]
        row += [evidence[key].describe(cell_wer) for _n, evidence, cell_wer in columns]
        lines.append("| " + " | ".join(row) + " |")
    if quiet:
        lines.append("")
        lines.append("Cells that reached none of these situations: " + ", ".join(quiet) + ".")
    return "\n".join(lines) + "\n"
