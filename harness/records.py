"""Records that cross module boundaries, and the run directory's files.

Both backends emit the same ``RequestRecord`` and ``SpanRecord``; ASR, scoring, reports and
the gate only read these. Records are appended and flushed as they complete, so a killed run
keeps everything it measured (a torn last line is dropped on read).

``read_requests`` reads a complete file line by line with msgspec and can leave the codec tokens
undecoded (``codec_tokens=False``): at 10,000 requests they were most of ``report``'s time and memory
(issue 48); any doubt falls back to the reader before, so errors name the same line and field.

A run's spans are read by ``harness.spanstore.read_spans`` (an old run's spans.jsonl, then the span
store's files): the store builds on the span records and the file helpers here, so this module never
imports it, not even lazily, and the imports run one way (spanstore -> records).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.metrics import EVENT_FIELDS, METRICS, span_flags

REQUESTS_FILE = "requests.jsonl"
SPANS_FILE = "spans.jsonl"  # runs before the span store (issue 48), and the export's line format
# The start of the error of a request a real server took down with it (its worker crashed, issue 31);
# the report counts these per cell as crashed, and the gate fails every rule on a cell that has one.
CRASHED_ERROR = "server crashed"
MANIFEST_FILE = "manifest.json"


@dataclass
class SpanRecord:
    """One ``talker_preprocess`` call for one request (DESIGN.md "span").

    The event flags are not arguments: every record computes them from the phase contract
    (``harness.metrics.EVENTS``) when it is built, so no call site can get them wrong.
    Misaligned positions (exact: rows that differ from the contract's) come in two regions,
    ``misaligned_text`` (prompt and reply positions up to and including text-EOS) and
    ``misaligned_end`` (after text-EOS); ``misaligned`` is their sum (given alone by records
    written before the split). None: the backend does not know.
    """

    arm: str
    deploy: str
    repeat: int
    request: str  # prompt id
    step: int
    P: int
    c: int
    n: int
    rows: int  # rows returned by talker_preprocess (0 when the call raised)
    misaligned_text: int | None = None
    misaligned_end: int | None = None
    misaligned: int | None = None  # misaligned_text + misaligned_end
    error: str | None = None
    # The event flags, one bool per ``harness.metrics.EVENTS`` entry in its order (is_prefill,
    # nonzero_offset, cross_boundary, multi_decode, one_token_tail, row_mismatch): generated from it, so a
    # new event is a field here, in every span's JSON and in the fast writer (``span_json``) with no edit.
    __annotations__.update(dict.fromkeys(EVENT_FIELDS, "bool"))
    vars().update({name: field(default=False, init=False) for name in EVENT_FIELDS})

    def __post_init__(self) -> None:
        for name, value in span_flags(self.P, self.c, self.n, self.rows).items():
            setattr(self, name, value)
        if self.misaligned_text is not None or self.misaligned_end is not None:
            self.misaligned = (self.misaligned_text or 0) + (self.misaligned_end or 0)


@dataclass
class EventCounts:
    """Per-request (or per-cell) counts of the contract's events: one int field per ``harness.metrics.METRICS``
    entry, in its order (talker_calls, prefill_calls, nonzero_offset_chunks, cross_boundary_replays,
    multi_position_decode_spans, one_token_tails, row_count_mismatches, prefill_row_count_mismatches,
    misaligned_positions (text + end), misaligned_text_positions, misaligned_end_positions), generated from
    it: a new count is one ``Metric``."""

    __annotations__ = {m.name: "int" for m in METRICS}  # the class's own: it declares no other field
    vars().update(dict.fromkeys((m.name for m in METRICS), 0))

    def add(self, other: EventCounts) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class RequestRecord:
    """One request of one cell (arm x deploy x repeat), written when it completes."""

    arm: str
    deploy: str
    repeat: int
    prompt_id: str
    backend: str
    reference_text: str  # the Thinker's text: the WER reference
    thinker_text: str | None = None
    talker_prompt_len: int | None = None
    codec_tokens: list[int] = field(default_factory=list)
    num_codec_tokens: int = 0
    finish_reason: str | None = None
    oracle_transcript: str | None = None  # sim: the word sequence before TTS
    oracle_wer: float | None = None
    transcript: str | None = None  # Whisper's transcript of the audio
    wer: float | None = None  # Whisper WER (None until ASR ran, or --asr none)
    audio_path: str | None = None
    audio_seconds: float | None = None
    asr_seconds: float | None = None
    asr_cached: bool | None = None
    preemptions: int = 0
    accepted_tokens_per_step: float | None = None
    events: EventCounts = field(default_factory=EventCounts)
    error: str | None = None
    wall_s: float = 0.0
    # The reference text normalises to no words (special tokens only, symbols, emoji): WER cannot
    # judge the speech, so ``wer`` and ``oracle_wer`` stay None; counted apart, refused by the gate.
    not_measurable: bool = False
    # Latency (omni-stress sweep; written only when measured, see ``LATENCY_FIELDS``): the sim's steps
    # (the client sent the request, it reached the Talker, its first codec token, it finished) and the
    # real backend's seconds: ``ttfa_s`` from the send to the Talker's first codec token (its first traced
    # call at a generated position; the API is not streamed, the audio arrives whole with the response),
    # ``rtf`` end to end over the audio's seconds.
    sent_step: int | None = None
    arrival_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    ttfa_s: float | None = None
    rtf: float | None = None
    schedule: str | None = None  # sha256 (16 hex) of the request's (P, c, n) span sequence: ``schedule_digest``
    # Streamed audio (``run --stream``, real backend; written only when measured, see ``STREAM_FIELDS``;
    # definitions in ``harness.stream_metrics``): seconds since the answering attempt's send. ``stream_ttfa_s``
    # to the first audio bytes (measured, unlike ``ttfa_s``), ``stream_end_s`` to the body's last byte,
    # ``stream_chunks`` audio chunks with ``stream_chunk_frames`` frames each at ``stream_sample_rate`` Hz
    # (``stream_audio_events``: audio chunks the server sent, some possibly empty), ``stream_gaps_s`` every
    # gap between consecutive chunks, ``stream_underruns`` each [start, length] a player started at the
    # first chunk ran dry, ``stream_underrun_s`` their total.
    stream_ttfa_s: float | None = None
    stream_end_s: float | None = None
    stream_chunks: int | None = None
    stream_audio_events: int | None = None
    stream_sample_rate: int | None = None
    stream_chunk_frames: list[int] | None = None
    stream_gaps_s: list[float] | None = None
    stream_underruns: list[list[float]] | None = None
    stream_underrun_s: float | None = None
    # the answering attempt's send on the wall clock (``time.time()``): the cell's request window for its
    # audio throughput (``harness.streaming_figures``)
    stream_sent_at: float | None = None
    # A streamed response that answered 200 but is not the audio its codec stream says (empty, shorter than
    # its codec frames decode to): why; the request failed as a stream (goodput, the streaming table) and is
    # still scored on what it said (``harness.stream_metrics.stream_failure``).
    stream_failed: str | None = None
    # The Code2Wav chunk contract (``async_chunk: true``; ``harness.chunk_contract``): the windows the
    # Talker's connector sent with new frames, the new frames of each, the windows that broke the shipped
    # rule (dropped, repeated, foreign frames, ...) and the first one's description. Written only when the
    # connector was traced (real server) or modelled (sim), see ``CHUNK_FIELDS``.
    chunk_windows: int | None = None
    chunk_frames_sent: list[int] | None = None
    chunk_violations: int | None = None
    chunk_violation: str | None = None
    # sim only (modelled): the scheduler step at which each window was sent (its last new frame's step)
    chunk_window_steps: list[int] | None = None
    # real backend: the request's text region past the prompt as the worker's contract check built it (the reply
    # rows up to text-EOS, ``harness.contract.misaligned_regions``' ``reply_len``), from which the backend counted
    # ``events.replays_ending_in_text``; None where the worker did not check the contract (then not measured)
    text_len: int | None = None

    @property
    def key(self) -> tuple[str, str, int, str]:
        return (self.arm, self.deploy, self.repeat, self.prompt_id)

    @property
    def score(self) -> float | None:
        """The WER the tables use: Whisper's when present, else the oracle's."""
        return self.wer if self.wer is not None else self.oracle_wer


# Optional fields left out of requests.jsonl while None, so records without them are byte-identical
# to those written before the fields existed.
LATENCY_FIELDS = ("sent_step", "arrival_step", "first_token_step", "finish_step", "ttfa_s", "rtf", "schedule")
STREAM_FIELDS = ("stream_ttfa_s", "stream_end_s", "stream_chunks", "stream_audio_events", "stream_sample_rate",
                 "stream_chunk_frames", "stream_gaps_s", "stream_underruns", "stream_underrun_s", "stream_sent_at")
CHUNK_FIELDS = ("stream_failed", "chunk_windows", "chunk_frames_sent", "chunk_violations", "chunk_violation",
                "chunk_window_steps")
_OMITTED_WHEN_NONE = LATENCY_FIELDS + STREAM_FIELDS + CHUNK_FIELDS + ("text_len",)


def schedule_digest(spans: list[SpanRecord]) -> str:
    """The request's schedule: its (P, c, n) spans in order, as 16 hex digits of sha256."""
    import hashlib

    return hashlib.sha256(",".join(f"{s.P}:{s.c}:{s.n}" for s in spans).encode()).hexdigest()[:16]


_SPAN_KEYS = tuple(sorted(f.name for f in dataclasses.fields(SpanRecord)))
_SPAN_TEMPLATE = "{" + ", ".join(f'"{k}": %s' for k in _SPAN_KEYS) + "}"
_INTS = ("P", "c", "n", "repeat", "rows", "step")
_OPTIONAL_INTS = ("misaligned", "misaligned_end", "misaligned_text")
_FLAGS = tuple(sorted(EVENT_FIELDS))
_STRINGS = ("arm", "deploy", "request")
assert set(_SPAN_KEYS) == {*_INTS, *_OPTIONAL_INTS, *_FLAGS, *_STRINGS, "error"}
# each key of the JSON object, in sorted order, with how its value is written: 0 int, 1 optional int,
# 2 flag, 3 string, 4 the error (a string or null)
_SPAN_KINDS = tuple((k, 0 if k in _INTS else 1 if k in _OPTIONAL_INTS else 2 if k in _FLAGS else 3 if k in _STRINGS
                     else 4) for k in _SPAN_KEYS)
_JSON_STRINGS: dict[str, str] = {}  # arm, deploy and prompt ids repeat on every span: each encoded once


def _json_str(value: str) -> str:
    text = _JSON_STRINGS.get(value)
    if text is None:
        text = json.dumps(value)
        if len(_JSON_STRINGS) < 4096:
            _JSON_STRINGS[value] = text
    return text


def span_json(span: SpanRecord) -> str:
    """``json.dumps(vars(span), sort_keys=True)``, the same bytes, faster (``export-spans`` writes millions
    of spans): the fields' types checked, then one format string. Anything else (an attribute beyond the
    fields, a value of another type) takes json.dumps itself."""
    d = vars(span)
    if len(d) != len(_SPAN_KEYS):
        return json.dumps(dict(d), sort_keys=True)
    values = []
    for key, kind in _SPAN_KINDS:
        value = d.get(key)
        kind_of = type(value)
        if kind == 0 and kind_of is int:
            values.append(int.__repr__(value))
        elif kind == 1 and (value is None or kind_of is int):
            values.append("null" if value is None else int.__repr__(value))
        elif kind == 2 and kind_of is bool:
            values.append("true" if value else "false")
        elif kind == 3 and kind_of is str:
            values.append(_json_str(value))
        elif kind == 4 and (value is None or kind_of is str):
            values.append("null" if value is None else _json_str(value))
        else:
            return json.dumps(dict(d), sort_keys=True)
    return _SPAN_TEMPLATE % tuple(values)


_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))
_REQUEST_FIELD_SET = frozenset(_REQUEST_FIELDS)


def _request_dict(record: RequestRecord) -> dict[str, Any]:
    """``dataclasses.asdict`` of a request record without its deep copy of every codec token (a record
    holds about a thousand; ints need no copy): the same dict, the same JSON."""
    data = {name: getattr(record, name) for name in _REQUEST_FIELDS}
    data["events"] = dataclasses.asdict(record.events)
    data["codec_tokens"] = list(record.codec_tokens)
    for name in ("stream_chunk_frames", "stream_gaps_s", "chunk_frames_sent", "chunk_window_steps"):
        if data[name] is not None:
            data[name] = list(data[name])
    if data["stream_underruns"] is not None:
        data["stream_underruns"] = [list(u) for u in data["stream_underruns"]]
    return data


def to_json(record: Any) -> str:
    if type(record) is SpanRecord:
        return span_json(record)
    data = _request_dict(record) if type(record) is RequestRecord else dataclasses.asdict(record)
    if type(record) is RequestRecord:
        for name in _OMITTED_WHEN_NONE:
            if data.get(name) is None:
                data.pop(name, None)
    return json.dumps(data, sort_keys=True)


def request_from_dict(data: dict[str, Any]) -> RequestRecord:
    data = dict(data)
    data["events"] = EventCounts(**data.get("events", {}))
    known = _REQUEST_FIELD_SET  # not dataclasses.fields per record (10,000 records a report, issue 48)
    return RequestRecord(**{k: v for k, v in data.items() if k in known})


_SPAN_ARGS = frozenset(f.name for f in dataclasses.fields(SpanRecord) if f.init)


def span_from_dict(data: dict[str, Any]) -> SpanRecord:
    """A span from its JSON; the stored flags are recomputed from the contract, not trusted."""
    known = _SPAN_ARGS
    return SpanRecord(**{k: v for k, v in data.items() if k in known})


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a SIGKILL loses at most a torn line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # O_NOFOLLOW: a run file that is a symlink (a downloaded artifact can carry one) is never
        # appended through to a file outside the run directory (ELOOP instead; rundir.check_run_files
        # refuses it with one line before any write).
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        self._fh = open(fd, "a", encoding="utf-8")

    def write(self, record: Any) -> None:
        self._fh.write(to_json(record) + "\n")
        self._fh.flush()

    def write_many(self, records: list[Any]) -> None:
        if records:
            self._fh.write("".join(to_json(r) + "\n" for r in records))
            self._fh.flush()

    def sync(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yields complete lines; a torn (unparseable, unterminated) last line is dropped."""
    for _number, obj in iter_jsonl_numbered(path):
        yield obj


def iter_jsonl_numbered(path: Path) -> Iterator[tuple[int, Any]]:
    """``iter_jsonl`` with each object's line number (for errors that name the line)."""
    if not path.exists():
        return
    with open(path, encoding="utf-8") as fh:
        lines = fh.readlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield i + 1, json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                return  # torn by a kill mid-write
            raise ValueError(f"{path}: line {i + 1}: not valid JSON") from None


def truncate_torn_tail(path: Path) -> bool:
    """Drops a torn last line in place (before appending to a resumed run)."""
    if not path.exists():
        return False
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    cut = data.rfind(b"\n") + 1
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        os.ftruncate(fd, cut)
    finally:
        os.close(fd)
    return True


def read_requests(run_dir: Path, codec_tokens: bool = True, raw: bytes | None = None) -> list[RequestRecord]:
    """Every complete record; a record with a missing field or a field of the wrong type is a
    ValueError naming the file and the line (``request_record_problem``).

    ``codec_tokens=False``: each record's ``codec_tokens`` is left empty (``num_codec_tokens`` keeps the
    count), for the readers that never look at the tokens (``report``, ``gate``): they are most of the
    file's bytes, and about 10 million Python ints at 10,000 requests. ``raw``: the file's bytes, when
    the caller has read them already."""
    path = run_dir / REQUESTS_FILE
    fast = _fast_requests(path, codec_tokens, raw)
    if fast is not None:
        return fast
    records = []
    for number, data in _bulk_jsonl(path) or iter_jsonl_numbered(path):
        problem = request_record_problem(data)
        if problem is not None:
            raise ValueError(f"{path}: line {number}: {problem}")
        records.append(request_from_dict(data))
        if not codec_tokens:
            records[-1].codec_tokens = []
    return records


@functools.cache
def _request_line_decoder() -> Any:
    """msgspec's decoder of one request line: every field as JSON gives it (``Any``, as ``json.loads``
    would), except ``codec_tokens``, kept as its raw bytes; an unknown field is an error (the caller
    then reads the file as before)."""
    import msgspec

    fields = [(name, Any, msgspec.UNSET) for name in _REQUEST_FIELDS if name != "codec_tokens"]
    line = msgspec.defstruct("RequestLine", [*fields, ("codec_tokens", msgspec.Raw, msgspec.UNSET)],
                             forbid_unknown_fields=True)
    return msgspec.json.Decoder(line)


_INT_ARRAY_CHARS = b"0123456789-, \t\r\n"


def _fast_requests(path: Path, codec_tokens: bool, raw: bytes | None) -> list[RequestRecord] | None:
    """The records of a complete requests.jsonl whose every line is a valid record, read line by line
    by msgspec without building a dict per line twice, and without the codec tokens' ints where they
    are not wanted (issue 48: ``report`` on 10,000 requests spent most of its time and memory there);
    None for any doubt (no msgspec, a torn tail, a blank line, an unknown field, a record with a
    problem): the caller reads as before, and names the problem as before.

    The tokens are checked as ``request_record_problem`` checks them without being decoded: msgspec has
    checked they are valid JSON, and a JSON array of nothing but digits, minus signs, commas and
    blanks is a flat list of integers."""
    try:
        import msgspec
    except ImportError:
        return None
    raw = _complete_jsonl_bytes(path, raw)
    if raw is None:
        return None
    decode = _request_line_decoder().decode
    unset = msgspec.UNSET
    names = _REQUEST_FIELDS
    view = memoryview(raw)
    records = []
    start, size = 0, len(raw)
    try:
        while start < size:
            end = raw.index(b"\n", start)
            line = decode(view[start:end])
            start = end + 1
            data = {name: value for name in names if (value := getattr(line, name)) is not unset}
            tokens = data.get("codec_tokens")
            if tokens is not None:
                if codec_tokens:
                    data["codec_tokens"] = msgspec.json.decode(tokens)
                else:
                    text = bytes(tokens).strip()
                    if text[:1] != b"[" or text[-1:] != b"]" or text[1:-1].translate(None, _INT_ARRAY_CHARS):
                        return None
                    data["codec_tokens"] = []
            if request_record_problem(data) is not None:
                return None
            records.append(request_from_dict(data))
    except (msgspec.DecodeError, ValueError, TypeError, UnicodeDecodeError):
        return None
    return records


def _complete_jsonl_bytes(path: Path, raw: bytes | None = None) -> bytes | None:
    """The file's bytes (``raw`` when given) if it is a complete JSON-lines file: no torn tail, no blank line."""
    if raw is None:
        try:
            raw = path.read_bytes()
        except OSError:
            return None
    if not raw.endswith(b"\n") or b"\n\n" in raw or raw.startswith(b"\n"):
        return None
    return raw


def _bulk_jsonl(path: Path) -> list[tuple[int, Any]] | None:
    """A complete JSON-lines file parsed in one call by msgspec (installed with vLLM; about twice as fast
    as ``json`` line by line on a 10,000-request requests.jsonl), numbered; None for any doubt (no
    msgspec, a torn tail, a blank line, anything msgspec reads differently): the caller reads by line."""
    try:
        import msgspec
    except ImportError:
        return None
    raw = _complete_jsonl_bytes(path)
    if raw is None:
        return None
    body = raw[:-1]
    try:
        data = msgspec.json.decode(b"[" + body.replace(b"\n", b",") + b"]")
    except (msgspec.DecodeError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, list) or len(data) != body.count(b"\n") + 1:
        return None
    return list(enumerate(data, 1))


def read_manifest(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / MANIFEST_FILE).read_text(encoding="utf-8"))


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    write_file_atomic(run_dir / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def write_file_atomic(path: Path, data: str | bytes) -> None:
    """Writes ``path`` whole by a temporary file in the same folder and a rename: a reader never sees
    half a file, and a ``path`` that is a symlink is replaced by the file, never written through
    (the temporary file is opened with ``O_NOFOLLOW``, so a planted link there fails too)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # surrogateescape: a path of bytes that are not UTF-8 (``--out`` on such a folder) is written as
    # those bytes, as the file system has them, instead of failing the report at the end of a run
    raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:  # name the file the caller writes, not the temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        with open(fd, "wb") as fh:
            fh.write(raw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- a request record's JSON, checked
# ``read_requests`` runs this on every line, so ``run --resume``, ``report``, ``compare`` and ``gate``
# all refuse a hand-edited or foreign record (a missing field, ``"repeat": "one"``) with one line
# naming the file, the line and the field, instead of a TypeError deep in the tables. It lives with
# the record it checks: records import no checker (the contract and the gate import records).


@functools.cache
def _request_fields() -> tuple[dict[str, str], frozenset[str]]:
    types = {f.name: str(f.type) for f in dataclasses.fields(RequestRecord) if f.init}
    required = frozenset(f.name for f in dataclasses.fields(RequestRecord)
                         if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return types, required


@functools.cache
def _quick_types() -> dict[str, frozenset[type]]:
    """{field: the Python types a scalar value of it may have}, for the fields of plain scalar types
    (``_has_type`` decides the rest, and every value not in these sets)."""
    plain = {"None": type(None), "str": str, "bool": bool, "int": int, "float": float}
    out = {}
    for name, declared in _request_fields()[0].items():
        parts = [p.strip() for p in declared.split("|")]
        if all(p in plain for p in parts):
            kinds = {plain[p] for p in parts}
            if float in kinds:
                kinds.add(int)  # a float field takes a JSON integer (not a bool)
            out[name] = frozenset(kinds)
    return out


def request_record_problem(obj: Any) -> str | None:
    """What is wrong with one parsed request record, or None."""
    if not isinstance(obj, dict):
        return f"expected a request record (a JSON object), got {_json_type(obj)}"
    types, required = _request_fields()
    missing = sorted(required - obj.keys())
    if missing:
        return f"record missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"
    quick = _quick_types()
    for name, value in obj.items():
        if type(value) in quick.get(name, ()):  # a plain scalar of a declared type: no parsing of the type
            continue
        declared = types.get(name)
        if declared is not None and not _has_type(value, declared):
            return f"{name}: expected {declared.replace('EventCounts', 'an object of counts')}, got {value!r:.60}"
    return _range_problem(obj)


def _range_problem(obj: dict[str, Any]) -> str | None:
    """Every number of a record is finite and not negative: JSON readers take ``NaN`` and
    ``Infinity``, and a NaN ``oracle_wer`` read as "not measured", a negative WER as better than
    perfect (issue 24, case 16). Types are checked already."""
    for name in sorted(obj):
        value = obj[name]
        if name == "events":
            for key in sorted(value):
                if value[key] < 0:
                    return f"events.{key}: must be a count >= 0, got {value[key]!r}"
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isnan(value) or math.isinf(value) or value < 0:
                kind = "a count" if isinstance(value, int) else "a finite number"
                return f"{name}: must be {kind} >= 0, got {value!r}"
    return None


def _has_type(value: Any, declared: str) -> bool:
    for part in (p.strip() for p in declared.split("|")):
        if part == "None" and value is None:
            return True
        if part == "str" and isinstance(value, str):
            return True
        if part == "bool" and isinstance(value, bool):
            return True
        if part == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if part == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if part.startswith("list[") and isinstance(value, list):
            inner = part[5:-1]
            if inner == "int" and set(map(type, value)) <= {int}:  # codec_tokens: thousands of ints, one C pass
                return True
            return all(_has_type(v, inner) for v in value)
        if part == "EventCounts" and isinstance(value, dict):
            if set(map(type, value)) <= {str} and set(map(type, value.values())) <= {int}:  # as JSON gives them
                return True
            return all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in value.items())
        if part not in ("None", "str", "bool", "int", "float", "EventCounts") and not part.startswith("list["):
            return True  # a type this check does not know: not its business
    return False


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)
