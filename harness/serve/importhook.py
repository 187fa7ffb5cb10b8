"""Run a callback right after a module is imported, by any importer (a ``sys.meta_path`` finder).

Why a module of its own: the trace plugin wraps the Talker class and the connector's window builder the
moment their modules load, before vLLM can hold the originals (``harness.serve.trace_plugin``,
``harness.serve.chunk_trace``). Only the standard library: it runs inside the arm's own environment.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def resolve(spec: str, what: str) -> Any:
    """``package.module:attr`` imported inside a worker (an arm bound into the Talker, an arm's chunker): the
    folder the server runs from importable, as the sim imports a plugin arm there, and a moved module path
    followed (``harness.moved``). A malformed spec is a ValueError naming ``what``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what}: expected 'package.module:attr', got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    from harness.moved import current_module

    obj: Any = importlib.import_module(current_module(module_name))
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _warn(msg: str) -> None:
    try:
        sys.stderr.write(f"[omni-stress trace] {msg}\n")
    except Exception:  # noqa: BLE001, S110 - a broken stderr must not break the server
        pass


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
