"""The span store (issue 48, ``harness/spanstore.py``): spans round-trip exactly, a killed write leaves
only whole files, old runs with spans.jsonl stay readable, the export is byte for byte spans.jsonl, the
report reads the store by column to the same numbers, and a corrupt file is one line naming it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from clikit import assert_one_line_error
from conftest import invoke_cli

from harness import spanstore
from harness.errors import UserError
from harness.records import JsonlWriter, SpanRecord, span_json, write_manifest
from harness.report.summary import SpanTable, StoredSpanTable, load_run
from harness.spanstore import (
    SpanStoreWriter,
    drop_cells,
    export_lines,
    read_spans,
    span_cells,
    span_files,
)

CELLS = [("main", "reference", 1), ("main", "stress", 1), ("pr", "stress", 2)]


def make_spans(seed: int = 0, per_cell: int = 300) -> list[SpanRecord]:
    """Spans of three cells, interleaved requests, every kind of field value the store must keep."""
    rng = random.Random(seed)
    out = []
    for arm, deploy, repeat in CELLS:
        for step in range(per_cell):
            P = rng.randint(1, 90)
            c = rng.choice([0, rng.randint(0, P + 40)])
            n = rng.randint(1, 12)
            rows = rng.choice([n, n, max(n - 1, 0), 0])
            kind = rng.random()
            if kind < 0.6:  # the split counts
                regions = {"misaligned_text": rng.randint(0, 3), "misaligned_end": rng.randint(0, 2)}
            elif kind < 0.75:  # written before the split: misaligned alone
                regions = {"misaligned": rng.randint(0, 4)}
            elif kind < 0.85:  # one region known
                regions = {"misaligned_text": rng.randint(0, 3)}
            else:  # unknown
                regions = {}
            error = rng.choice([None, None, None, "boom: \u00e9\u4e2d \"quoted\"\n"])
            request = rng.choice(["p01-weather", "p02 spaces", "p03-\u00fc"])
            out.append(SpanRecord(arm, deploy, repeat, request, step, P, c, n, rows, error=error, **regions))
    out.append(SpanRecord("pr", "stress", 2, "p04-big", 10**6, 2**40, 2**33, 3, 3, misaligned_text=2**35,
                          misaligned_end=0))  # beyond int32: the file's column is int64
    return out


def write_store(run_dir: Path, spans: list[SpanRecord], batches: int = 3) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = SpanStoreWriter(run_dir)
    size = max(len(spans) // batches, 1)
    for i in range(0, len(spans), size):  # as backends emit: some lists, a flush before records
        writer.write_many(spans[i:i + size])
        writer.flush()
    writer.close()


def write_jsonl(run_dir: Path, spans: list[SpanRecord]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    w = JsonlWriter(run_dir / "spans.jsonl")
    w.write_many(spans)
    w.close()
    return run_dir / "spans.jsonl"


def test_round_trip_is_exact(tmp_path: Path) -> None:
    spans = make_spans()
    write_store(tmp_path, spans)
    assert read_spans(tmp_path) == spans  # every field, the recomputed flags included
    files = span_files(tmp_path)
    assert len(files) >= len(CELLS)  # a file never holds two cells
    for path in files:
        table = spanstore.read_span_file(path)
        assert len(set(zip(table.column("arm").to_pylist(), table.column("deploy").to_pylist(),
                           table.column("repeat").to_pylist()))) == 1
        assert spanstore.file_cell(path) == (table.column("arm")[0].as_py(), table.column("deploy")[0].as_py(),
                                             table.column("repeat")[0].as_py())
    assert span_cells(tmp_path) == set(CELLS)
    assert not list((tmp_path / "spans").glob(".*"))


def test_export_is_spans_jsonl_byte_for_byte(tmp_path: Path) -> None:
    spans = make_spans(1)
    legacy = write_jsonl(tmp_path / "old", spans)
    write_store(tmp_path / "new", spans)
    exported = "".join(export_lines(tmp_path / "new")).encode()
    assert exported == legacy.read_bytes()
    assert exported == "".join(span_json(s) + "\n" for s in spans).encode()
    # and through the command, to a file and to standard output
    for run in (tmp_path / "new", tmp_path / "old"):
        write_manifest(run, {"cells": []})
        res = invoke_cli("export-spans", str(run), "-o", str(tmp_path / "out.jsonl"))
        assert res.exit_code == 0, res.stderr
        assert (tmp_path / "out.jsonl").read_bytes() == legacy.read_bytes()
    res = invoke_cli("export-spans", str(tmp_path / "new"))
    assert res.exit_code == 0 and res.stdout.encode() == legacy.read_bytes()


def test_a_killed_write_leaves_only_whole_files(tmp_path: Path) -> None:
    """A kill during a file's write leaves its temporary file: readers skip it, the next writer (a
    --resume) removes it, and the cell it belonged to has no spans (it runs again)."""
    spans = make_spans(2)
    first = [s for s in spans if (s.arm, s.deploy, s.repeat) == CELLS[0]]
    write_store(tmp_path, first, batches=1)
    whole = span_files(tmp_path)
    spanstore.write_span_file(tmp_path / "spans" / "000002.arrow", [s for s in spans if s not in first])
    data = (tmp_path / "spans" / "000002.arrow").read_bytes()
    (tmp_path / "spans" / "000002.arrow").unlink()
    torn = tmp_path / "spans" / ".000002.arrow.999.tmp"
    torn.write_bytes(data[: len(data) // 2])
    assert span_files(tmp_path) == whole
    assert read_spans(tmp_path) == first and span_cells(tmp_path) == {CELLS[0]}
    writer = SpanStoreWriter(tmp_path)
    assert not torn.exists()
    writer.write_many([s for s in spans if s not in first])
    writer.close()
    assert read_spans(tmp_path) == spans
    assert [p.name for p in span_files(tmp_path)] == ["000001.arrow", "000002.arrow", "000003.arrow"]


def test_drop_cells_for_resume(tmp_path: Path) -> None:
    spans = make_spans(3)
    write_store(tmp_path, spans, batches=7)
    drop_cells(tmp_path, {CELLS[1]})
    assert read_spans(tmp_path) == [s for s in spans if (s.arm, s.deploy, s.repeat) != CELLS[1]]
    # an old run's spans.jsonl beside the store (resumed by this version): both lose the cell
    old = make_spans(4, per_cell=20)
    write_jsonl(tmp_path, old)
    drop_cells(tmp_path, {CELLS[0]})
    assert read_spans(tmp_path) == [s for s in old if (s.arm, s.deploy, s.repeat) != CELLS[0]] + \
        [s for s in spans if (s.arm, s.deploy, s.repeat) not in CELLS[:2]]


def test_a_batch_limit_splits_a_large_cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spanstore, "FLUSH_SPANS", 100)
    spans = make_spans(5)
    writer = SpanStoreWriter(tmp_path)
    writer.write_many(spans)
    writer.close()
    assert len(span_files(tmp_path)) == 10  # 3 x 300 in files of at most 100, and the last cell's extra span
    assert read_spans(tmp_path) == spans


def test_old_jsonl_run_reads_as_before(tmp_path: Path) -> None:
    """A run written before the store: spans.jsonl, a torn last line dropped, as always."""
    spans = make_spans(6)
    path = write_jsonl(tmp_path, spans)
    with open(path, "a") as fh:
        fh.write('{"P": 3, "arm": "ma')
    assert read_spans(tmp_path) == spans
    assert "".join(export_lines(tmp_path)) == "".join(span_json(s) + "\n" for s in spans)


def _run_dir(root: Path, spans: list[SpanRecord], store: bool) -> Path:
    (write_store if store else write_jsonl)(root, spans)
    write_manifest(root, {"cells": [{"arm": a, "deploy": d, "repeat": r} for a, d, r in CELLS]})
    (root / "requests.jsonl").write_text("")
    return root


def test_the_report_reads_the_store_to_the_same_numbers(tmp_path: Path) -> None:
    spans = make_spans(7)
    old = load_run(_run_dir(tmp_path / "old", spans, store=False)).spans
    new = load_run(_run_dir(tmp_path / "new", spans, store=True)).spans
    assert type(old) is SpanTable and type(new) is StoredSpanTable
    assert len(new) == len(old) == len(spans)
    assert new.group_events == old.group_events
    assert new.group_codes[0] == old.group_codes[0]
    assert np.array_equal(new.group_codes[1], old.group_codes[1])
    for name in ("step", "P", "c", "n", "rows", "misaligned", "misaligned_text", "misaligned_end",
                 "misaligned_known", "repeat"):
        assert np.array_equal(new.columns[name], old.columns[name]), name
    for name, flags in old.flags.items():
        assert np.array_equal(new.flags[name], flags), name
    picked = [k for k in old.group_events if k[3] == "p02 spaces"]
    assert [(s.arm, s.request, s.step, s.P, s.misaligned) for s in new.subset(picked)] == \
        [(s.arm, s.request, s.step, s.P, s.misaligned) for s in old.subset(picked)]
    assert [(d["request"], d["P"], d["c"], d["n"]) for d in new.raw] == \
        [(d["request"], d["P"], d["c"], d["n"]) for d in old.raw]
    # an old run resumed by this version: its spans.jsonl, then the store
    both = tmp_path / "both"
    _run_dir(both, spans[:400], store=False)
    write_store(both, spans[400:])
    assert load_run(both).spans.group_events == old.group_events


def test_corrupt_span_file_is_one_clear_error(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run", make_spans(8), store=True)
    bad = span_files(run)[1]
    bad.write_bytes(b"this is not arrow\n")
    with pytest.raises(ValueError, match=f"{bad}: not a readable span file"):
        read_spans(run)
    with pytest.raises(UserError, match=f"{bad}: not a readable span file"):
        _ = load_run(run).spans.group_events
    for command in (["report", "--no-write"], ["gate"], ["export-spans"]):
        assert_one_line_error(invoke_cli(*command[:1], str(run), *command[1:]), f"{bad}: not a readable span file")
    # a valid Arrow file without the span columns
    import pyarrow as pa

    with pa.OSFile(str(bad), "wb") as fh, pa.ipc.new_file(fh, pa.schema([("x", pa.int32())])) as w:
        w.write_table(pa.table({"x": pa.array([1], pa.int32())}))
    with pytest.raises(ValueError, match="not a span file of this version"):
        read_spans(run)


def test_bytes_per_span_are_a_fraction_of_jsonl(tmp_path: Path) -> None:
    """The sim's spans are regular: the store holds them in well under a tenth of spans.jsonl (the
    measured figure on the main job is about 1/150, bench/scaling.py)."""
    rng = random.Random(9)
    spans = []
    for request in range(40):
        P = rng.randint(40, 90)
        spans.append(SpanRecord("main", "stress", 1, f"p{request:02d}", request, P, 0, P, P, 0, 0))
        spans += [SpanRecord("main", "stress", 1, f"p{request:02d}", request + 1 + i, P, P + i, 1, 1, 0, 0)
                  for i in range(300)]
    write_store(tmp_path / "new", spans, batches=1)
    legacy = write_jsonl(tmp_path / "old", spans)
    assert spanstore.store_bytes(tmp_path / "new") * 10 < legacy.stat().st_size
    assert json.loads(legacy.read_text().splitlines()[0])["request"] == "p00"


def test_a_full_disk_names_the_span_file_and_leaves_no_temporary_file(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins
    import errno

    real_open = builtins.open

    class Full:
        def __init__(self, fh) -> None:
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.fh.close()

        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        return Full(fh) if isinstance(file, int) and "b" in mode else fh

    writer = SpanStoreWriter(tmp_path)
    writer.write_many(make_spans(10, per_cell=5)[:5])
    monkeypatch.setattr(builtins, "open", full_open)
    with pytest.raises(OSError) as info:
        writer.flush()
    monkeypatch.setattr(builtins, "open", real_open)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "spans" / "000001.arrow")
    assert list((tmp_path / "spans").iterdir()) == []
