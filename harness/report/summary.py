"""A run directory, loaded once, and what every consumer says about its cells.

``load_run`` reads ``manifest.json``, ``requests.jsonl`` and ``spans.jsonl`` (spans as numpy
columns, ``SpanTable``); ``summarize_cells`` turns a ``Run`` into one ``CellSummary`` per arm x
deploy x repeat; ``run_problems`` says why a run is not complete. ``report`` (tables), ``plots``
and ``gate`` all import these, so the numbers the gate judges are the numbers the tables show.

Event counts come from ``spans.jsonl`` whenever the cell has spans (the definitive per-call
trace), else from the per-request ``events`` the backend summed; events are counted with numpy
from the same predicate table as the contract (``harness.contract.EVENTS``).

The per-cell look-ups of the paired table and the gate (``reference_cell``, ``repeat_group``,
``worst_of_repeats``) go through one index per cell list (``_CellIndex``): scanning every cell for
every cell made ``report`` grow faster than linear with cells (issue 48).
"""

from __future__ import annotations

import fnmatch
import hashlib

import json
import operator
import statistics
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from functools import cached_property
from itertools import repeat as _repeat
from pathlib import Path
from typing import Any

import numpy as np

from harness.backends import is_simulated
from harness.contract import MISALIGNED_COUNTS, classify_spans, event_count_columns
from harness.config import ConfigError, StreamingSlo, parse_slo
from harness.errors import UserError
from harness.metrics import RECORD_COUNTS
from harness.roles import DEPLOY_ROLES, deploy_role
from harness.records import (
    CRASHED_ERROR,
    MANIFEST_FILE,
    REQUESTS_FILE,
    SPANS_FILE,
    EventCounts,
    RequestRecord,
    SpanRecord,
    iter_jsonl_numbered,
    read_manifest,
    read_requests,
    span_from_dict,
)
from harness.spanstore import span_files

WER_THRESHOLD = 0.5
CellKey = tuple[str, str, int]  # (arm, deploy, repeat)
ROLES = ("baseline", "candidate")
DEFAULT_ROLE = "candidate"


# --------------------------------------------------------------------------- loading


SpanKey = tuple[str, str, int, str]  # (arm, deploy, repeat, request)

_SPAN_STR_FIELDS = ("arm", "deploy", "request")
_SPAN_INT_FIELDS = ("repeat", "step", "P", "c", "n", "rows")
class SpanTable:
    """``spans.jsonl`` as columns: what the report reads of 65k spans, without 65k objects.
    (``StoredSpanTable``: the span store's files, read the same way by column.)

    Iterating yields ``SpanRecord`` objects (built on demand, for the few spans a plot draws or for
    callers that want records); ``group_events`` is what the tables count.
    """

    def __init__(self, raw: list[dict[str, Any]] | None = None, path: Path | None = None,
                 lines: list[int] | None = None) -> None:
        """``raw``: one dict per span as in spans.jsonl; ``lines``: their line numbers (for errors)."""
        self.raw = raw or []
        self.path = path
        self.source = SPANS_FILE
        where = str(path) if path is not None else SPANS_FILE
        line_of = (lambda i: lines[i]) if lines is not None else (lambda i: i + 1)
        cols: dict[str, Any] = {}
        # Columns are pulled and type-checked by C-level map/set over the 65k records; the
        # per-record search for the offending line runs only when a check fails.
        if not set(map(type, self.raw)) <= {dict}:
            for i, rec in enumerate(self.raw):
                if type(rec) is not dict:
                    raise UserError(f"{where}: line {line_of(i)}: malformed record (expected a JSON object)")
        for name in _SPAN_STR_FIELDS + _SPAN_INT_FIELDS:
            values = list(map(dict.get, self.raw, _repeat(name)))
            kind = str if name in _SPAN_STR_FIELDS else int
            bad = None if set(map(type, values)) <= {kind} else \
                next((i for i, v in enumerate(values) if type(v) is not kind), None)
            if bad is not None:
                got = "missing" if name not in self.raw[bad] else f"got {values[bad]!r}"
                expected = "a string" if kind is str else "an integer"
                raise UserError(f"{where}: line {line_of(bad)}: malformed record ({name}: expected {expected}, {got})")
            cols[name] = values if kind is str else np.array(values, dtype=np.int64)
        region_cols = {}
        for name in ("misaligned", "misaligned_text", "misaligned_end"):
            values = list(map(dict.get, self.raw, _repeat(name)))
            bad = None if set(map(type, values)) <= {int, type(None)} else \
                next((i for i, v in enumerate(values) if v is not None and type(v) is not int), None)
            if bad is not None:
                raise UserError(f"{where}: line {line_of(bad)}: malformed record "
                                f"({name}: expected an integer or null, got {values[bad]!r})")
            region_cols[name] = values
        total, text, end = region_cols["misaligned"], region_cols["misaligned_text"], region_cols["misaligned_end"]
        split = [t is not None or e is not None for t, e in zip(text, end)]
        cols["misaligned_known"] = np.array([s or m is not None for s, m in zip(split, total)], dtype=bool)
        # A record written before the split (``misaligned`` alone) counts in the text region: the
        # conservative reading, since only the text region can change what the Talker says.
        cols["misaligned_text"] = np.array([(t or 0) if s else (m or 0) for s, t, m in zip(split, text, total)],
                                           dtype=np.int64)
        cols["misaligned_end"] = np.array([(e or 0) if s else 0 for s, e in zip(split, end)], dtype=np.int64)
        cols["misaligned"] = cols["misaligned_text"] + cols["misaligned_end"]
        P, c, n = cols["P"], cols["c"], cols["n"]
        invalid = np.flatnonzero((P < 0) | (c < 0) | (n < 1))
        if invalid.size:
            i = int(invalid[0])
            raise UserError(f"{where}: line {line_of(i)}: invalid span P={P[i]} c={c[i]} n={n[i]}")
        self.columns = cols

    @classmethod
    def from_records(cls, spans: Iterable[SpanRecord]) -> SpanTable:
        return cls([asdict(s) for s in spans])

    def __len__(self) -> int:
        return len(self.raw)

    def __iter__(self) -> Iterator[SpanRecord]:
        return (span_from_dict(d) for d in self.raw)

    def records(self, indices: Iterable[int]) -> list[SpanRecord]:
        return [span_from_dict(self.raw[int(i)]) for i in indices]

    def subset(self, keys: Iterable[SpanKey]) -> SpanTable:
        """The spans of the requests ``keys`` (file order), as a table of their own (a plot's request)."""
        wanted = set(keys)
        return SpanTable([d for d in self.raw if (d["arm"], d["deploy"], d["repeat"], d["request"]) in wanted],
                         path=self.path)

    @cached_property
    def flags(self) -> dict[str, np.ndarray]:
        c = self.columns
        return classify_spans(c["P"], c["c"], c["n"], c["rows"])

    @cached_property
    def group_codes(self) -> tuple[list[SpanKey], np.ndarray]:
        """(keys, code of each span): one group per (arm, deploy, repeat, request), in first-seen order."""
        index: dict[SpanKey, int] = {}
        c = self.columns
        codes = [index.setdefault(k, len(index))
                 for k in zip(c["arm"], c["deploy"], c["repeat"].tolist(), c["request"])]
        return list(index), np.array(codes, dtype=np.int64)

    def group_sums(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per-group sums of each column (bincount over the group codes)."""
        keys, codes = self.group_codes
        return {name: np.bincount(codes, weights=v, minlength=len(keys)).astype(np.int64)
                for name, v in values.items()}

    @cached_property
    def group_events(self) -> dict[SpanKey, tuple[EventCounts, bool]]:
        """{(arm, deploy, repeat, request): (EventCounts of its spans, any span's misaligned known)}.

        Equals ``harness.contract.count_events`` over each group's spans (tested).
        """
        keys, _ = self.group_codes
        columns = event_count_columns(self.flags, len(self))
        columns.update({name: self.columns[attr] for name, attr in MISALIGNED_COUNTS.items()})
        columns["misaligned_known"] = self.columns["misaligned_known"]
        sums = self.group_sums(columns)
        out = {}
        for g, key in enumerate(keys):
            counts = EventCounts(**{name: int(v[g]) for name, v in sums.items() if name != "misaligned_known"})
            out[key] = (counts, bool(sums["misaligned_known"][g]))
        return out


class StoredSpanTable(SpanTable):
    """The span store's files (``harness.spanstore``) as a ``SpanTable`` read by column, one file at a
    time: ``group_events`` (what the tables, the gate and compare count) is summed file by file, so
    a run of 10,000 requests (about 11 million spans) never holds more than one file's columns; the
    full columns (``columns``, ``flags``, ``group_codes``, ``raw``) are built only when asked for (the
    sweep's schedules of a run without digests, ``fidelity``).

    ``raw``, iteration and ``records`` give each span's fields as stored, except ``error`` (None) and a
    region count stored as null next to a known one (0): nothing that reads a ``SpanTable`` uses them.
    """

    source = "spans/"  # the span store, as messages name it

    def __init__(self, files: list[Path]) -> None:  # noqa: D107 - no SpanTable.__init__: nothing is read yet
        self.files = list(files)
        self.path = self.files[0].parent if self.files else None
        self._length: int | None = None

    # ----- one file's columns
    @staticmethod
    def _file(path: Path) -> tuple[dict[str, np.ndarray], list[SpanKey], np.ndarray]:
        """(columns, keys in first-seen order, each row's key code) of one store file."""
        import pyarrow as pa

        from harness.spanstore import arrow_ints, np_ints, np_nulls, read_span_file

        try:
            table = read_span_file(path)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        cols: dict[str, np.ndarray] = {}
        for name in ("step", "P", "c", "n", "rows"):
            cols[name] = np_ints(table.column(name))
        nulls = {}
        for name in ("misaligned_text", "misaligned_end", "misaligned"):
            nulls[name] = np_nulls(table.column(name))
            cols[name] = np_ints(table.column(name))
        split = ~nulls["misaligned_text"] | ~nulls["misaligned_end"]
        cols["misaligned_known"] = split | ~nulls["misaligned"]
        if not split.all():  # a span written with ``misaligned`` alone counts in the text region
            cols["misaligned_text"] = np.where(split, cols["misaligned_text"], cols["misaligned"])
            cols["misaligned_end"] = np.where(split, cols["misaligned_end"], 0)
        del cols["misaligned"]  # text + end, summed per group where counted
        P, c, n = cols["P"], cols["c"], cols["n"]
        invalid = np.flatnonzero((P < 0) | (c < 0) | (n < 1))
        if invalid.size:
            i = int(invalid[0])
            raise UserError(f"{path}: row {i + 1}: invalid span P={P[i]} c={c[i]} n={n[i]}")
        parts = []
        for name in ("arm", "deploy", "repeat", "request"):
            col = table.column(name)
            col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
            if not pa.types.is_dictionary(col.type):
                col = col.dictionary_encode()
            parts.append((np_ints(col.indices).astype(np.int64), col.dictionary.to_pylist()))
        combo = np.zeros(table.num_rows, dtype=np.int64)
        for indices, values in parts:
            combo = combo * max(len(values), 1) + indices
        encoded = arrow_ints(combo).dictionary_encode()  # first-seen order, by hash
        keys = []
        for value in np_ints(encoded.dictionary).tolist():
            fields = []
            for _indices, values in reversed(parts):
                value, i = divmod(value, max(len(values), 1))
                fields.append(values[i])
            keys.append(tuple(reversed(fields)))
        return cols, keys, np_ints(encoded.indices)

    def _each(self) -> Iterator[tuple[dict[str, np.ndarray], list[SpanKey], np.ndarray]]:
        for path in self.files:
            yield self._file(path)

    def __len__(self) -> int:
        if self._length is None:
            from harness.spanstore import read_span_file

            total = 0
            for path in self.files:
                try:
                    total += read_span_file(path).num_rows
                except ValueError as exc:
                    raise UserError(str(exc)) from None
            self._length = total
        return self._length

    BATCH_ROWS = 1 << 20  # files are counted together up to this many spans (numpy's per-call cost)

    @cached_property
    def group_events(self) -> dict[SpanKey, tuple[EventCounts, bool]]:
        """Summed file by file; with more than one file, the later half of the files is counted in a
        forked child while this process counts the first (``harness.proc.fork_call``; about a third of
        ``report`` on 10,000 requests, issue 48), then merged in file order, so the groups come out in
        first-seen order exactly as one pass gives them. Where a fork is not safe, or the child fails
        (a bad file: its error is raised here), this process counts the rest itself."""
        import pickle

        from harness.proc import fork_call

        half = (len(self.files) + 1) // 2
        child = fork_call(lambda: pickle.dumps(self._count(self.files[half:]))) if len(self.files) > 1 else None
        try:
            groups, length = self._count(self.files[:half] if child is not None else self.files)
            if child is not None:
                drawn, data = child.result()
                rest, more = pickle.loads(data) if drawn and data else self._count(self.files[half:])
                for key, (sums, known) in rest.items():
                    if key in groups:
                        old, was = groups[key]
                        groups[key] = ({k: v + sums[k] for k, v in old.items()}, was or known)
                    else:
                        groups[key] = (sums, known)
                length += more
        finally:
            if child is not None:
                child.close()
        self._length = length
        return {key: (EventCounts(**sums), known) for key, (sums, known) in groups.items()}

    def _count(self, files: list[Path]) -> tuple[dict[SpanKey, tuple[dict[str, int], bool]], int]:
        """({group: ({EventCounts field: sum}, misaligned known)} in first-seen order, spans) of ``files``."""
        index: dict[SpanKey, int] = {}
        totals: dict[str, np.ndarray] = {}
        batch: list[tuple[dict[str, np.ndarray], np.ndarray]] = []
        length = 0

        def count() -> None:
            if not batch:
                return
            cols = {name: np.concatenate([c[name] for c, _ in batch]) for name in batch[0][0]}
            codes = np.concatenate([g for _, g in batch])
            batch.clear()
            flags = classify_spans(cols["P"], cols["c"], cols["n"], cols["rows"])
            columns = event_count_columns(flags, len(codes))
            columns.update({name: cols[attr] for name, attr in MISALIGNED_COUNTS.items() if attr in cols})
            columns["misaligned_known"] = cols["misaligned_known"]
            for name, v in columns.items():
                sums = np.bincount(codes, weights=v, minlength=len(index)).astype(np.int64)
                old = totals.get(name)
                if old is not None:
                    sums[: len(old)] += old
                totals[name] = sums

        rows = 0
        for path in files:
            cols, keys, codes = self._file(path)
            where = np.array([index.setdefault(k, len(index)) for k in keys], dtype=np.int64)
            batch.append((cols, where[codes] if len(codes) else np.zeros(0, dtype=np.int64)))
            rows += len(codes)
            length += len(codes)
            if rows >= self.BATCH_ROWS:
                count()
                rows = 0
        count()
        if not totals:
            return {}, length
        total_name = next(name for name, attr in MISALIGNED_COUNTS.items() if attr == "misaligned")
        totals[total_name] = sum(totals[name] for name, attr in MISALIGNED_COUNTS.items() if attr != "misaligned")
        out = {}
        for g, key in enumerate(index):
            sums = {name: int(v[g]) for name, v in totals.items() if name != "misaligned_known"}
            out[key] = (sums, bool(totals["misaligned_known"][g]))
        return out, length

    @cached_property
    def _all(self) -> tuple[dict[str, np.ndarray], list[SpanKey], np.ndarray]:
        """Every file's columns concatenated, one key table (built on demand)."""
        index: dict[SpanKey, int] = {}
        cols_parts: list[dict[str, np.ndarray]] = []
        code_parts = []
        for cols, keys, codes in self._each():
            where = np.array([index.setdefault(k, len(index)) for k in keys], dtype=np.int64)
            cols_parts.append(cols)
            code_parts.append(where[codes] if len(codes) else np.zeros(0, dtype=np.int64))
        names = ("step", "P", "c", "n", "rows", "misaligned_text", "misaligned_end", "misaligned_known")
        cols = {name: np.concatenate([p[name] for p in cols_parts]) if cols_parts else
                np.zeros(0, dtype=bool if name == "misaligned_known" else np.int64) for name in names}
        cols["misaligned"] = cols["misaligned_text"] + cols["misaligned_end"]
        keys = list(index)
        codes = np.concatenate(code_parts) if code_parts else np.zeros(0, dtype=np.int64)
        cols["repeat"] = np.array([k[2] for k in keys], dtype=np.int64)[codes] if keys else np.zeros(0, np.int64)
        return cols, keys, codes

    @cached_property
    def columns(self) -> dict[str, Any]:  # type: ignore[override]
        return self._all[0]

    @cached_property
    def group_codes(self) -> tuple[list[SpanKey], np.ndarray]:
        _cols, keys, codes = self._all
        return keys, codes

    @cached_property
    def raw(self) -> list[dict[str, Any]]:  # type: ignore[override]
        cols, keys, codes = self._all
        known, text, end = cols["misaligned_known"], cols["misaligned_text"], cols["misaligned_end"]
        out = []
        lists = {name: cols[name].tolist() for name in ("step", "P", "c", "n", "rows")}
        for i, code in enumerate(codes.tolist()):
            arm, deploy, repeat, request = keys[code]
            m = int(text[i]) if known[i] else None
            e = int(end[i]) if known[i] else None
            out.append({"arm": arm, "deploy": deploy, "repeat": repeat, "request": request,
                        **{name: values[i] for name, values in lists.items()},
                        "misaligned_text": m, "misaligned_end": e, "error": None})
        return out

    def subset(self, keys: Iterable[SpanKey]) -> SpanTable:
        """Reads only the files of the keys' cells (a file's metadata names its cell), and of those only
        the keys' rows become dicts."""
        import pyarrow as pa

        from harness.spanstore import COLUMNS, arrow_ints, file_cell, np_ints, read_span_file

        wanted = set(keys)
        cells = {k[:3] for k in wanted}
        raw = []
        for path in self.files:
            try:
                cell = file_cell(path)
                if cell is not None and cell not in cells:
                    continue
                table = read_span_file(path)
            except ValueError as exc:
                raise UserError(str(exc)) from None
            mask = np.ones(table.num_rows, dtype=bool)
            for pos, name in enumerate(("arm", "deploy", "repeat", "request")):
                col = table.column(name)
                col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
                values = {k[pos] for k in wanted}
                if pa.types.is_dictionary(col.type):
                    hits = [i for i, v in enumerate(col.dictionary.to_pylist()) if v in values]
                    mask &= np.isin(np_ints(col.indices), hits)
                else:
                    mask &= np.isin(np_ints(col), list(values))
            if not mask.any():
                continue
            rows = table.take(arrow_ints(np.flatnonzero(mask)))
            cols = {name: rows.column(name).to_pylist() for name in COLUMNS}
            raw += [d for d in ({name: cols[name][i] for name in COLUMNS} for i in range(rows.num_rows))
                    if (d["arm"], d["deploy"], d["repeat"], d["request"]) in wanted]
        return SpanTable(raw, path=self.path)


@dataclass
class Run:
    """A run directory's records, read once (``spans`` as columns, see ``SpanTable``)."""

    run_dir: Path
    manifest: dict[str, Any]
    requests: list[RequestRecord]
    spans: SpanTable = field(default_factory=SpanTable)
    torn: tuple[str, ...] = ()  # record files whose last line was cut off mid-write (dropped on read)
    # sha256 of the manifest, requests and spans bytes ``load_run`` read (None: a Run built by hand);
    # the plots reuse their PNGs when it and the code that draws them are unchanged (plots.render_all)
    digest: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.spans, SpanTable):  # a list of SpanRecord, for a Run built by hand
            self.spans = SpanTable.from_records(self.spans)

    @property
    def run_id(self) -> str:
        return str(self.manifest.get("run_id") or self.run_dir.name)

    @property
    def roles(self) -> dict[str, str]:
        """{arm: role} from the manifest's ``arms`` list (written from arms.yaml); an arm without a
        role, or a run written before roles, is a ``candidate``."""
        out = {}
        for arm in self.manifest.get("arms") or []:
            if isinstance(arm, dict) and isinstance(arm.get("name"), str):
                out[arm["name"]] = arm.get("role") or DEFAULT_ROLE
        return out

    def deploy_role(self, deploy: str) -> tuple[str, str | None]:
        """(role, pair) of a deploy of this run: as the manifest's ``deploy_roles`` records them, or for a
        run recorded before roles, as ``harness.roles.deploy_role`` infers them from the name."""
        recorded = self.manifest.get("deploy_roles")
        entry = recorded.get(deploy) if isinstance(recorded, dict) else None
        if isinstance(entry, dict) and entry.get("role") in DEPLOY_ROLES:
            pair = entry.get("pair")
            return str(entry["role"]), pair if isinstance(pair, str) and entry["role"] == "stress" else None
        return deploy_role(deploy)

    def deploy_slo(self, deploy: str) -> StreamingSlo | None:
        """The streaming SLO the deploy declared (``slo:``), as the manifest's ``deploy_slos`` recorded it."""
        recorded = self.manifest.get("deploy_slos")
        entry = recorded.get(deploy) if isinstance(recorded, dict) else None
        if not isinstance(entry, dict):
            return None
        try:
            return parse_slo(entry, f"{self.run_dir / 'manifest.json'}: deploy_slos.{deploy}")
        except ConfigError as exc:
            raise UserError(str(exc)) from None


def load_run(run_dir: Path, codec_tokens: bool = True) -> Run:
    """Reads manifest, requests and spans; any problem is one UserError naming the file.

    ``codec_tokens=False`` (``report``, ``gate``: nothing they show reads the tokens) leaves every
    record's ``codec_tokens`` empty: at 10,000 requests the tokens are most of requests.jsonl and
    about 10 million Python ints (issue 48)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: run directory not found")
    from harness.rundir import check_run_files  # local: rundir imports config

    check_run_files(run_dir)
    if not (run_dir / MANIFEST_FILE).is_file():
        raise UserError(f"{run_dir}: no {MANIFEST_FILE} (not a run directory?)")
    try:
        manifest = read_manifest(run_dir)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{run_dir / MANIFEST_FILE}: not valid JSON ({exc})") from None
    _validate_manifest(manifest, run_dir / MANIFEST_FILE)
    if not (run_dir / REQUESTS_FILE).is_file():
        raise UserError(f"{run_dir}: no {REQUESTS_FILE} (the run recorded no request)")
    requests_bytes = (run_dir / REQUESTS_FILE).read_bytes()  # read once: parsed and hashed
    requests = _read_records(run_dir, REQUESTS_FILE,
                             lambda d: read_requests(d, codec_tokens=codec_tokens, raw=requests_bytes))
    spans_path = run_dir / SPANS_FILE
    spans_bytes = spans_path.read_bytes() if spans_path.exists() else None
    raw, lines = _read_jsonl_fast(spans_path, spans_bytes)
    torn = tuple(name for name in (REQUESTS_FILE, SPANS_FILE) if _torn_tail(run_dir / name))
    digest = hashlib.sha256()
    for part in ((run_dir / MANIFEST_FILE).read_bytes(), requests_bytes, spans_bytes or b""):
        digest.update(hashlib.sha256(part).digest())
    files = span_files(run_dir)
    for path in files:  # the span store: compressed, a few hundred KB per thousand requests
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    spans: SpanTable
    if files and spans_bytes is None:
        spans = StoredSpanTable(files)
    elif files:  # an old run resumed by this version: its spans.jsonl, then the store's spans
        stored = StoredSpanTable(files)
        spans = SpanTable(list(raw) + [dict(d) for d in _store_dicts(files)], path=spans_path,
                          lines=None if lines is None else lines + list(range(len(lines) + 1, len(lines) + 1 + len(stored))))
    else:
        spans = SpanTable(raw, path=spans_path, lines=lines)
    return Run(run_dir=run_dir, manifest=manifest, requests=requests, spans=spans, torn=torn,
               digest=digest.hexdigest())


def _store_dicts(files: list[Path]) -> Iterator[dict[str, Any]]:
    from harness.spanstore import read_span_file, COLUMNS

    for path in files:
        try:
            table = read_span_file(path)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        cols = {name: table.column(name).to_pylist() for name in COLUMNS}
        for i in range(table.num_rows):
            yield {name: cols[name][i] for name in COLUMNS}


def _torn_tail(path: Path) -> bool:
    """The file's last line has no newline: a write was cut off (the reader drops that line)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            if fh.tell() == 0:
                return False
            fh.seek(-1, 2)
            return fh.read(1) != b"\n"
    except FileNotFoundError:
        return False


def _read_jsonl_fast(path: Path, raw: bytes | None = None) -> tuple[list[Any], list[int] | None]:
    """(objects, their line numbers or None when line i+1 holds object i); same result as
    ``records.iter_jsonl`` (torn last line dropped, a broken line in the middle an error).

    The whole file is parsed as one JSON array (one ``json.loads`` call instead of 65k); any
    doubt (a torn tail, a blank line, a line that is not exactly one value) falls back to the
    line-by-line reader, which also names the broken line.
    """
    if raw is None:
        if not path.exists():
            return [], None
        raw = path.read_bytes()
    data = _decode_jsonl_array(raw)
    if data is not None:
        return data, None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc})") from None
    body = text[:-1] if text.endswith("\n") else text
    if not body.strip():
        return [], None
    try:
        data = json.loads("[" + body.replace("\n", ",") + "]")
        if isinstance(data, list) and len(data) == body.count("\n") + 1:
            return data, None
    except json.JSONDecodeError:
        pass
    objects, lines = [], []
    try:
        for number, obj in iter_jsonl_numbered(path):
            objects.append(obj)
            lines.append(number)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return objects, lines


def _decode_jsonl_array(raw: bytes) -> list[Any] | None:
    """The objects of a complete JSON-lines file parsed as one array by msgspec (installed with
    vLLM; about twice as fast as ``json`` on a 25 MB spans.jsonl), or None for any doubt (no
    msgspec, a torn tail, a blank line, a line that is not exactly one value, input ``json`` would
    read and msgspec refuses, such as NaN): the caller then reads as before."""
    try:
        import msgspec
    except ImportError:
        return None
    if not raw.endswith(b"\n"):
        return None
    body = raw[:-1]
    if not body.strip():
        return None
    try:
        data = msgspec.json.decode(b"[" + body.replace(b"\n", b",") + b"]")
    except (msgspec.DecodeError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, list) and len(data) == body.count(b"\n") + 1 else None


def _read_records(run_dir: Path, name: str, reader: Any) -> list[Any]:
    try:
        return reader(run_dir)
    except ValueError as exc:  # iter_jsonl: a broken line that is not the torn tail
        raise UserError(str(exc)) from None
    except TypeError as exc:  # a record missing a required field
        raise UserError(f"{run_dir / name}: malformed record ({exc})") from None


def _validate_manifest(manifest: Any, path: Path) -> None:
    if not isinstance(manifest, dict):
        raise UserError(f"{path}: expected a JSON object")
    cells = manifest.get("cells")
    if not isinstance(cells, list):
        raise UserError(f"{path}: cells: expected a list of {{arm, deploy, repeat}}")
    for i, cell in enumerate(cells):
        if not isinstance(cell, dict) or not all(k in cell for k in ("arm", "deploy", "repeat")):
            raise UserError(f"{path}: cells[{i}]: expected an object with arm, deploy and repeat")
        if isinstance(cell["repeat"], bool) or not isinstance(cell["repeat"], int):
            raise UserError(f"{path}: cells[{i}].repeat: expected an integer, got {cell['repeat']!r}")
    arms = manifest.get("arms")
    if arms is not None and not isinstance(arms, list):
        raise UserError(f"{path}: arms: expected a list of {{name, talker, role}}")
    for i, arm in enumerate(arms or []):
        if not isinstance(arm, dict) or not isinstance(arm.get("name"), str):
            raise UserError(f"{path}: arms[{i}]: expected an object with a name")
        role = arm.get("role")
        if role is not None and role not in ROLES:
            raise UserError(f"{path}: arms[{i}].role: expected {' or '.join(ROLES)}, got {role!r}")
    prompt_ids = manifest.get("prompt_ids")
    if prompt_ids is not None and (not isinstance(prompt_ids, list) or not all(isinstance(p, str) for p in prompt_ids)):
        raise UserError(f"{path}: prompt_ids: expected a list of prompt ids")


# --------------------------------------------------------------------------- cells


@dataclass
class CellSummary:
    """Everything the tables and the gate say about one arm x deploy x repeat."""

    arm: str
    deploy: str
    repeat: int
    requests: int
    scores: list[float]  # RequestRecord.score of each scored request
    oracle_scores: list[float]
    events: EventCounts
    event_source: str  # "spans" or "requests"
    misaligned_known: bool
    preemptions: int
    errors: int
    wall_s: float
    wer_source: str  # key of WER_SOURCE_TEXT
    run_number: int  # the repeat as the tables show it ("run 1")
    accepted: list[float] = field(default_factory=list)  # accepted_tokens_per_step of each request that has it
    role: str = DEFAULT_ROLE  # the arm's role, from the run's manifest (ROLES)
    # the deploy's role (harness.roles: reference or stress) and, for a stress deploy, its reference
    # deploy (the paired table and the gate's pairing); "" (a cell built by hand): inferred from the name
    deploy_role: str = ""
    pair: str | None = None
    records: list[RequestRecord] = field(default_factory=list, repr=False)  # the cell's requests, by prompt id
    not_measurable: int = 0  # requests whose reference normalises to no words (no WER; the gate refuses them)
    crashed: int = 0  # requests a real server's crash took down (errors starting with records.CRASHED_ERROR)
    trace: str | None = None  # the real server's --trace level (None: the sim); "off": no span facts at all
    slo: StreamingSlo | None = None  # goodput's SLO: the deploy's ``slo:`` or ``--slo`` (None: the default)

    def __post_init__(self) -> None:
        if not self.deploy_role:
            self.deploy_role, self.pair = deploy_role(self.deploy)

    @property
    def span_facts(self) -> bool:
        """False for a real cell run with ``--trace off``: its events, row counts, misaligned positions,
        preemptions and codec stream were never traced (they read 0 without meaning 0)."""
        return self.trace != "off"

    @property
    def prompt_scores(self) -> dict[str, float]:
        """{prompt id: WER} of the scored requests (the pairs of the paired table and metrics)."""
        return {r.prompt_id: float(r.score) for r in self.records if r.score is not None}

    @property
    def worst_request(self) -> RequestRecord | None:
        """The scored request with the highest WER (the first prompt id on a tie)."""
        worst = None
        for r in self.records:  # in prompt-id order
            if r.score is not None and (worst is None or r.score > worst.score):  # type: ignore[operator]
                worst = r
        return worst

    @property
    def accepted_tokens_per_step(self) -> float | None:
        """Plain mean over the cell's requests that report it (speculative decoding); None without."""
        return statistics.fmean(self.accepted) if self.accepted else None

    @property
    def key(self) -> CellKey:
        return (self.arm, self.deploy, self.repeat)

    @property
    def scored(self) -> int:
        return len(self.scores)

    @property
    def mean_wer(self) -> float | None:
        return statistics.fmean(self.scores) if self.scores else None

    @property
    def median_wer(self) -> float | None:
        return statistics.median(self.scores) if self.scores else None

    @property
    def oracle_mean_wer(self) -> float | None:
        return statistics.fmean(self.oracle_scores) if self.oracle_scores else None

    def requests_over(self, threshold: float = WER_THRESHOLD) -> int:
        return sum(s > threshold for s in self.scores)


def _run_offset(keys: Iterable[CellKey]) -> int:
    """Repeats are shown 1-based like the seed ("run 1 / run 2") whether stored from 0 or 1."""
    repeats = [k[2] for k in keys]
    return 1 if repeats and min(repeats) == 0 else 0


def cell_order(run: Run) -> list[CellKey]:
    """Arms in manifest order, then deploys in manifest order (reference before stress), then repeat.

    Cells that only the records name (a manifest written before a resumed run added cells) follow.
    """
    keys: list[CellKey] = []
    for cell in run.manifest.get("cells", []):
        keys.append((str(cell["arm"]), str(cell["deploy"]), int(cell["repeat"])))
    for rec in run.requests:
        keys.append((rec.arm, rec.deploy, rec.repeat))
    arm_rank: dict[str, int] = {}
    deploy_rank: dict[str, int] = {}
    for arm, deploy, _ in keys:
        arm_rank.setdefault(arm, len(arm_rank))
        deploy_rank.setdefault(deploy, len(deploy_rank))
    unique = list(dict.fromkeys(keys))
    return sorted(unique, key=lambda k: (arm_rank[k[0]], deploy_rank[k[1]], k[2]))


def request_events(run: Run) -> dict[tuple[str, str, int, str], EventCounts]:
    """Per-request events: counted from spans where the request has spans, else the record's."""
    groups = run.spans.group_events
    out: dict[tuple[str, str, int, str], EventCounts] = {}
    for rec in run.requests:
        counted = groups.get(rec.key)
        out[rec.key] = _with_record_counts(counted[0], [rec]) if counted else rec.events
    return out


def _with_record_counts(events: EventCounts, recs: Iterable[RequestRecord]) -> EventCounts:
    """``events`` counted from spans, with the counts only the records hold (``RECORD_COUNTS``: the backend
    counted them knowing each request's text) summed from ``recs``."""
    recs = list(recs)
    for name in RECORD_COUNTS:
        setattr(events, name, sum(getattr(r.events, name) for r in recs))
    return events


def summarize_cells(run: Run) -> list[CellSummary]:
    """One CellSummary per cell, in table order (see ``cell_order``)."""
    order = cell_order(run)
    offset = _run_offset(order)
    by_cell: dict[CellKey, list[RequestRecord]] = {k: [] for k in order}
    for rec in run.requests:
        by_cell[(rec.arm, rec.deploy, rec.repeat)].append(rec)
    span_cells: dict[CellKey, tuple[EventCounts, bool]] = {}  # every span of the cell, whether or not
    for (arm, deploy, repeat, _), (counts, known) in run.spans.group_events.items():  # its request has a record
        total, any_known = span_cells.get((arm, deploy, repeat), (EventCounts(), False))
        total.add(counts)
        span_cells[(arm, deploy, repeat)] = (total, any_known or known)
    manifest_wall = {
        (str(c["arm"]), str(c["deploy"]), int(c["repeat"])): c.get("wall_s") for c in run.manifest.get("cells", [])
    }
    traces = cell_trace_levels(run)
    roles = run.roles
    deploy_roles = {key[1]: run.deploy_role(key[1]) for key in order}
    slos = {key[1]: run.deploy_slo(key[1]) for key in order}

    out = []
    for key in order:
        recs = by_cell[key]
        if key in span_cells:
            events, misaligned_known = span_cells[key]
            events = _with_record_counts(events, recs)
            source = "spans"
        else:
            events, source = EventCounts(), "requests"
            for rec in recs:
                events.add(rec.events)
            misaligned_known = any(is_simulated(rec.backend) for rec in recs)
        scores = [r.score for r in recs if r.score is not None]
        whisper = sum(r.wer is not None for r in recs)
        oracle_only = sum(r.wer is None and r.oracle_wer is not None for r in recs)
        wer_source = ("whisper" if whisper and not oracle_only else "oracle" if oracle_only and not whisper
                      else "mixed" if whisper else "none")
        wall = manifest_wall.get(key)
        if not isinstance(wall, (int, float)) or isinstance(wall, bool):
            wall = sum(r.wall_s for r in recs)
        out.append(CellSummary(
            arm=key[0], deploy=key[1], repeat=key[2], requests=len(recs),
            scores=[float(s) for s in scores],
            oracle_scores=[float(r.oracle_wer) for r in recs if r.oracle_wer is not None],
            events=events, event_source=source, misaligned_known=misaligned_known,
            preemptions=sum(r.preemptions for r in recs),
            errors=sum(r.error is not None for r in recs),
            wall_s=float(wall), wer_source=wer_source, run_number=key[2] + offset,
            accepted=[float(r.accepted_tokens_per_step) for r in recs if r.accepted_tokens_per_step is not None],
            role=roles.get(key[0], DEFAULT_ROLE), records=sorted(recs, key=lambda r: r.prompt_id),
            deploy_role=deploy_roles[key[1]][0], pair=deploy_roles[key[1]][1],
            not_measurable=sum(r.not_measurable for r in recs), trace=traces.get(key),
            crashed=sum(1 for r in recs if r.error is not None and r.error.startswith(CRASHED_ERROR)),
            slo=slos[key[1]],
        ))
    return out


def with_slo(cells: list[CellSummary], slo: StreamingSlo | None) -> list[CellSummary]:
    """``cells`` measured against ``slo`` (``--slo``) instead of their deploys' own; None keeps theirs."""
    import dataclasses

    return cells if slo is None else [dataclasses.replace(c, slo=slo) for c in cells]


def cell_trace_levels(run: Run) -> dict[CellKey, str | None]:
    """Each cell's ``--trace`` level: what the manifest's cell says its server ran, else the run's
    (``harness.rundir.manifest_trace``: None on the sim)."""
    from harness.rundir import manifest_trace

    default = manifest_trace(run.manifest)
    out: dict[CellKey, str | None] = {}
    for c in run.manifest.get("cells", []):
        level = c.get("trace") if isinstance(c.get("trace"), str) else default
        out[(str(c["arm"]), str(c["deploy"]), int(c["repeat"]))] = level
    return out


def cell_releases(run: Run) -> dict[tuple[str, str], str]:
    """The vLLM-Omni release each real (arm, deploy) cell's server had installed (the manifest's
    ``implementation.release``); none on the sim and for servers started by a command prefix."""
    out: dict[tuple[str, str], str] = {}
    for c in run.manifest.get("cells") or []:
        impl = c.get("implementation") if isinstance(c, dict) else None
        if isinstance(impl, dict) and isinstance(impl.get("release"), str):
            out[(str(c.get("arm")), str(c.get("deploy")))] = impl["release"]
    return out


def group_rows(cells: list[CellSummary]) -> list[list[CellSummary]]:
    """Cells grouped per arm x deploy (the seed's rows), repeats in order."""
    groups: dict[tuple[str, str], list[CellSummary]] = {}
    for cell in cells:
        groups.setdefault((cell.arm, cell.deploy), []).append(cell)
    return list(groups.values())




# --------------------------------------------------------------------------- complete runs


def _key_text(key: tuple) -> str:
    arm, deploy, repeat, *rest = key
    return f"{arm}/{deploy} repeat {repeat}" + (f" prompt {rest[0]}" if rest else "")


def run_problems(run: Run) -> list[str]:
    """Why the run is not complete, one short sentence each; empty for a complete run.

    Complete: the manifest says it finished, no record file ends in a torn line, and the request
    records are exactly one per (arm, deploy, repeat, prompt) of the manifest's cells x prompts,
    from the manifest's backend, with spans only for the manifest's cells. ``gate`` refuses a run
    with a problem (exit 2); ``report`` and ``compare`` show it as a warning.
    """
    m = run.manifest
    problems: list[str] = []
    if not m.get("finished"):
        problems.append(f"the run did not finish ({MANIFEST_FILE}: finished is null; killed, still running, "
                        f"or resumed without completing)")
    for name in run.torn:
        problems.append(f"{name}: the last line is cut off (a write was interrupted; that record is lost)")
    cells = [(str(c["arm"]), str(c["deploy"]), int(c["repeat"])) for c in m.get("cells", [])]
    cell_set = set(cells)
    counts = Counter(r.key for r in run.requests)
    dups = [k for k, n in counts.items() if n > 1]
    if dups:
        problems.append(f"{len(dups)} request record{'s' if len(dups) > 1 else ''} written more than once "
                        f"(first: {_key_text(dups[0])}, {counts[dups[0]]} times)")
    listed = m.get("prompt_ids")
    prompt_ids = list(listed) if isinstance(listed, list) else list(dict.fromkeys(r.prompt_id for r in run.requests))
    expected = [(*cell, p) for cell in cells for p in prompt_ids]
    missing = [k for k in expected if k not in counts]
    if missing:
        problems.append(f"{len(missing)} of {len(expected)} request records missing (first: {_key_text(missing[0])})")
    foreign = [k for k in counts if k[:3] not in cell_set]
    if foreign:
        problems.append(f"{len(foreign)} request record{'s' if len(foreign) > 1 else ''} for a cell {MANIFEST_FILE} "
                        f"does not list (first: {_key_text(foreign[0])})")
    known = set(prompt_ids)
    strays = [k for k in counts if k[:3] in cell_set and k[3] not in known]
    if strays:
        problems.append(f"{len(strays)} request record{'s' if len(strays) > 1 else ''} for a prompt {MANIFEST_FILE} "
                        f"does not list (first: {_key_text(strays[0])})")
    backend = m.get("backend")
    wrong = [r for r in run.requests if backend and r.backend != backend]
    if wrong:
        problems.append(f"{len(wrong)} request record{'s' if len(wrong) > 1 else ''} from backend "
                        f"{wrong[0].backend!r}, {MANIFEST_FILE} says {backend!r} (first: {_key_text(wrong[0].key)})")
    keys = list(run.spans.group_events)
    span_foreign = sorted({k[:3] for k in keys if k[:3] not in cell_set})
    if span_foreign:
        problems.append(f"spans for {len(span_foreign)} cell{'s' if len(span_foreign) > 1 else ''} {MANIFEST_FILE} "
                        f"does not list (first: {_key_text(span_foreign[0])})")
    return problems


def event_problems(run: Run) -> list[str]:
    """Records whose ``events`` differ from the count of their own spans in ``spans.jsonl`` (both
    are written by the run from the same calls, so a difference is an edited or mixed-up file).
    The tables count events from the spans; ``gate`` refuses such a run (issue 24, case 16)."""
    groups = run.spans.group_events
    wrong = []
    for rec in run.requests:
        counted = groups.get(rec.key)
        if counted is None or rec.events == counted[0]:  # dataclass equality: no asdict per record
            continue
        mine, theirs = asdict(rec.events), asdict(counted[0])
        diff = [k for k in mine if mine[k] != theirs[k] and k not in RECORD_COUNTS]  # those: the records' own
        if diff:
            wrong.append((rec, diff[0], mine[diff[0]], theirs[diff[0]]))
    if not wrong:
        return []
    rec, field_name, said, counted_n = wrong[0]
    return [f"{len(wrong)} request record{'s' if len(wrong) > 1 else ''} in {REQUESTS_FILE} whose event counts differ "
            f"from their spans in {run.spans.source} (first: {_key_text(rec.key)}: events.{field_name} is {said}, "
            f"its spans count {counted_n})"]


def not_measurable_problem(run: Run) -> str | None:
    """Why the gate cannot judge a run with requests that are not measurable, or None."""
    recs = [r for r in run.requests if r.not_measurable]
    if not recs:
        return None
    first = recs[0]
    return (f"{len(recs)} request{'s' if len(recs) > 1 else ''} not measurable: the reference text normalises to "
            f"no words, so WER cannot judge the speech (first: {_key_text(first.key)}, reference "
            f"{first.reference_text[:60]!r}); give prompts whose replies are words, or check the Thinker's output")


def problems_line(run: Run, problems: list[str]) -> str:
    """All of ``run_problems`` as one line."""
    return f"{run.run_dir}: incomplete run ({len(problems)} problem{'s' if len(problems) > 1 else ''}): " + \
        "; ".join(problems)


def incomplete_warning(run: Run, strict: bool, refused: str) -> str | None:
    """The one warning line of every command that reads a run it does not gate (``compare``, ``fidelity``,
    ``conform --beside``): None for a complete run; with ``strict``, the refusal instead (``UserError``,
    exit 2, ending in ``refused``, e.g. "not compared (--strict)")."""
    problems = run_problems(run)
    if not problems:
        return None
    if strict:
        raise UserError(f"{problems_line(run, problems)}; {refused}")
    return f"omni-stress: warning: {problems_line(run, problems)}; its numbers may be partial"


# --------------------------------------------------------------------------- pairs (per-request evidence)


def reference_deploy_of(run: Run | list[CellSummary]) -> str | None:
    """The one reference deploy the run's paired cells pair with (summary.json and the paired note name
    it), or the run's one reference deploy when nothing pairs; None when there are several, or none."""
    cells = run if isinstance(run, list) else summarize_cells(run)
    present = {c.deploy for c in cells}
    pairs = {c.pair for c in cells if c.deploy_role == "stress" and c.pair in present}
    if not pairs:
        pairs = {c.deploy for c in cells if c.deploy_role == "reference"}
    return next(iter(pairs)) if len(pairs) == 1 else None


def deploy_prefix(name: str) -> str:
    """``cpu-stress`` -> ``cpu``, ``stress`` -> ``""``: a ``reference_deploy`` pattern picks the deploy of
    the cell's own prefix (deploys named PREFIX-KIND pair within a prefix)."""
    return name.rsplit("-", 1)[0] if "-" in name else ""


def resolve_reference_deploy(cell: CellSummary, deploy: str | None, cells: list[CellSummary]) -> str | None:
    """The reference deploy of ``cell``: with ``deploy`` None, the pair its deploy declares (None for a
    reference deploy); a name, itself; a pattern (``*reference``), the one matching deploy of the cell's
    arm with the cell's prefix (``cpu-stress`` pairs with ``cpu-reference``, ``stress`` with ``reference``),
    None when no deploy, or more than one, qualifies."""
    if deploy is None:
        return cell.pair if cell.deploy_role == "stress" else None
    if not any(ch in deploy for ch in "*?["):
        return deploy
    return _cell_index(cells).resolve(cell, deploy)


def reference_cell(cell: CellSummary, deploy: str | None, cells: list[CellSummary]) -> CellSummary | None:
    """The same arm's cell in the cell's reference deploy (``resolve_reference_deploy``), same repeat; a
    single reference run serves all repeats."""
    index = _cell_index(cells)
    resolved = resolve_reference_deploy(cell, deploy, cells)
    if resolved is None:
        return None
    same_arm = index.groups.get((cell.arm, resolved), ())
    found = index.by_repeat(cell.arm, resolved).get(cell.repeat) if same_arm else None
    if found is not None:
        return found
    return same_arm[0] if len(same_arm) == 1 else None


class _CellIndex:
    """The cells of one list grouped once by what ``reference_cell``, ``repeat_group`` and
    ``worst_of_repeats`` look up (issue 48: each scanned every cell for every cell, so ``report`` and
    ``gate`` grew with cells squared; a 10,000-request run of 400 cells spent seconds there). Built from,
    and valid for, the same cell objects in the same order (``_cell_index`` checks); the cells are not
    changed after ``summarize_cells`` builds them."""

    def __init__(self, cells: list[CellSummary]) -> None:
        self.cells = tuple(cells)
        self.groups: dict[tuple[str, str], list[CellSummary]] = {}  # (arm, deploy): its repeats, in list order
        self.arm_deploys: dict[str, list[str]] = {}  # arm: its deploys, each once
        for c in cells:
            group = self.groups.setdefault((c.arm, c.deploy), [])
            if not group:
                self.arm_deploys.setdefault(c.arm, []).append(c.deploy)
            group.append(c)
        self._by_repeat: dict[tuple[str, str], dict[int, CellSummary]] = {}
        self._resolved: dict[tuple[str, str, str], str | None] = {}
        self._worst: dict[tuple[str, str], dict[str, float]] = {}

    def by_repeat(self, arm: str, deploy: str) -> dict[int, CellSummary]:
        """{repeat: the first cell of that repeat} of one arm x deploy (reads only that group's repeats)."""
        key = (arm, deploy)
        if key not in self._by_repeat:
            first: dict[int, CellSummary] = {}
            for c in self.groups.get(key, ()):
                first.setdefault(c.repeat, c)
            self._by_repeat[key] = first
        return self._by_repeat[key]

    def resolve(self, cell: CellSummary, deploy: str) -> str | None:
        """``resolve_reference_deploy`` of a pattern, once per (arm, pattern, the cell's deploy)."""
        key = (cell.arm, deploy, cell.deploy)
        if key not in self._resolved:
            names = {d for d in self.arm_deploys.get(cell.arm, ()) if fnmatch.fnmatchcase(d, deploy)}
            same = sorted(n for n in names if deploy_prefix(n) == deploy_prefix(cell.deploy))
            self._resolved[key] = same[0] if len(same) == 1 else None
        return self._resolved[key]

    def worst(self, cell: CellSummary) -> dict[str, float]:
        """``worst_of_repeats`` of the cell's arm x deploy, once per group (a copy each call)."""
        key = (cell.arm, cell.deploy)
        if key not in self._worst:
            worst: dict[str, float] = {}
            for c in self.groups.get(key, ()):
                for pid, score in c.prompt_scores.items():
                    worst[pid] = max(score, worst.get(pid, score))
            self._worst[key] = worst
        return dict(self._worst[key])


_CELL_INDEXES: dict[int, _CellIndex] = {}  # id(cells): its index (the last few lists)


def _cell_index(cells: list[CellSummary]) -> _CellIndex:
    """The index of ``cells``, reused while the list holds the same cell objects in the same order."""
    index = _CELL_INDEXES.get(id(cells))
    if index is None or len(index.cells) != len(cells) or not all(map(operator.is_, index.cells, cells)):
        index = _CellIndex(cells)
        if len(_CELL_INDEXES) >= 8:
            _CELL_INDEXES.pop(next(iter(_CELL_INDEXES)))
        _CELL_INDEXES[id(cells)] = index
    return index


@dataclass
class PairedRow:
    """One prompt of one cell next to the same prompt in the same arm's reference cell."""

    cell: CellSummary
    reference: CellSummary
    prompt_id: str
    wer: float | None
    reference_wer: float | None
    oracle_wer: float | None
    reference_oracle_wer: float | None
    record: RequestRecord | None

    @property
    def delta(self) -> float | None:
        return None if self.wer is None or self.reference_wer is None else self.wer - self.reference_wer

    @property
    def oracle_delta(self) -> float | None:
        if self.oracle_wer is None or self.reference_oracle_wer is None:
            return None
        return self.oracle_wer - self.reference_oracle_wer


def paired_rows(cell: CellSummary, cells: list[CellSummary], reference_deploy: str | None = None) -> list[PairedRow]:
    """Per prompt: this cell's WER and the reference cell's (same arm, same repeat; ``reference_deploy``
    None: the cell's declared pair); [] without one."""
    ref = reference_cell(cell, reference_deploy, cells)
    if ref is None or ref is cell:
        return []
    mine = {r.prompt_id: r for r in cell.records}
    theirs = {r.prompt_id: r for r in ref.records}
    rows = []
    for pid in sorted(set(mine) | set(theirs)):
        a, b = mine.get(pid), theirs.get(pid)
        rows.append(PairedRow(cell, ref, pid, a.score if a else None, b.score if b else None,
                              a.oracle_wer if a else None, b.oracle_wer if b else None, a))
    return rows


def worst_paired_delta(cell: CellSummary, cells: list[CellSummary], reference_deploy: str | None = None) -> float | None:
    """The largest per-prompt WER increase over the reference cell; None when nothing pairs."""
    deltas = [r.delta for r in paired_rows(cell, cells, reference_deploy) if r.delta is not None]
    return max(deltas) if deltas else None


def repeat_group(cell: CellSummary, cells: list[CellSummary]) -> list[CellSummary]:
    """Every repeat of the cell's arm x deploy (the N of "worst of N repeats")."""
    return list(_cell_index(cells).groups.get((cell.arm, cell.deploy), ()))


def worst_of_repeats(cell: CellSummary, cells: list[CellSummary]) -> dict[str, float]:
    """{prompt id: its highest WER over the repeats of the cell's arm x deploy}."""
    return _cell_index(cells).worst(cell)
