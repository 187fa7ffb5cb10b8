"""``omni-stress report RUN_DIR``: print a run's tables and (re)write every report file."""

from __future__ import annotations

import json
from pathlib import Path

import click

from harness.config import slo_option

from harness.report import summary
from harness.report import tables as report
from harness.proc import printable_streams


@click.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["terminal", "markdown", "csv", "json"]), default="terminal",
              show_default=True, help="What to print; all formats are written to the run directory anyway.")
@click.option("--requests/--no-requests", "with_requests", default=False,
              help="Also print the per-request rows (terminal format).")
@click.option("--paired/--no-paired", "with_paired", default=False,
              help="Also print the paired per-prompt table: WER minus the same prompt's reference-deploy WER.")
@click.option("--no-write", is_flag=True, help="Only print; do not (re)write summary.* / report.html / plots.")
@click.option("--slo", "slo_text", default=None, metavar="ttfp_s=S,max_stall_s=S",
              help="Goodput's streaming SLO for every cell instead of each deploy's slo: (a key left out is "
                   "unbounded; default without either: no stall over 0.1 s).")
def command(run_dir: Path, fmt: str, with_requests: bool, with_paired: bool, no_write: bool,
            slo_text: str | None) -> None:
    """Print the summary table and the extended table of RUN_DIR (per-request rows with --requests).

    Writes summary.csv, summary.md, summary.json, requests.csv, paired.csv, plots/*.png and a
    self-contained report.html into RUN_DIR (file list on stderr, so stdout can be piped). An
    incomplete run is reported with a warning (on stderr and in the reports); the gate refuses it.
    """
    printable_streams()
    run = report.load_run(run_dir, codec_tokens=False)  # the tables never read the tokens (issue 48)
    problems = report.run_problems(run)
    if problems:
        click.echo(f"omni-stress: warning: {summary.problems_line(run, problems)}; the gate refuses it", err=True)
    cells = summary.with_slo(report.summarize_cells(run), slo_option(slo_text) if slo_text is not None else None)
    if fmt == "terminal":
        text = report.terminal_text(run, cells, with_requests=with_requests, with_paired=with_paired)
    elif fmt == "markdown":
        text = report.markdown_text(run, cells)
    elif fmt == "csv":
        text = report.cells_frame(cells).to_csv(index=False)
    else:
        text = json.dumps(report.json_summary(run, cells), indent=2) + "\n"
    click.echo(text, nl=False)
    if not no_write:
        try:
            if isinstance(run.manifest.get("sweep"), dict):  # a sweep's run: its map too, its verdict the map's
                from harness.gate import family_rules_path, load_rules
                from harness.rundir import manifest_family
                from harness.sweep.report import build_map, map_page_verdict, write_sweep_report

                rules = load_rules(family_rules_path(manifest_family(run.manifest)))  # the run's family's
                sweep_map = build_map(run, rules)
                written = report.write_reports(run, cells, map_page_verdict(sweep_map))
                written.update(write_sweep_report(sweep_map))
            else:
                from harness.gate.verdict import page_verdict

                written = report.write_reports(run, cells, page_verdict(run, cells))
        except OSError as exc:  # a read-only run directory (a downloaded artifact), a full disk
            where = exc.filename or run_dir
            click.echo(f"omni-stress: warning: {run_dir}: could not rewrite the report files ({where}: "
                       f"{exc.strerror or exc}); the tables above are complete (--no-write only prints)", err=True)
            return
        for kind, path in written.items():
            click.echo(f"wrote {kind}: {path}", err=True)
