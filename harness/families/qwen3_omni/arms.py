"""Qwen3-Omni arms: the release's own ``talker_preprocess``, the fix, plugins.

* ``vllm-omni:SOURCE`` (``omni3-0.30.0``, ``omni3-0.32.0rc1`` in ``deploy_configs/arms.yaml``): the
  release's ``qwen3_omni.py`` (an installed, cached, vendored or given file, checkout or wheel), its
  ``talker_preprocess`` and every method it reaches compiled unchanged by
  ``harness.talkers.upstream.build_mixin`` onto the sim's stand-in
  (``harness.families.qwen3_omni.sim.Qwen3OmniSimModel``), as ``omni-stress conform`` compiles them. From
  0.32.0rc1 the prefill imports ``spoken_span_end`` from ``tool_speech.py``: compiled from the same release.
* ``package.module:attr`` (``omni3-fix``, a user's plugin): a class whose methods replace the release's
  methods of the same name, over vLLM-Omni 0.30.0's (the vendored copy), as a class bound into the real
  server would be. A function is taken as ``talker_preprocess``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.config import ArmSpec
from harness.errors import ConfigError

MEMBER = "vllm_omni/model_executor/models/qwen3_omni/qwen3_omni.py"
CLASS_NAME = "Qwen3OmniMoeForConditionalGeneration"
MODULE_NAME = "vllm_omni.model_executor.models.qwen3_omni.qwen3_omni"
ENTRIES = ("talker_preprocess",)
TOOL_SPEECH_MEMBER = "vllm_omni/model_executor/models/qwen3_omni/tool_speech.py"
TOOL_SPEECH_MODULE = "vllm_omni.model_executor.models.qwen3_omni.tool_speech"
TOOL_SPEECH_FUNCTIONS = ("spoken_span_end", "tool_call_start_offset")
PLUGIN_BASE = "0.30.0"  # the release a plugin arm's class is laid over

_RELEASES: dict[tuple[str, str], type] = {}


def _tool_speech_shims(spec: str, base_dir: Path | None) -> dict[tuple[str, str], Any]:
    """``tool_speech``'s functions from the same release, where the release has that file (0.32.0rc1+)."""
    from harness.talkers.release import read_model_source
    from harness.talkers.upstream import build_functions

    try:
        src = read_model_source(spec, TOOL_SPEECH_MEMBER, base_dir)
    except ConfigError:
        return {}
    if src.kind == "file":  # a single qwen3_omni.py was given: no sibling file to read
        return {}
    funcs = build_functions(src, TOOL_SPEECH_FUNCTIONS, module_name=TOOL_SPEECH_MODULE)
    return {(TOOL_SPEECH_MODULE, k): funcs[k] for k in TOOL_SPEECH_FUNCTIONS}


def release_mixin(spec: str, base_dir: Path | None = None) -> type:
    """The release's hook named by ``vllm-omni:<spec>``, compiled onto the sim's stand-in (once per process)."""
    key = (spec, str(base_dir))
    if key not in _RELEASES:
        from harness.families.qwen3_omni.sim import Qwen3OmniSimModel
        from harness.sim.hooks import RUNNER_HOOKS
        from harness.talkers.release import RELEASE_SHIMS, read_model_source
        from harness.talkers.upstream import build_mixin

        source = read_model_source(spec, MEMBER, base_dir)
        shims = {**RELEASE_SHIMS, **_tool_speech_shims(spec, base_dir)}
        _RELEASES[key] = build_mixin(source, Qwen3OmniSimModel, class_name=CLASS_NAME, entries=ENTRIES,
                                     module_name=MODULE_NAME, shims=shims, optional=RUNNER_HOOKS)
    return _RELEASES[key]


def load_arm(arm: ArmSpec) -> Any:
    """The implementation of a Qwen3-Omni arm (``harness.family.Family.load_arm``)."""
    from harness.talkers.release import release_or_plugin

    return release_or_plugin(arm, "talker_preprocess", "qwen3-omni", release_mixin, PLUGIN_BASE)
