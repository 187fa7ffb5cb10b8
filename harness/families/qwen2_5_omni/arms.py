"""Qwen2.5-Omni arms: implementations of ``talker_preprocess(input_ids, input_embeds, **info)``.

* ``package.module:attr`` (``main``, ``pr``, a user's plugin): a class with a ``talker_preprocess``
  method, or a function with the same signature plus ``self``; bound onto the sim's stand-in model
  (``harness.families.qwen2_5_omni.model``) and, on the real server, onto vLLM-Omni's own class.
* ``vllm-omni:<source>``: the release's own ``talker_preprocess`` and every method it reaches, read
  from a file, checkout, wheel or version (a shipped release's vendored copy when neither installed nor cached)
  and compiled unchanged (``harness.talkers.upstream``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.config import ArmSpec
from harness.errors import ConfigError
from harness.talkers import import_target
from harness.talkers.release import read_model_source
from harness.talkers.upstream import MEMBER, PREFIX, build_mixin, is_upstream_spec


def load_upstream(arm: ArmSpec, wheel_dir: Path | None = None) -> type:
    """The mixin for an arm whose ``talker`` is ``vllm-omni:<source>``.

    A relative source in an arms file resolves against that file's folder; one given with
    ``--arm`` against the working directory.
    """
    from harness.families.qwen2_5_omni.model import SimTalkerModelBase
    from harness.sim.hooks import RUNNER_HOOKS

    spec = arm.talker[len(PREFIX):] if is_upstream_spec(arm.talker) else arm.talker
    arms_file = Path(arm.source)
    base = arms_file.parent if arm.source not in ("--arm", "builtin") and arms_file.is_file() else Path.cwd()
    try:
        # a version neither installed nor cached: the vendored copy (0.30.0, 0.32.0rc1), offline
        source = read_model_source(spec, MEMBER, base, wheel_dir)
        return build_mixin(source, SimTalkerModelBase, optional=RUNNER_HOOKS)
    except ConfigError as exc:
        raise ConfigError(f"arm {arm.name!r} (from {arm.source}): {exc}") from None


def load_arm(arm: ArmSpec) -> Any:
    """The implementation of a Qwen2.5-Omni arm (``Family.load_arm``)."""
    if arm.talker.startswith(PREFIX):  # the real upstream code, extracted from its source
        return load_upstream(arm)
    where = f"arm {arm.name!r} ({arm.talker}, from {arm.source})"
    obj = import_target(arm.talker, where)
    attr = arm.talker.partition(":")[2]
    if isinstance(obj, type):
        if not callable(getattr(obj, "talker_preprocess", None)):
            raise ConfigError(f"{where}: class {attr!r} has no talker_preprocess method")
    elif not callable(obj):
        raise ConfigError(f"{where}: {attr!r} is not callable")
    return obj
