"""``omni-stress compare RUN_A RUN_B``: the summary tables of two runs side by side, with deltas."""

from __future__ import annotations

import json
from pathlib import Path

import click

from harness.report import summary
from harness.report import tables as report
from harness.proc import printable_streams
from harness.rundir import same_family


@click.command("compare")
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["terminal", "markdown", "csv", "json"]), default="terminal",
              show_default=True)
@click.option("--strict", is_flag=True, help="Exit 2 when a run is incomplete (killed, a torn last line), instead "
                                             "of a warning.")
@click.option("--any-family", is_flag=True, help="Compare runs of two model families anyway (refused otherwise).")
def command(run_a: Path, run_b: Path, fmt: str, strict: bool, any_family: bool) -> None:
    """Compare RUN_B (e.g. a PR) against RUN_A (its base): cells side by side, delta = B - A."""
    printable_streams()
    a, b = report.load_run(run_a), report.load_run(run_b)
    if not any_family:
        same_family(f"compare {run_a} {run_b}", a.manifest, b.manifest,
                    "their cells and prompts do not pair (give --any-family to compare anyway)")
    for run in (a, b):
        warning = summary.incomplete_warning(run, strict, "not compared (--strict)")
        if warning:
            click.echo(warning, err=True)
    cells_a, cells_b = report.summarize_cells(a), report.summarize_cells(b)
    table = report.compare_table(cells_a, cells_b)
    if fmt == "csv":
        click.echo(table.to_csv(index=False), nl=False)
        return
    if fmt == "json":
        click.echo(json.dumps({"a": a.run_id, "b": b.run_id, "rows": table.to_dict(orient="records")}, indent=2))
        return
    header = [f"A = {a.run_id} ({run_a}), WER source: {report.WER_SOURCE_TEXT[report.wer_source(cells_a)]}",
              f"B = {b.run_id} ({run_b}), WER source: {report.WER_SOURCE_TEXT[report.wer_source(cells_b)]}"]
    if report.wer_source(cells_a) != report.wer_source(cells_b):
        header.append("warning: the two runs score WER differently; WER deltas mix sources")
    body = report.render_markdown(table) if fmt == "markdown" else report.render_text(table)
    sep = "\n\n" if fmt == "markdown" else "\n"
    click.echo(sep.join(header) + "\n\n" + body + "\n\n" + report.COMPARE_NOTE)
