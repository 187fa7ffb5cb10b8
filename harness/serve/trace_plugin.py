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

Two more jobs, both in the Talker worker and both off unless the launcher asks:

* ``OMNI_STRESS_ARM=package.module:attr``: the arm's ``talker_preprocess`` is bound onto the class
  first (``harness.serve.arm_binding``), so the trace wraps the arm; what ran is written to
  ``<dir>/implementation-<pid>.json``.
* The contract check (on while tracing; ``OMNI_STRESS_CONTRACT=0`` turns it off): each line also
  carries ``misaligned_text``/``misaligned_end``, the positions whose delivered row differs from the
  contract's (``harness.serve.worker_contract``), or ``contract_error`` when the payload could not
  give the expected rows. It imports torch lazily, only inside the worker's calls. With
  ``OMNI_STRESS_ROW_IDS=1`` (the speaking checkpoint) the arm gets Thinker rows carrying identity codes
  and the check compares identities; the codes are zeroed before the runner copies the rows
  (``worker_contract.tag_payload`` / ``strip_ids``).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

ENV_DIR = "OMNI_STRESS_TRACE"
ENV_TARGET = "OMNI_STRESS_TRACE_TARGET"
ENV_ARM = "OMNI_STRESS_ARM"
ENV_CONTRACT = "OMNI_STRESS_CONTRACT"
ENV_ROW_IDS = "OMNI_STRESS_ROW_IDS"  # "1": identity-coded Thinker rows (harness.serve.worker_contract)
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
CONTRACT_KEYS = ("misaligned_text", "misaligned_end", "first_misaligned", "contract_error")  # the contract check
CODEC_KEYS = ("codec_from", "codec_ids")  # the span's input ids at generated positions (the Talker's codec stream)
_MARK = "__omni_stress_traced__"


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


class TraceWriter:
    """Appends one line per call to ``<dir>/trace-<pid>.jsonl`` with one ``write`` (O_APPEND), so lines never interleave."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid: int | None = None
        self._seq = 0
        self._step = 0
        self._step_requests: set[str] = set()
        self._last_offset: int | None = None

    def _open(self) -> int:
        pid = os.getpid()
        if self._fd is None or self._pid != pid:  # reopen after fork: one file per process
            path = os.path.join(self.directory, f"trace-{pid}.jsonl")
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._pid = pid
            self._seq = 0
            self._step = 0
            self._step_requests = set()
            self._last_offset = None
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
               contract: dict[str, Any] | None = None) -> dict[str, Any]:
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
        with self._lock:
            fd = self._open()
            step = self._advance_step(request_id, offset)
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
            os.write(fd, (json.dumps(line, sort_keys=True) + "\n").encode("utf-8"))
        return line


def _contract_enabled() -> bool:
    return os.environ.get(ENV_CONTRACT, "1") != "0"


def _row_ids_enabled() -> bool:
    return os.environ.get(ENV_ROW_IDS, "0") == "1"


def _tag(info: dict) -> dict | None:
    """The payload with identity-coded Thinker rows (``worker_contract.tag_payload``), or None."""
    try:
        from harness.serve.worker_contract import tag_payload

        return tag_payload(info)
    except Exception as exc:  # noqa: BLE001 - untagged rows are still compared by value
        _warn(f"cannot tag rows: {type(exc).__name__}: {exc}")
        return None


def _check_contract(model: Any, info: dict, ids_before: Any, result: Any, embeds_after: Any,
                    row_ids: bool = False) -> dict[str, Any] | None:
    if ids_before is None or not (isinstance(result, tuple) and len(result) >= 2):
        return None
    try:
        from harness.serve.worker_contract import count_misaligned

        return count_misaligned(model, info, ids_before, result, embeds_after, row_ids)
    except Exception as exc:  # noqa: BLE001 - the check must never break generation
        return {"contract_error": f"{type(exc).__name__}: {exc}"}


def _codec_ids(info: dict, ids: Any) -> dict[str, Any] | None:
    """The ids the runner scheduled at positions ``>= P`` of this span: position ``P + g`` holds the
    Talker's generated codec token ``g`` (the one sampled from position ``P - 1 + g``), so the spans
    of a request, by position, give its codec stream (all of it but the final EOS, which is never
    fed back). Read before the arm runs (an arm may overwrite its ids)."""
    P, c = _as_int(info.get("_omni_prompt_len")), _as_int(info.get("_omni_num_computed_tokens"))
    n = _first_dim(ids)
    if P is None or c is None or n is None or c + n <= P:
        return None
    start = max(c, P)
    try:
        values = [int(v) for v in ids[start - c:].tolist()]
    except Exception:  # noqa: BLE001 - ids we cannot read are left out, never an error
        return None
    return {"codec_from": start, "codec_ids": values}


def wrap_talker_preprocess(cls: type, writer: TraceWriter, method: str = METHOD) -> bool:
    """Replace ``cls.<method>`` with a tracing wrapper; False if already wrapped or absent.

    The wrapper never changes what the original returns or raises; a failure to trace is reported
    once on stderr and otherwise ignored.
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
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        input_embeds = kwargs.get("input_embeds", args[1] if len(args) > 1 else None)
        info = kwargs
        check = _contract_enabled()
        ids_before = input_ids.clone() if hasattr(input_ids, "clone") else None
        tagged = _tag(kwargs) if check and _row_ids_enabled() else None
        try:
            result = original(self, *args, **(tagged if tagged is not None else kwargs))
        except BaseException as exc:
            _safe_record(writer, info, input_ids, None, f"{type(exc).__name__}: {exc}", failed)
            raise
        contract = _check_contract(self, tagged if tagged is not None else info, ids_before, result, input_embeds,
                                   tagged is not None) if check else None
        if tagged is not None:  # the codes never reach the Talker: the runner copies untagged rows
            from harness.serve.worker_contract import strip_ids

            result = strip_ids(result, input_embeds)
        codec = _codec_ids(info, ids_before)
        if codec:
            contract = {**(contract or {}), **codec}
        _safe_record(writer, info, input_ids, result, None, failed, contract)
        return result

    setattr(traced, _MARK, True)
    setattr(cls, method, traced)
    return True


def _safe_record(writer: TraceWriter, info: dict, input_ids: Any, result: Any, error: str | None, failed: list,
                 contract: dict[str, Any] | None = None) -> None:
    try:
        writer.record(info, input_ids, result, error, contract)
    except Exception as exc:  # noqa: BLE001 - tracing must never break generation
        if not failed:
            failed.append(exc)
            _warn(f"cannot write trace line: {type(exc).__name__}: {exc}")


class _WrappingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then calls ``callback(module)`` once the module has executed."""

    def __init__(self, loader: Any, callback: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


class PostImportHook(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``fullname`` is imported (by any importer)."""

    def __init__(self, fullname: str, callback: Callable[[ModuleType], None]) -> None:
        self.fullname = fullname
        self.callback = callback
        self._busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.fullname or self._busy:
            return None
        self._busy = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy = False
        if spec.loader is None:
            return spec
        spec.loader = _WrappingLoader(spec.loader, self._fire)
        return spec

    def _fire(self, module: ModuleType) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            self.callback(module)
        except Exception as exc:  # noqa: BLE001
            _warn(f"wrapping {self.fullname} failed: {type(exc).__name__}: {exc}")


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

        setattr(cls, METHOD, refuse)
    if directory:
        path = os.path.join(directory, f"implementation-{os.getpid()}.json")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(info, sort_keys=True) + "\n")


def install(directory: str | None, target: str = DEFAULT_TARGET, arm: str | None = None) -> str:
    """Wrap ``target`` (``module:Class``) now if imported, else when it is; returns what it did.

    ``directory`` None: no trace (only the arm binding); ``arm``: bind it before tracing."""
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"{ENV_TARGET}: expected 'module:Class', got {target!r}")
    writer = None
    if directory:
        writer = _installed.get(directory)
        if writer is None:
            writer = _installed[directory] = TraceWriter(directory)

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
    ``OMNI_STRESS_ARM`` names an arm."""
    directory = os.environ.get(ENV_DIR) or None
    arm = os.environ.get(ENV_ARM) or None
    if not directory and not arm:
        return
    if directory and not os.path.isdir(directory):
        _warn(f"{ENV_DIR}={directory!r} is not a directory; tracing disabled")
        directory = None
        if not arm:
            return
    try:
        install(directory, os.environ.get(ENV_TARGET) or DEFAULT_TARGET, arm)
    except Exception as exc:  # noqa: BLE001 - never break vLLM's plugin loading
        _warn(f"cannot install the trace hook: {type(exc).__name__}: {exc}")
