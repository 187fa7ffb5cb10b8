"""Qwen3-TTS arms: the release's own ``preprocess`` / ``preprocess_decode_batch``, the fix, plugins.

* ``vllm-omni:SOURCE`` (``tts-0.30.0``, ``tts-0.32.0rc1`` in ``deploy_configs/arms.yaml``): the
  release's ``qwen3_tts_talker.py`` (an installed, cached, vendored or given file, checkout or
  wheel; ``harness.conform.adapter.read_model_source``), its hooks and every method they reach
  compiled unchanged by ``harness.talkers.upstream.build_mixin`` onto the sim's stand-in
  (``harness.families.qwen3_tts.sim.Qwen3TTSSimModel``), as ``omni-stress conform`` compiles them.
* ``package.module:attr`` (``tts-fix``, a user's plugin): a class whose methods replace the
  release's methods of the same name, over vLLM-Omni 0.30.0's (the vendored copy), as a class bound
  into the real server would be: a plugin that defines only ``preprocess`` still runs the release's
  ``preprocess_decode_batch`` for one-token decode spans. A function is taken as ``preprocess``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.config import ArmSpec

MEMBER = "vllm_omni/model_executor/models/qwen3_tts/qwen3_tts_talker.py"
CLASS_NAME = "Qwen3TTSTalkerForConditionalGeneration"
MODULE_NAME = "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker"
ENTRIES = ("preprocess", "preprocess_decode_batch")  # and the runners' other hooks it defines (RUNNER_HOOKS)
PLUGIN_BASE = "0.30.0"  # the release a plugin arm's class is laid over

_RELEASES: dict[tuple[str, str], type] = {}


def release_mixin(spec: str, base_dir: Path | None = None) -> type:
    """The release's hooks named by ``vllm-omni:<spec>``, compiled onto the sim's stand-in (once per process)."""
    key = (spec, str(base_dir))
    if key not in _RELEASES:
        from harness.talkers.release import RELEASE_SHIMS, read_model_source
        from harness.families.qwen3_tts.sim import Qwen3TTSSimModel
        from harness.sim.hooks import RUNNER_HOOKS
        from harness.talkers.upstream import build_mixin

        source = read_model_source(spec, MEMBER, base_dir)
        _RELEASES[key] = build_mixin(source, Qwen3TTSSimModel, class_name=CLASS_NAME, entries=ENTRIES,
                                     module_name=MODULE_NAME, shims=RELEASE_SHIMS, optional=RUNNER_HOOKS)
    return _RELEASES[key]


def load_arm(arm: ArmSpec) -> Any:
    """The implementation of a Qwen3-TTS arm (``harness.family.Family.load_arm``)."""
    from harness.talkers.release import release_or_plugin

    return release_or_plugin(arm, "preprocess", "qwen3-tts", release_mixin, PLUGIN_BASE)
