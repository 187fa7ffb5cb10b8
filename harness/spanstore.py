"""The span store: a run's spans as compressed columns (issue 48).

A run writes its spans to ``RUN_DIR/spans/``: one Arrow IPC file (zstd-compressed buffers) per
flushed batch, never holding more than one cell (arm x deploy x repeat), named by a sequence number
(``000001.arrow``, ...). Each file is written whole to a temporary file in that folder and renamed,
so a killed run leaves only whole files (a temporary ``.*.tmp`` is ignored by readers and removed by
``--resume``); the file order is the write order, and a file's rows are in write order.

The columns are the ``SpanRecord`` fields a span is built from; the event flags are not stored, they
are recomputed from (P, c, n, rows) as every reader of spans.jsonl has always done. ``export_jsonl``
writes each stored span through ``records.span_json``, so the export is byte for byte the
``spans.jsonl`` the run would have written before the store existed.

Runs written before the store keep their ``spans.jsonl``: every reader here reads it first (a run
resumed with this version may have both), then the store's files.

The store sits above ``harness.records`` (it imports the span records and file helpers from there,
which never imports this module back): a run's spans are read with ``read_spans`` here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from harness.records import (SPANS_FILE, SpanRecord, iter_jsonl_numbered, span_from_dict, span_json,
                             write_file_atomic)

SPANS_DIR = "spans"
SPAN_SUFFIX = ".arrow"
STORE_FORMAT = "arrow-ipc-zstd/1"  # the manifest's ``span_store``
# A batch is written once it holds this many spans even within a cell (memory stays bounded on a
# cell of thousands of requests); a cell's files are dropped together on --resume.
FLUSH_SPANS = 1 << 20
INT_FIELDS = ("repeat", "step", "P", "c", "n", "rows")
OPTIONAL_INT_FIELDS = ("misaligned_text", "misaligned_end", "misaligned")
STR_FIELDS = ("arm", "deploy", "request")
COLUMNS = STR_FIELDS + INT_FIELDS + OPTIONAL_INT_FIELDS + ("error",)
_INT32 = (-(1 << 31), (1 << 31) - 1)


def _pa() -> Any:
    import pyarrow as pa

    return pa


def spans_dir(run_dir: Path) -> Path:
    return Path(run_dir) / SPANS_DIR


def span_files(run_dir: Path) -> list[Path]:
    """The store's files in write order (temporary files of a killed write left out)."""
    folder = spans_dir(run_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.endswith(SPAN_SUFFIX) and not p.name.startswith("."))


def has_spans(run_dir: Path) -> bool:
    return (Path(run_dir) / SPANS_FILE).exists() or bool(span_files(run_dir))


# --------------------------------------------------------------------------- Arrow <-> numpy without pandas
# pyarrow imports pandas (about 0.3 s and 60 MB) on to_numpy(), on pa.array() of Python or numpy values and
# on a Python scalar argument: the readers go through the buffers instead (``report`` and ``gate`` stay
# without pandas, tests/test_lazy_imports.py).

_NP_INTS = {8: "int8", 16: "int16", 32: "int32", 64: "int64"}


def np_ints(array: Any) -> Any:
    """An integer column (an Array or ChunkedArray) as a numpy array; null slots read as 0."""
    import numpy as np

    pa = _pa()
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    kind = array.type
    if not pa.types.is_integer(kind):
        raise TypeError(f"expected integers, got {kind}")
    dtype = np.dtype(("u" if pa.types.is_unsigned_integer(kind) else "") + _NP_INTS[kind.bit_width])
    data = array.buffers()[1]
    values = np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize) \
        if data is not None and len(array) else np.zeros(len(array), dtype=dtype)
    if array.null_count:
        values = np.where(np_nulls(array), 0, values)
    return values


def np_nulls(array: Any) -> Any:
    """Which slots of a column are null (a numpy bool array)."""
    import numpy as np

    pa = _pa()
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    if not array.null_count:
        return np.zeros(len(array), dtype=bool)
    bits = np.frombuffer(array.buffers()[0], dtype=np.uint8)
    return ~np.unpackbits(bits, bitorder="little")[array.offset:array.offset + len(array)].astype(bool)


def arrow_ints(values: Any) -> Any:
    """A numpy int64 array as an Arrow array (its buffer, no copy)."""
    import numpy as np

    pa = _pa()
    values = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])


# --------------------------------------------------------------------------- writing


def _int_array(values: list[Any], nullable: bool = False) -> Any:
    pa = _pa()
    present = [v for v in values if v is not None] if nullable else values
    small = not present or (_INT32[0] <= min(present) and max(present) <= _INT32[1])
    return pa.array(values, pa.int32() if small else pa.int64())


def spans_table(spans: list[SpanRecord]) -> Any:
    """The spans as one Arrow table (strings dictionary-encoded, integers int32 where they fit)."""
    pa = _pa()
    from operator import attrgetter

    cols: dict[str, Any] = {}
    for name in STR_FIELDS:
        cols[name] = pa.array(list(map(attrgetter(name), spans)), pa.string()).dictionary_encode()
    for name in INT_FIELDS:
        cols[name] = _int_array(list(map(attrgetter(name), spans)))
    for name in OPTIONAL_INT_FIELDS:
        cols[name] = _int_array(list(map(attrgetter(name), spans)), nullable=True)
    cols["error"] = pa.array(list(map(attrgetter("error"), spans)), pa.string())
    return pa.table(cols)


def write_span_file(path: Path, spans: list[SpanRecord]) -> None:
    """One file of the store, whole or not at all (temporary file, then rename)."""
    pa = _pa()
    table = spans_table(spans)
    first = spans[0]
    table = table.replace_schema_metadata({"arm": first.arm, "deploy": first.deploy, "repeat": str(first.repeat)})
    sink = pa.BufferOutputStream()  # built in memory, written by Python: a full disk is an OSError with its errno
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    data = sink.getvalue()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            with open(fd, "wb") as fh:
                fh.write(memoryview(data))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:  # name the store's file (rundir.disk_full_error says it), not the temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from None


class SpanStoreWriter:
    """Collects spans and writes them as whole files: ``flush`` writes what is held (at most one cell
    per file); the pipeline flushes before it writes any request record, so a record on disk always
    has its spans on disk (as when spans.jsonl was appended before the records)."""

    def __init__(self, run_dir: Path) -> None:
        self.folder = spans_dir(run_dir)
        if self.folder.is_symlink() or (self.folder.exists() and not self.folder.is_dir()):
            raise OSError(f"{self.folder}: not a folder")
        self.folder.mkdir(exist_ok=True)
        for stale in self.folder.glob(".*.tmp"):  # a write a kill cut short
            stale.unlink(missing_ok=True)
        existing = span_files(run_dir)
        self.seq = max((int(p.stem) for p in existing if p.stem.isdigit()), default=0)
        self.held: list[SpanRecord] = []
        self.files_written = 0

    def write_many(self, spans: Iterable[SpanRecord]) -> None:
        for span in spans:
            if self.held and (span.arm, span.deploy, span.repeat) != (self.held[-1].arm, self.held[-1].deploy,
                                                                      self.held[-1].repeat):
                self.flush()
            self.held.append(span)
            if len(self.held) >= FLUSH_SPANS:
                self.flush()

    def flush(self) -> None:
        if not self.held:
            return
        self.seq += 1
        write_span_file(self.folder / f"{self.seq:06d}{SPAN_SUFFIX}", self.held)
        self.files_written += 1
        self.held = []

    def close(self) -> None:
        self.flush()


# --------------------------------------------------------------------------- reading


def read_span_file(path: Path) -> Any:
    """One store file as an Arrow table; a file that is not one is a ValueError naming it."""
    pa = _pa()
    try:
        # threads only for a large file: on a cell's file of some 20,000 spans they cost more than they gain
        options = pa.ipc.IpcReadOptions(use_threads=os.path.getsize(path) > 1 << 22)
        # the bytes, not pa.memory_map(str(path)): a run directory's path need not be UTF-8
        table = pa.ipc.open_file(pa.py_buffer(Path(path).read_bytes()), options=options).read_all()
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable span file ({str(exc).splitlines()[0] if str(exc) else exc})") \
            from None
    names = set(table.column_names)
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{path}: not a span file of this version (missing column{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(missing)})")
    for name in INT_FIELDS + OPTIONAL_INT_FIELDS:
        if not pa.types.is_integer(table.schema.field(name).type):
            raise ValueError(f"{path}: column {name}: expected integers, got {table.schema.field(name).type}")
    for name in INT_FIELDS + STR_FIELDS:
        if table.column(name).null_count:
            raise ValueError(f"{path}: column {name}: has nulls")
    return table


def file_cell(path: Path) -> tuple[str, str, int] | None:
    """The (arm, deploy, repeat) a store file holds, from its metadata (None when it has none)."""
    pa = _pa()
    try:
        with open(path, "rb") as source:  # the footer only
            meta = pa.ipc.open_file(source).schema.metadata or {}
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable span file ({exc})") from None
    try:
        return meta[b"arm"].decode(), meta[b"deploy"].decode(), int(meta[b"repeat"])
    except (KeyError, ValueError):
        return None


def _pylist_rows(table: Any) -> Iterator[dict[str, Any]]:
    cols = {name: table.column(name).to_pylist() for name in COLUMNS}
    for i in range(table.num_rows):
        yield {name: cols[name][i] for name in COLUMNS}


def iter_span_dicts(run_dir: Path, store: bool = True) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """(file, line or row number, the span's fields) of every span, spans.jsonl first, in write order."""
    legacy = Path(run_dir) / SPANS_FILE
    for number, data in iter_jsonl_numbered(legacy):
        yield legacy, number, data
    for path in span_files(run_dir) if store else ():
        for i, data in enumerate(_pylist_rows(read_span_file(path))):
            yield path, i + 1, data


def read_spans(run_dir: Path, store: bool = True) -> list[SpanRecord]:
    """Every complete span of a run (spans.jsonl, then the store); one that is malformed is a ValueError
    naming the file and the line (spans.jsonl) or row (a store file)."""
    spans = []
    for path, number, data in iter_span_dicts(run_dir, store):
        try:
            if not isinstance(data, dict):
                raise TypeError(f"expected a span record (a JSON object), got {type(data).__name__}")
            spans.append(span_from_dict(data))
        except (TypeError, ValueError, KeyError) as exc:
            where = "line" if path.name == SPANS_FILE else "row"
            raise ValueError(f"{path}: {where} {number}: malformed span ({exc})") from None
    return spans


def read_spans_jsonl(run_dir: Path) -> list[SpanRecord]:
    """An old run's spans.jsonl alone (``read_spans`` without the store)."""
    legacy = Path(run_dir) / SPANS_FILE
    return read_spans(run_dir, store=False) if legacy.exists() else []


def span_cells(run_dir: Path) -> set[tuple[str, str, int]]:
    """The cells that have spans written (spans.jsonl's and the store's)."""
    cells: set[tuple[str, str, int]] = set()
    if (Path(run_dir) / SPANS_FILE).exists():  # an old run's: every line checked, as it always was
        cells.update((s.arm, s.deploy, s.repeat) for s in read_spans_jsonl(run_dir))
    for path in span_files(run_dir):
        cell = file_cell(path)
        if cell is None:
            table = read_span_file(path)
            cells.update(zip(table.column("arm").to_pylist(), table.column("deploy").to_pylist(),
                             table.column("repeat").to_pylist()))
        else:
            cells.add(cell)
    return cells


def drop_cells(run_dir: Path, cells: set[tuple[str, str, int]]) -> None:
    """Removes every span of ``cells`` (a ``--resume`` runs those cells again): the store's files of
    those cells, and their lines of an old run's spans.jsonl."""
    import json

    legacy = Path(run_dir) / SPANS_FILE
    if legacy.exists():
        keep = [line for line in legacy.read_text(encoding="utf-8").splitlines(keepends=True)
                if line.strip() and _cell_of(json.loads(line)) not in cells]
        write_file_atomic(legacy, "".join(keep))
    for path in span_files(run_dir):
        cell = file_cell(path)
        if cell is None:
            table = read_span_file(path)
            held = set(zip(table.column("arm").to_pylist(), table.column("deploy").to_pylist(),
                           table.column("repeat").to_pylist()))
            if held & cells and not held <= cells:
                raise ValueError(f"{path}: holds spans of more than one cell; cannot drop a cell of it")
            cell = next(iter(held), None)
        if cell in cells:
            path.unlink()


def _cell_of(span: dict[str, Any]) -> tuple:
    return (span["arm"], span["deploy"], span["repeat"])


# --------------------------------------------------------------------------- export


def export_lines(run_dir: Path) -> Iterator[str]:
    """Every span as its spans.jsonl line (``span_json`` + newline), in write order: an old run's
    spans.jsonl lines as they are (its torn last line dropped), then the store's spans."""
    legacy = Path(run_dir) / SPANS_FILE
    if legacy.exists():
        data = legacy.read_bytes()
        if not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]
        if data:
            yield data.decode("utf-8")
    for path in span_files(run_dir):
        table = read_span_file(path)
        cols = {name: table.column(name).to_pylist() for name in COLUMNS}
        chunk = []
        for i in range(table.num_rows):
            span = SpanRecord(cols["arm"][i], cols["deploy"][i], cols["repeat"][i], cols["request"][i],
                              cols["step"][i], cols["P"][i], cols["c"][i], cols["n"][i], cols["rows"][i],
                              cols["misaligned_text"][i], cols["misaligned_end"][i], cols["misaligned"][i],
                              cols["error"][i])
            chunk.append(span_json(span) + "\n")
            if len(chunk) >= 65536:
                yield "".join(chunk)
                chunk = []
        if chunk:
            yield "".join(chunk)


def export_jsonl(run_dir: Path, out: Any) -> int:
    """Writes the run's spans as JSON lines to the binary file ``out``; returns the bytes written."""
    total = 0
    for text in export_lines(run_dir):
        raw = text.encode("utf-8")
        out.write(raw)
        total += len(raw)
    return total


def store_bytes(run_dir: Path) -> int:
    """Bytes the run's spans take on disk (spans.jsonl and the store)."""
    legacy = Path(run_dir) / SPANS_FILE
    return (legacy.stat().st_size if legacy.exists() else 0) + sum(p.stat().st_size for p in span_files(run_dir))
