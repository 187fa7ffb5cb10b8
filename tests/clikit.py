"""Helpers shared by the bad-input tests (tests/test_bad_input_*.py): what a user sees of one failed
command, and the Errors column of the run table. The CLI runners themselves are in conftest.py."""

from __future__ import annotations

import re

from conftest import CliResult


def assert_one_line_error(res: CliResult, *needles: str) -> str:
    """Exit 2, nothing on stderr but ``omni-stress: error: ...`` on one line, no traceback."""
    assert res.exit_code == 2, (res.exit_code, res.stderr, res.stdout[-2000:])
    assert "Traceback" not in res.stderr + res.stdout
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    line = lines[0]
    assert line.startswith("omni-stress: error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def errors_column(table: str) -> dict[str, int]:
    """The Errors column of the extended terminal table, by arm (cells sliced by the ``----`` rule)."""
    lines = table.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("Arm ") and "Errors" in ln)
    at = lines[header].index("Errors")
    spans = [m.span() for m in re.finditer(r"-+", lines[header + 1])]
    lo, hi = next((a, b) for a, b in spans if a <= at < b)
    out = {}
    for ln in lines[header + 2:]:
        if not ln.strip():
            break
        out[ln.split()[0]] = int(ln[lo:hi])
    return out
