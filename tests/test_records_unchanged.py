"""Issue 23: making the sim faster must not change a single result.

Runs two small matrices as a user does (``omni-stress run --asr none``, fixed seed) and compares
their ``requests.jsonl`` and spans with golden files written before the sim's hot path
was optimised, line by line and field by field, except the fields that are times (``wall_s``,
``asr_seconds``):

* the words Talker: main, pr x reference, stress on the small prompt set (4 prompts, seed 42);
* the speaking Talker (``--sim-talker speaking``): main, pr x cpu-reference, cpu-stress on
  ``cpu_smoke``.

Spans live in the span store (``spans/*.arrow``, issue 48) since the golden files were written: they
are compared through ``omni-stress export-spans``, whose lines must also be exactly the
``json.dumps(..., sort_keys=True)`` lines spans.jsonl held (the export is byte for byte today's file).

The golden files are gzipped canonical JSON lines (``tests/data/records_golden/``). To rewrite
them after a change that is *meant* to change results::

    .venv/bin/python tests/test_records_unchanged.py --regenerate
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "data" / "records_golden"
TIME_FIELDS = frozenset({"wall_s", "asr_seconds"})

MATRICES: dict[str, list[str]] = {
    "words": ["--prompts", str(REPO / "tests" / "fixtures" / "prompts_small.yaml"), "--arm", "main", "--arm", "pr",
              "--deploy", "reference", "--deploy", "stress", "--seed", "42"],
    "speaking": ["--sim-talker", "speaking", "--prompts", "cpu_smoke", "--arm", "main", "--arm", "pr",
                 "--deploy", "cpu-reference", "--deploy", "cpu-stress", "--seed", "42"],
}


def run_matrix(name: str, out: Path) -> Path:
    cmd = [sys.executable, "-m", "harness.cli", "run", "--asr", "none", "--quiet", "--no-cache",
           "--out", str(out), "--run-id", name, *MATRICES[name]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = out / name
    assert not (run_dir / "spans.jsonl").exists() and list((run_dir / "spans").glob("*.arrow"))
    export = subprocess.run([sys.executable, "-m", "harness.cli", "export-spans", str(run_dir), "-o",
                             str(out / f"{name}.spans.jsonl")], cwd=REPO, capture_output=True, text=True, timeout=600,
                            check=False)
    assert export.returncode == 0, export.stderr[-3000:]
    return run_dir


def record_file(run_dir: Path, kind: str) -> Path:
    """requests.jsonl, or the spans as ``export-spans`` wrote them beside the run directory."""
    return run_dir / "requests.jsonl" if kind == "requests" else run_dir.parent / f"{run_dir.name}.spans.jsonl"


def canonical_lines(path: Path) -> list[str]:
    """Each record as sorted-key JSON without its time fields, in file order."""
    lines = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = {k: v for k, v in json.loads(line).items() if k not in TIME_FIELDS}
            lines.append(json.dumps(rec, sort_keys=True, separators=(",", ":")))
    return lines


def golden_path(name: str, kind: str) -> Path:
    return GOLDEN / f"{name}.{kind}.jsonl.gz"


def write_golden(name: str, run_dir: Path) -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for kind in ("requests", "spans"):
        data = ("\n".join(canonical_lines(record_file(run_dir, kind))) + "\n").encode()
        with open(golden_path(name, kind), "wb") as fh, gzip.GzipFile(fileobj=fh, mode="wb", mtime=0,
                                                                       filename="", compresslevel=9) as gz:
            gz.write(data)


def read_golden(name: str, kind: str) -> list[str]:
    return gzip.decompress(golden_path(name, kind).read_bytes()).decode().splitlines()


@pytest.mark.parametrize("name", sorted(MATRICES))
def test_records_match_golden(name: str, tmp_path: Path) -> None:
    run_dir = run_matrix(name, tmp_path)
    exported = record_file(run_dir, "spans").read_text().splitlines()
    assert exported and all(line == json.dumps(json.loads(line), sort_keys=True) for line in exported)
    for kind in ("requests", "spans"):
        got, want = canonical_lines(record_file(run_dir, kind)), read_golden(name, kind)
        assert len(got) == len(want), f"{name} {kind}.jsonl: {len(got)} records, golden has {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                gd, wd = json.loads(g), json.loads(w)
                diff = {k: (gd.get(k), wd.get(k)) for k in sorted(set(gd) | set(wd)) if gd.get(k) != wd.get(k)}
                pytest.fail(f"{name} {kind}.jsonl line {i + 1} differs from the golden file "
                            f"(field: (now, golden)): {str(diff)[:2000]}")


def test_decode_span_flags_are_the_tables() -> None:
    """``contract.span_flags``' shortcut for decode spans gives what the EVENTS table gives."""
    from harness.contract import EVENTS, count_events, _count_events_each, span_flags
    from harness.records import SpanRecord

    for P in (2, 7, 61):
        for c in (P, P + 1, P + 500):
            assert span_flags(P, c, 1, 1) == {k: bool(pred(P, c, 1, 1)) for k, pred in EVENTS.items()}
    spans = [SpanRecord("a", "d", 1, "r", i, P, c, n, rows, misaligned_text=i % 3, misaligned_end=i % 2)
             for i, (P, c, n, rows) in enumerate([(9, 0, 9, 9), (9, 0, 4, 9), (9, 4, 5, 3), (9, 9, 1, 1),
                                                  (9, 3, 8, 8), (9, 12, 3, 3), (9, 8, 1, 0), (9, 10, 1, 1)])]
    assert count_events(spans) == _count_events_each(spans)


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        for matrix in MATRICES:
            write_golden(matrix, run_matrix(matrix, Path(tmp)))
            print(f"wrote {golden_path(matrix, 'requests')} and {golden_path(matrix, 'spans')}")
