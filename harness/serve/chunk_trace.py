"""Traces every chunk the Talker's connector sends Code2Wav (``async_chunk: true``), inside the Talker worker.

Why at the connector: a streamed request's audio is only as right as the codec windows Code2Wav is
handed; a chunk with a dropped, repeated or foreign frame plays as a click or a wrong syllable that no
WER on the Talker's codec stream would show. The release builds each window in its stage input
processor (0.30.0: ``vllm_omni.model_executor.stage_input_processors.qwen3_tts.talker2code2wav_async_chunk``,
named by the family's ``CHUNKER``); the worker's connector runtime resolves that function by its
import path when the model runner starts (``omni_connector_runtime._load_custom_func``), and MRV2's
batched peer calls it by its module global. So the module attribute is replaced as soon as the module
is imported (a post-import hook, as ``harness.serve.trace_plugin`` does for the Talker class), before
anything can hold the original, and every path goes through the wrapper.

One JSON line per payload the function returns (``None``: nothing sent, no line), appended to
``<dir>/chunks-<pid>.jsonl``: ``request_id`` (the engine's, as the Talker's trace lines name it),
``external_req_id``, ``seq`` (this process's call counter), ``frames`` (codebook 0 of each frame the
payload carries, in order, left context included), ``left_context`` (``meta.left_context_size``),
``finished``, ``quantizers``, ``time``. ``harness.chunk_contract`` checks them against the request's codec
stream.

``OMNI_STRESS_CHUNKER_ARM=package.module:attr``: an arm's chunker, called in place of the release's with
the same arguments (``ArmSpec.chunker``; the tests' corrupting chunkers). Only the standard library at
import: this runs inside the arm's environment.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import threading
import time
from typing import Any

from harness.serve.importhook import resolve

ENV_CHUNKER = "OMNI_STRESS_CHUNKER"  # module:function, the family's connector chunker (set only when it streams)
ENV_CHUNKER_ARM = "OMNI_STRESS_CHUNKER_ARM"  # module:attr, an arm's chunker called in its place
CHUNK_GLOB = "chunks-*.jsonl"
_MARK = "__omni_stress_chunks__"
_RELEASE: dict[str, Any] = {}  # function name -> the release's own, before the wrapper took its place


def _warn(msg: str) -> None:
    sys.stderr.write(f"[omni-stress chunk trace pid={os.getpid()}] {msg}\n")


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _scalar(value: Any) -> Any:
    if value is None:
        return None
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "numel", lambda: 1)() == 1:
        return item()
    return value


def payload_line(payload: Any, request: Any, transfer_manager: Any) -> dict[str, Any]:
    """The line for one payload (module docstring); pure over the objects (a test builds them by hand)."""
    codes = _get(_get(payload, "codes"), "audio")
    meta = _get(payload, "meta")
    external = getattr(request, "external_req_id", None)
    flat = [int(v) for v in codes.reshape(-1).tolist()] if codes is not None else []
    quantizers = None
    held = getattr(transfer_manager, "code_prompt_token_ids", None)
    frames_held = held.get(external) if isinstance(held, dict) else None
    if frames_held:  # one frame's codes: Q values (Qwen3-TTS: a list or [Q]; Qwen3-Omni: a [1, Q] tensor)
        last = frames_held[-1]
        quantizers = int(last.numel()) if hasattr(last, "numel") else len(last)
    frames = flat[: len(flat) // quantizers] if quantizers else flat
    left = _scalar(_get(meta, "left_context_size"))
    finished = _scalar(_get(meta, "finished"))
    return {"request_id": getattr(request, "request_id", external), "external_req_id": external,
            "frames": frames, "left_context": None if left is None else int(left),
            "finished": None if finished is None else bool(finished), "quantizers": quantizers,
            "values": len(flat)}


class ChunkWriter:
    """Appends lines to ``chunks-<pid>.jsonl`` (opened per process: a fork gets its own file)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._pid = -1
        self._fh: Any = None

    def write(self, line: dict[str, Any]) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._fh = open(os.path.join(self.directory, f"chunks-{self._pid}.jsonl"), "a", encoding="utf-8")
            line = {**line, "seq": next(self._seq), "pid": self._pid, "time": time.time()}
            self._fh.write(json.dumps(line, sort_keys=True) + "\n")
            self._fh.flush()


def wrap_chunker(module: Any, name: str, writer: ChunkWriter | None, arm: str | None) -> bool:
    """Replace ``module.name`` with the traced (and, with ``arm``, replaced) chunker; False if absent."""
    original = getattr(module, name, None)
    if original is None or getattr(original, _MARK, False):
        return False
    _RELEASE[name] = original
    impl = original
    if arm:
        try:
            impl = resolve(arm, ENV_CHUNKER_ARM)
        except Exception as exc:  # noqa: BLE001 - refuse to stream through the wrong chunker silently
            why = f"{type(exc).__name__}: {exc}"
            _warn(f"cannot bind chunker {arm!r}: {why}")

            def impl(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(f"omni-stress: chunker {arm!r} could not be bound in this worker: {why}")

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        payload = impl(*args, **kwargs)
        if writer is not None and payload is not None:
            request = kwargs.get("request", args[2] if len(args) > 2 else None)
            manager = kwargs.get("transfer_manager", args[0] if args else None)
            try:
                writer.write(payload_line(payload, request, manager))
            except Exception as exc:  # noqa: BLE001 - the trace never breaks the stream it watches
                _warn(f"cannot write chunk line: {type(exc).__name__}: {exc}")
        return payload

    setattr(traced, _MARK, True)
    setattr(module, name, traced)
    return True


def release_chunker(name: str = "talker2code2wav_async_chunk") -> Any:
    """The release's window builder an arm's chunker may call (the module attribute is the wrapper)."""
    return _RELEASE[name]


def install(directory: str | None, chunker: str, arm: str | None = None) -> str:
    """Wrap ``chunker`` (``module:function``) now if imported, else when it is."""
    from harness.serve.importhook import PostImportHook

    module_name, _, name = chunker.partition(":")
    if not module_name or not name:
        raise ValueError(f"{ENV_CHUNKER}: expected 'module:function', got {chunker!r}")
    writer = ChunkWriter(directory) if directory else None

    def wrap(module: Any) -> None:
        if not wrap_chunker(module, name, writer, arm):
            _warn(f"{module_name} has no function {name}; no chunk traced")

    if module_name in sys.modules:
        wrap(sys.modules[module_name])
        return "wrapped"
    sys.meta_path.insert(0, PostImportHook(module_name, wrap))
    return "hooked"


def register(directory: str | None) -> None:
    """Called by the trace plugin in every process: inert unless ``OMNI_STRESS_CHUNKER`` is set."""
    chunker = os.environ.get(ENV_CHUNKER)
    if not chunker:
        return
    try:
        install(directory, chunker, os.environ.get(ENV_CHUNKER_ARM) or None)
    except Exception as exc:  # noqa: BLE001 - never break vLLM's plugin loading
        _warn(f"cannot install the chunk trace: {type(exc).__name__}: {exc}")
