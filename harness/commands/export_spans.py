"""``omni-stress export-spans``: a run's spans as JSON lines, byte for byte the ``spans.jsonl`` the run
wrote before the span store (issue 48): one ``records.span_json`` line per span, in write order."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from harness.errors import UserError


@click.command("export-spans")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="file to write (default: standard output)")
def command(run_dir: Path, output: Path | None) -> None:
    """Write a run's spans as JSON lines (the spans.jsonl format)."""
    from harness.records import MANIFEST_FILE, write_file_atomic
    from harness.rundir import check_run_files
    from harness.spanstore import export_lines, has_spans

    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: run directory not found")
    check_run_files(run_dir)  # a spans/ or spans.jsonl that is a link to elsewhere, or not what it should be
    if not (run_dir / MANIFEST_FILE).is_file():
        raise UserError(f"{run_dir}: no {MANIFEST_FILE} (not a run directory?)")
    if not has_spans(run_dir):
        raise UserError(f"{run_dir}: the run recorded no spans (no spans/ and no spans.jsonl)")
    try:
        if output is None:
            out = sys.stdout.buffer
            for text in export_lines(run_dir):
                out.write(text.encode("utf-8"))
            out.flush()
        else:
            write_file_atomic(output, "".join(export_lines(run_dir)))
    except ValueError as exc:  # a store file that is not one, a malformed line of spans.jsonl
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"{output if output is not None else 'standard output'}: cannot write ({exc.strerror})") \
            from None
