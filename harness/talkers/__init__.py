"""Arms: loading each family's hook implementations, once per process.

An arm names a ``package.module:attr`` (a built-in, a user's plugin) or ``vllm-omni:<source>`` (the
release's own code, ``harness.talkers.upstream``); the run's family says how it becomes an
implementation (``Family.load_arm``). Built-in arms whose module moved keep resolving under their old
path (``harness.moved``), so existing ``arms.yaml`` files and recorded manifests still load.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from harness.config import ArmSpec, check_name
from harness.errors import ConfigError
from harness.moved import current_module


_LOADED: dict[tuple[str, str, str, str], Any] = {}


def load_impl(arm: ArmSpec) -> Any:
    """The arm's implementation, loaded once per process so every cell runs the same code."""
    key = (arm.name, arm.talker, arm.source, arm.family)
    if key not in _LOADED:
        _LOADED[key] = _load(arm)
    return _LOADED[key]


def _importable_from_cwd() -> None:
    """A plugin module in the folder the user runs from imports, as with ``python -m``: the
    ``omni-stress`` script's own folder (the venv's bin) is what Python puts on the path."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def import_target(target: str, where: str) -> Any:
    """``package.module:attr`` imported (the working directory importable): a plugin arm of any family, or
    ``conform``'s. A failure is one line starting with ``where``."""
    module_name, _, attr = target.partition(":")
    module_name = current_module(module_name)
    _importable_from_cwd()
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's module's problem
        raise ConfigError(f"{where}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _load(arm: ArmSpec) -> Any:
    from harness.family import get_family

    return get_family(arm.family, f"arm {arm.name!r} ({arm.source}): family").load_arm(arm)


def resolve_arm(text: str, arms: dict[str, ArmSpec], load: bool = True) -> ArmSpec:
    """``NAME`` from arms.yaml, ``NAME=package.module:attr`` for a plugin arm, or
    ``NAME=vllm-omni:<source>`` for upstream vLLM-Omni code (checked here, before any cell runs;
    ``load=False``: the caller loads it once the run's family, which says what file to read, is known). Here
    and not in ``harness.config``: resolving an upstream arm loads its code, and config stays below
    the arms."""
    if "=" in text:
        name, _, target = text.partition("=")
        if not name or ":" not in target or target == "vllm-omni:":
            raise ConfigError(f"--arm {text!r}: expected NAME, NAME=package.module:attr or NAME=vllm-omni:<source>")
        if (bad := check_name(name)) is not None:
            raise ConfigError(f"--arm {text!r}: arm name {bad}")
        base = arms.get(name)
        upstream = target.startswith("vllm-omni:")
        arm = ArmSpec(name=name, talker=target, description="upstream vLLM-Omni code" if upstream else "plugin arm",
                      source="--arm", serve=base.serve if base else None)
    elif text not in arms:
        known = ", ".join(sorted(arms)) or "none"
        raise ConfigError(f"--arm {text!r}: unknown arm (known: {known}; or use NAME=package.module:attr)")
    else:
        arm = arms[text]
    if load and arm.talker.startswith("vllm-omni:"):  # its code is read and compiled now, before any cell
        load_impl(arm)
    return arm
