"""vLLM general plugin that traces every Talker ``talker_preprocess`` call to JSONL.

Loaded by vLLM in every process through the ``vllm.general_plugins`` entry point this package
declares (``omni_stress_trace = "harness.serve.trace_plugin:register"``); in vllm-omni 0.30.0 the
stage workers call it from ``OmniWorkerMixin.__init__`` (``vllm_omni/worker/mixins.py`` ->
``vllm_omni/plugins/__init__.py: load_omni_general_plugins`` -> ``vllm.plugins.load_general_plugins``),
before the model is built. vLLM's ``VLLM_PLUGINS``, when set, must list ``omni_stress_trace``. This module
imports only the standard library: it runs inside the arm's own environment. It is inert unless the
environment variable ``OMNI_STRESS_TRACE`` names an existing directory.

What it wraps (vllm-omni 0.30.0): ``Qwen2_5OmniForConditionalGeneration.talker_preprocess`` in
``vllm_omni/model_executor/models/qwen2_5_omni/qwen2_5_omni.py``. The Talker stage's ``__init__``
registers it with ``self.set_custom_preprocess(self.talker_preprocess)``
(``model_executor/custom_process_mixin.py``), so the class attribute must be wrapped *before* the
model is built; the plugin therefore installs a post-import hook and wraps the class as soon as that
module is imported (or at once if it already is). The GPU runner
(``vllm_omni/worker/gpu_model_runner.py``) calls it once per request and step as
``self.model.preprocess(input_ids=ids[s:e], input_embeds=..., **req_infos)`` with
``req_infos["request_id"]``, ``_omni_prompt_len``, ``_omni_num_computed_tokens`` and
``_omni_is_prefill``, gets back ``(req_input_ids, req_embeds, update_dict)`` and copies
``req_embeds[:min(span_len, rows)]`` into the span.

One JSON object per call is appended to ``<dir>/trace-<pid>.jsonl`` (keys in ``TRACE_KEYS``):
``request_id``, ``_omni_prompt_len`` (P), ``_omni_num_computed_tokens`` (c), ``span_len`` (n =
``input_ids.shape[0]``), ``_omni_is_prefill``, ``rows`` (``req_embeds.shape[0]``; ``null`` if the call
raised), ``step`` (inferred runner step), ``seq`` (call counter of this process), ``pid``, ``time``,
``error``. ``step`` is inferred because the hook sees calls, not steps: a new step starts when a
request repeats within the current step, or when the span's offset in the step's flattened batch
(``input_ids.storage_offset()``) does not increase.

``OMNI_STRESS_TRACE_TARGET=module:Class`` retargets the hook (a branch that moved the class).

Levels (``OMNI_STRESS_TRACE_LEVEL``, issue 34; ``omni-stress run --trace``): ``contract`` (the default)
traces every call and runs the contract check below; ``spans`` traces without the check; ``off`` wraps
nothing (the arm is still bound, ``implementation-<pid>.json`` still written), so the server runs
untouched and the run has no span facts. Without the variable, ``OMNI_STRESS_CONTRACT=0`` means ``spans``.

Sync-free on a device: a call never reads a device value back. What a line needs from tensors (the
contract's per-position mismatch mask, the span's codec ids) is packed into one int64 tensor on the
device and copied to pinned host memory with ``non_blocking=True`` behind an event on the current
stream (``HostCopy``); the line is written once its copy has landed, in call order: checked without
waiting at the end of every call, and by a flusher thread that waits on the event (blocking itself
only). On CPU the copy is the tensor itself, so every line is written before its call returns.
``OMNI_STRESS_TRACE_TIMING=1`` adds ``timing-<pid>.jsonl``: per runner step, the CPU and wall seconds
the instrumentation took inside the wrapped calls and the step's own (``bench/trace_cost.py``).

Two more jobs, both in the Talker worker and both off unless the launcher asks:

* ``OMNI_STRESS_ARM=package.module:attr``: the arm's ``talker_preprocess`` is bound onto the class
  first (``harness.serve.arm_binding``), so the trace wraps the arm; what ran is written to
  ``<dir>/implementation-<pid>.json``.
* The contract check (on while tracing; ``OMNI_STRESS_CONTRACT=0`` turns it off): each line also
  carries ``misaligned_text``/``misaligned_end``, the positions whose delivered row differs from the
  contract's (``harness.serve.worker_contract``), and ``text_len``, the request's text region past the prompt
  (the backend counts the replays ending inside it), or ``contract_error`` when the payload could not
  give the expected rows. It imports torch lazily, only inside the worker's calls. With
  ``OMNI_STRESS_ROW_IDS=1`` (the speaking checkpoint) the arm gets Thinker rows carrying identity codes
  and the check compares identities; the codes are zeroed before the runner copies the rows
  (``worker_contract.tag_payload`` / ``strip_ids``).
"""

from __future__ import annotations

import atexit
import collections
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from harness.serve import chunk_trace
from harness.serve.importhook import PostImportHook

ENV_DIR = "OMNI_STRESS_TRACE"
ENV_TARGET = "OMNI_STRESS_TRACE_TARGET"
ENV_ARM = "OMNI_STRESS_ARM"
ENV_CONTRACT = "OMNI_STRESS_CONTRACT"
ENV_ROW_IDS = "OMNI_STRESS_ROW_IDS"  # "1": identity-coded Thinker rows (harness.serve.worker_contract)
ENV_LEVEL = "OMNI_STRESS_TRACE_LEVEL"  # off | spans | contract (issue 34)
ENV_WRAPPER = "OMNI_STRESS_TRACE_WRAPPER"  # module:function(cls, writer) that wraps a family's hooks instead
ENV_TIMING = "OMNI_STRESS_TRACE_TIMING"  # "1": per-step instrumentation timings (timing-<pid>.jsonl)
LEVELS = ("off", "spans", "contract")
DEFAULT_LEVEL = "contract"
TIMING_GLOB = "timing-*.jsonl"
IMPLEMENTATION_GLOB = "implementation-*.json"
DEFAULT_TARGET = "vllm_omni.model_executor.models.qwen2_5_omni.qwen2_5_omni:Qwen2_5OmniForConditionalGeneration"
METHOD = "talker_preprocess"
TRACE_GLOB = "trace-*.jsonl"
TRACE_KEYS = (
    "request_id",
    "_omni_prompt_len",
    "_omni_num_computed_tokens",
    "span_len",
    "_omni_is_prefill",
    "rows",
    "step",
    "seq",
    "pid",
    "time",
    "error",
)
# the contract check's keys
CONTRACT_KEYS = ("misaligned_text", "misaligned_end", "first_misaligned", "text_len", "contract_error")
CODEC_KEYS = ("codec_from", "codec_ids")  # the span's input ids at generated positions (the Talker's codec stream)
_MARK = "__omni_stress_traced__"
_LINE_ENCODER = json.JSONEncoder(sort_keys=True)  # json.dumps(..., sort_keys=True) builds one per call


def _warn(msg: str) -> None:
    try:
        sys.stderr.write(f"[omni-stress trace] {msg}\n")
    except Exception:  # noqa: BLE001, S110 - a broken stderr must not break the server
        pass


def _first_dim(obj: Any) -> int | None:
    shape = getattr(obj, "shape", None)
    if shape is not None:
        try:
            return int(shape[0])
        except (TypeError, IndexError, ValueError):
            return None
    try:
        return len(obj)
    except TypeError:
        return None


def _as_int(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def trace_level(env: Mapping[str, str] | None = None) -> str:
    """The level a process with environment ``env`` (default ``os.environ``) traces at:
    ``OMNI_STRESS_TRACE_LEVEL``, else ``spans`` where the older ``OMNI_STRESS_CONTRACT=0`` turns the
    check off, else ``contract``. An unknown level is the default (the launcher refuses one first)."""
    env = os.environ if env is None else env
    level = env.get(ENV_LEVEL)
    if level:
        return level if level in LEVELS else DEFAULT_LEVEL
    return "spans" if env.get(ENV_CONTRACT, "1") == "0" else DEFAULT_LEVEL


@dataclass
class Deferred:
    """Values a trace line needs that are still on the device: ``tensors`` (read back as flat int64,
    one list each) and ``finish(values) -> keys``; ``fallback(exc)`` names a failure in the line."""

    tensors: list[Any]
    finish: Callable[[list[list[int]]], dict[str, Any]]
    fallback: Callable[[BaseException], dict[str, Any]] = lambda _exc: {}


class HostCopy:
    """``flat`` on its way to host memory without a sync: on CPU the tensor itself (ready at once);
    on a device a ``non_blocking`` copy into pinned memory and an event recorded behind it on the
    current stream. ``ready`` asks the event, ``wait`` blocks the calling thread only, ``values`` is
    the one conversion to Python."""

    def __init__(self, flat: Any) -> None:
        self.event: Any = None
        self.device: Any = None
        self.host = flat
        if flat.device.type == "cpu":
            return
        import torch

        module = getattr(torch, flat.device.type, None)
        event_cls = getattr(module, "Event", None)
        try:
            if event_cls is None:
                raise RuntimeError("no events")
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            event = event_cls()
            event.record()
            self.host, self.event = host, event
            self.device = flat  # kept until the line is written: the copy reads it after the call returns
        except Exception:  # noqa: BLE001 - a device without pinned memory or events: a blocking copy
            self.host = flat.cpu()

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def values(self) -> list[int]:
        return self.host.tolist()


start_host_copy: Callable[[Any], Any] = HostCopy  # the one place a line's values leave the device (tests count it)


@dataclass
class _Pending:
    line: dict[str, Any]
    parts: list[Deferred] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    copy: Any = None


def _pack(parts: list[Deferred]) -> tuple[Any, list[int]]:
    """Every tensor of ``parts`` flattened into one int64 tensor on the first one's device (one copy)."""
    import torch

    tensors = [t for part in parts for t in part.tensors]
    device = tensors[0].device
    flat = [t if t.dim() == 1 else t.reshape(-1) for t in tensors]
    if len(flat) == 1:  # a one-token decode's span (most calls): no cat, no cast of int64 ids
        one = flat[0] if flat[0].dtype == torch.int64 else flat[0].to(dtype=torch.int64)
        return one, [int(one.shape[0])]
    flat = [t.to(device=device, dtype=torch.int64) for t in flat]
    return torch.cat(flat), [int(t.shape[0]) for t in flat]


def _clock() -> tuple[float, float, float]:
    """(this thread's CPU seconds, this process's CPU seconds, wall seconds)."""
    return time.thread_time(), time.process_time(), time.perf_counter()


class TraceWriter:
    """Appends one line per call to ``<dir>/trace-<pid>.jsonl`` with one ``write`` (O_APPEND), so lines
    never interleave; lines whose device values are still in flight wait in call order (``_Pending``).
    ``timing``: also ``<dir>/timing-<pid>.jsonl``, one line per finished runner step."""

    def __init__(self, directory: str, timing: bool = False) -> None:
        self.directory = directory
        self.timing = timing
        # The level and row identities, read once: a worker's environment does not change while it serves,
        # and reading it per call was about 5 % of a traced call in a profiled server (issue 34).
        self.level = trace_level()
        self.check = self.level == "contract"
        self.row_ids = _row_ids_enabled()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._fd: int | None = None
        self._timing_fd: int | None = None
        self._timing_line: dict[str, Any] | None = None  # the previous step's, until add_cost writes it
        self._pid: int | None = None
        self._seq = 0
        self._step = 0
        self._step_requests: set[str] = set()
        self._last_offset: int | None = None
        self._queue: collections.deque[_Pending] = collections.deque()
        self._flusher: threading.Thread | None = None
        self._flusher_pid: int | None = None
        self._step_started: tuple[float, float, float] | None = None
        self._step_cost = [0, 0.0, 0.0, 0.0]  # calls, thread, process, wall seconds of instrumentation

    def _open(self) -> int:
        pid = os.getpid()
        if self._fd is None or self._pid != pid:  # reopen after fork: one file per process
            path = os.path.join(self.directory, f"trace-{pid}.jsonl")
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._timing_fd = None
            self._timing_line = None
            self._pid = pid
            self._seq = 0
            self._step = 0
            self._step_requests = set()
            self._last_offset = None
            self._queue.clear()
            self._step_started = None
            self._step_cost = [0, 0.0, 0.0, 0.0]
        return self._fd

    def _advance_step(self, request_id: str, offset: int | None) -> int:
        new_step = request_id in self._step_requests or (
            offset is not None and self._last_offset is not None and offset <= self._last_offset
        )
        if new_step and (self._seq > 0):
            self._step += 1
            self._step_requests = set()
        self._step_requests.add(request_id)
        self._last_offset = offset
        return self._step

    def record(self, info: dict[str, Any], input_ids: Any, result: Any, error: str | None = None,
               contract: dict[str, Any] | None = None, deferred: list[Deferred] | None = None,
               started: tuple[float, float, float] | None = None) -> dict[str, Any]:
        """Files the call's line: written now when nothing of it (or before it) is still on the device,
        else when its values land. ``started``: the call's ``_clock()`` at entry (timing only)."""
        request_id = str(info.get("request_id"))
        offset = None
        storage_offset = getattr(input_ids, "storage_offset", None)
        if callable(storage_offset):
            try:
                offset = int(storage_offset())
            except Exception:  # noqa: BLE001
                offset = None
        rows = None
        if error is None and isinstance(result, tuple) and len(result) >= 2:
            rows = _first_dim(result[1])
        parts = [d for d in deferred or () if d.tensors]
        with self._lock:
            self._open()
            before = self._step
            step = self._advance_step(request_id, offset)
            if self.timing and started is not None:
                self._time_step(step != before or self._step_started is None, started)
            line = {
                "request_id": request_id,
                "_omni_prompt_len": _as_int(info.get("_omni_prompt_len")),
                "_omni_num_computed_tokens": _as_int(info.get("_omni_num_computed_tokens")),
                "span_len": _first_dim(input_ids),
                "_omni_is_prefill": None if info.get("_omni_is_prefill") is None else bool(info["_omni_is_prefill"]),
                "rows": rows,
                "step": step,
                "seq": self._seq,
                "pid": self._pid,
                "time": time.time(),
                "error": error,
            }
            if contract:
                line.update(contract)
            self._seq += 1
            pending = _Pending(line)
            if parts:
                try:
                    flat, pending.sizes = _pack(parts)
                    pending.copy = start_host_copy(flat)
                    pending.parts = parts
                except Exception as exc:  # noqa: BLE001 - the line goes out without those keys
                    for part in parts:
                        line.update(part.fallback(exc))
            self._queue.append(pending)
            self._drain(wait=False)
            if self._queue:
                self._cond.notify_all()
                self._start_flusher()
        return line

    def _drain(self, wait: bool) -> None:
        """Writes the queue's head lines whose values have landed (all of them with ``wait``); the
        lock is held."""
        while self._queue:
            head = self._queue[0]
            if head.copy is not None and not head.copy.ready():
                if not wait:
                    return
                head.copy.wait()
            self._queue.popleft()
            line = head.line
            if head.parts:
                try:
                    values = head.copy.values()
                except Exception as exc:  # noqa: BLE001
                    values = None
                    for part in head.parts:
                        line.update(part.fallback(exc))
                chunks, at = [], 0
                for size in head.sizes:
                    chunks.append(values[at:at + size] if values is not None else [])
                    at += size
                for part in head.parts if values is not None else ():
                    mine, chunks = chunks[:len(part.tensors)], chunks[len(part.tensors):]
                    try:
                        line.update(part.finish(mine))
                    except Exception as exc:  # noqa: BLE001 - a key we cannot finish is named, never fatal
                        line.update(part.fallback(exc))
            if self._fd is not None:
                os.write(self._fd, (_LINE_ENCODER.encode(line) + "\n").encode("utf-8"))

    def flush(self) -> None:
        """Writes every queued line, waiting for values still in flight (process exit, tests)."""
        with self._lock:
            if self._pid == os.getpid():
                try:
                    self._drain(wait=True)
                except Exception as exc:  # noqa: BLE001 - at exit the device may be gone already
                    _warn(f"cannot write the last trace lines: {type(exc).__name__}: {exc}")

    def _start_flusher(self) -> None:
        """The thread that writes lines whose values land after their call returned (a device)."""
        if self._flusher is not None and self._flusher_pid == os.getpid() and self._flusher.is_alive():
            return
        self._flusher_pid = os.getpid()
        self._flusher = threading.Thread(target=self._flush_loop, name="omni-stress-trace-flush", daemon=True)
        self._flusher.start()

    def _flush_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                head = self._queue[0]
            try:
                if head.copy is not None:
                    head.copy.wait()  # this thread only: the worker's stream runs on
            except Exception:  # noqa: BLE001, S110 - _drain names the failure in the line
                pass
            with self._lock:
                try:
                    self._drain(wait=False)
                except Exception as exc:  # noqa: BLE001
                    _warn(f"cannot write trace lines: {type(exc).__name__}: {exc}")
                    self._queue.clear()
                self._cond.notify_all()

    def wait_written(self, timeout_s: float) -> bool:
        """True once every queued line is written (by the flusher), False after ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue, timeout=timeout_s)

    # ------------------------------------------------------------------ timing (OMNI_STRESS_TRACE_TIMING)

    def add_cost(self, instrumentation: tuple[float, float, float]) -> None:
        """The instrumentation seconds of one call of the current step (thread, process, wall); then the
        previous step's timing line, if one is waiting: written here, after the call's clocks stopped,
        because the timing file is the bench's instrument, not part of what a level costs."""
        with self._lock:
            cost = self._step_cost
            cost[0] += 1
            for k in range(3):
                cost[k + 1] += instrumentation[k]
            line, self._timing_line = self._timing_line, None
            if line is not None:
                if self._timing_fd is None:
                    path = os.path.join(self.directory, f"timing-{os.getpid()}.jsonl")
                    self._timing_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.write(self._timing_fd, (_LINE_ENCODER.encode(line) + "\n").encode("utf-8"))

    def _time_step(self, new_step: bool, started: tuple[float, float, float]) -> None:
        """At a step's first call: the previous step's line (its seconds end where this call starts)."""
        if not new_step:
            return
        if self._step_started is not None and self._step_cost[0]:
            prev = self._step_started
            calls, thr, proc, wall = self._step_cost
            line = {"step": self._step - 1, "calls": calls, "level": self.level, "instr_thread_s": thr,
                    "instr_process_s": proc, "instr_wall_s": wall, "step_thread_s": started[0] - prev[0],
                    "step_process_s": started[1] - prev[1], "step_wall_s": started[2] - prev[2]}
            self._timing_line = line  # written by add_cost, outside the measured seconds
        self._step_started = started
        self._step_cost = [0, 0.0, 0.0, 0.0]


def _row_ids_enabled() -> bool:
    return os.environ.get(ENV_ROW_IDS, "0") == "1"


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _tag(info: dict) -> tuple[dict, Any] | None:
    """The payload with identity-coded Thinker rows and the device flag saying they carry codes
    (``worker_contract.tag_payload_on_device``), or None."""
    try:
        from harness.serve.worker_contract import tag_payload_on_device

        return tag_payload_on_device(info)
    except Exception as exc:  # noqa: BLE001 - untagged rows are still compared by value
        _warn(f"cannot tag rows: {type(exc).__name__}: {exc}")
        return None


def _contract_error(exc: BaseException) -> dict[str, Any]:
    return {"contract_error": f"{type(exc).__name__}: {exc}"}


def _check_contract(model: Any, info: dict, ids_before: Any, result: Any, embeds_after: Any,
                    coded: Any = None) -> dict[str, Any] | Deferred | None:
    """The contract's keys now (an error, or a check that ran on the host), or a ``Deferred`` holding
    the device mask (``worker_contract.misaligned_on_device``)."""
    if ids_before is None or not (isinstance(result, tuple) and len(result) >= 2):
        return None
    try:
        from harness.serve.worker_contract import PendingContract, misaligned_on_device

        pending = misaligned_on_device(model, info, ids_before, result, embeds_after, coded=coded)
        if not isinstance(pending, PendingContract):
            return pending
        if not _is_tensor(pending.mask):
            return pending.finish(list(pending.mask))
        return Deferred([pending.mask], lambda values: pending.finish(values[0]), _contract_error)
    except Exception as exc:  # noqa: BLE001 - the check must never break generation
        return _contract_error(exc)


def _codec_ids(info: dict, ids: Any) -> dict[str, Any] | Deferred | None:
    """The ids the runner scheduled at positions ``>= P`` of this span: position ``P + g`` holds the
    Talker's generated codec token ``g`` (the one sampled from position ``P - 1 + g``), so the spans
    of a request, by position, give its codec stream (all of it but the final EOS, which is never
    fed back). Read before the arm runs (an arm may overwrite its ids); a tensor's values are read
    back with the line (``Deferred``)."""
    P, c = _as_int(info.get("_omni_prompt_len")), _as_int(info.get("_omni_num_computed_tokens"))
    n = _first_dim(ids)
    if P is None or c is None or n is None or c + n <= P:
        return None
    start = max(c, P)
    try:
        tail = ids[start - c:]
        if _is_tensor(tail):
            return Deferred([tail], lambda values: {"codec_from": start, "codec_ids": [int(v) for v in values[0]]})
        values = [int(v) for v in tail.tolist()]
    except Exception:  # noqa: BLE001 - ids we cannot read are left out, never an error
        return None
    return {"codec_from": start, "codec_ids": values}


def wrap_talker_preprocess(cls: type, writer: TraceWriter, method: str = METHOD) -> bool:
    """Replace ``cls.<method>`` with a tracing wrapper; False if already wrapped or absent.

    The wrapper never changes what the original returns or raises; a failure to trace is reported
    once on stderr and otherwise ignored. It reads no device value back (see the module's docstring).
    """
    original = cls.__dict__.get(method) or getattr(cls, method, None)
    if original is None or not callable(original):
        _warn(f"{cls.__module__}.{cls.__qualname__} has no {method}(); nothing traced")
        return False
    if getattr(original, _MARK, False):
        return False
    failed = []

    @functools.wraps(original)
    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = _clock() if writer.timing else None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        input_embeds = kwargs.get("input_embeds", args[1] if len(args) > 1 else None)
        info = kwargs
        check = writer.check
        ids_before = input_ids.clone() if hasattr(input_ids, "clone") else None
        tagged = _tag(kwargs) if check and writer.row_ids else None
        payload, coded = tagged if tagged is not None else (kwargs, None)
        called = _clock() if started is not None else None
        try:
            result = original(self, *args, **payload)
        except BaseException as exc:
            _safe_record(writer, info, input_ids, None, f"{type(exc).__name__}: {exc}", failed)
            raise
        returned = _clock() if started is not None else None
        parts: list[Deferred] = []
        contract: dict[str, Any] = {}
        for got in ((_check_contract(self, payload, ids_before, result, input_embeds, coded) if check else None),
                    _codec_ids(info, ids_before)):
            if isinstance(got, Deferred):
                parts.append(got)
            elif got:
                contract.update(got)
        if tagged is not None:  # the codes never reach the Talker: the runner copies untagged rows
            from harness.serve.worker_contract import strip_ids_on_device

            result = strip_ids_on_device(result, input_embeds, coded)
        _safe_record(writer, info, input_ids, result, None, failed, contract, parts, started)
        if started is not None and called is not None and returned is not None:
            done = _clock()
            writer.add_cost(tuple((called[k] - started[k]) + (done[k] - returned[k]) for k in range(3)))
        return result

    setattr(traced, _MARK, True)
    setattr(cls, method, traced)
    return True


def _safe_record(writer: TraceWriter, info: dict, input_ids: Any, result: Any, error: str | None, failed: list,
                 contract: dict[str, Any] | None = None, deferred: list[Deferred] | None = None,
                 started: tuple[float, float, float] | None = None) -> None:
    try:
        writer.record(info, input_ids, result, error, contract, deferred, started)
    except Exception as exc:  # noqa: BLE001 - tracing must never break generation
        if not failed:
            failed.append(exc)
            _warn(f"cannot write trace line: {type(exc).__name__}: {exc}")


_installed: dict[str, Any] = {}


def _bind_arm(cls: type, arm: str, directory: str | None) -> None:
    """Binds the arm, and says what ran where (``implementation-<pid>.json``); a failure is loud."""
    try:
        from harness.serve.arm_binding import bind

        info = bind(cls, arm, redirect_helpers=True)
    except Exception as exc:  # noqa: BLE001 - refuse to serve the wrong implementation silently
        _warn(f"cannot bind arm {arm!r}: {type(exc).__name__}: {exc}")
        info = {"pid": os.getpid(), "arm": arm, "error": f"{type(exc).__name__}: {exc}"}

        def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"omni-stress: arm {arm!r} could not be bound in this worker: {info['error']}")

        setattr(cls, os.environ.get("OMNI_STRESS_HOOK") or METHOD, refuse)
    if directory:
        path = os.path.join(directory, f"implementation-{os.getpid()}.json")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(info, sort_keys=True) + "\n")


def install(directory: str | None, target: str = DEFAULT_TARGET, arm: str | None = None, trace: bool = True) -> str:
    """Wrap ``target`` (``module:Class``) now if imported, else when it is; returns what it did.

    ``directory`` None: no trace (only the arm binding); ``arm``: bind it before tracing; ``trace``
    False (level ``off``): bind the arm and say so in ``directory``, wrap nothing."""
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"{ENV_TARGET}: expected 'module:Class', got {target!r}")
    writer = None
    if directory and trace:
        writer = _installed.get(directory)
        if writer is None:
            writer = _installed[directory] = TraceWriter(directory, timing=os.environ.get(ENV_TIMING) == "1")
            atexit.register(writer.flush)  # lines whose values were still on the device

    def wrap(module: ModuleType) -> None:
        cls = getattr(module, class_name, None)
        if cls is None:
            _warn(f"{module_name} has no class {class_name}; nothing traced")
            return
        try:  # the contract's yardstick, before an arm can replace any member
            from harness.serve.worker_contract import capture_release

            capture_release(cls)
        except Exception as exc:  # noqa: BLE001 - never break vLLM's import
            _warn(f"cannot capture {class_name}'s members for the contract: {type(exc).__name__}: {exc}")
        if arm:
            _bind_arm(cls, arm, directory)
        if writer is not None:
            custom = os.environ.get(ENV_WRAPPER)
            if custom:  # a family whose hooks differ (harness.families.qwen3_tts.serve:wrap)
                import importlib

                mod, _, fn = custom.partition(":")
                getattr(importlib.import_module(mod), fn)(cls, writer)
            else:
                wrap_talker_preprocess(cls, writer)

    if module_name in sys.modules:
        wrap(sys.modules[module_name])
        return "wrapped"
    if any(isinstance(f, PostImportHook) and f.fullname == module_name for f in sys.meta_path):
        return "hooked"
    sys.meta_path.insert(0, PostImportHook(module_name, wrap))
    return "hooked"


def register() -> None:
    """vLLM general-plugin entry point: inert unless ``OMNI_STRESS_TRACE`` names a directory or
    ``OMNI_STRESS_ARM`` names an arm; at level ``off`` only the arm is bound."""
    directory = os.environ.get(ENV_DIR) or None
    arm = os.environ.get(ENV_ARM) or None
    level = os.environ.get(ENV_LEVEL)
    if level and level not in LEVELS:
        _warn(f"{ENV_LEVEL}={level!r} is not one of {', '.join(LEVELS)}; tracing at {DEFAULT_LEVEL}")
    trace = trace_level() != "off"
    if directory and os.path.isdir(directory) or os.environ.get(chunk_trace.ENV_CHUNKER_ARM):
        chunk_trace.register(directory if trace and directory and os.path.isdir(directory) else None)
    if not arm and (not directory or not trace):
        return
    if directory and not os.path.isdir(directory):
        _warn(f"{ENV_DIR}={directory!r} is not a directory; tracing disabled")
        directory = None
        if not arm:
            return
    try:
        install(directory, os.environ.get(ENV_TARGET) or DEFAULT_TARGET, arm, trace)
    except Exception as exc:  # noqa: BLE001 - never break vLLM's plugin loading
        _warn(f"cannot install the trace hook: {type(exc).__name__}: {exc}")
