"""Modules that moved, by their old dotted path: an ``arms.yaml`` entry or a recorded manifest naming the
old path still imports (the sim's arm loader and the Talker worker both ask ``current_module``)."""

from __future__ import annotations

# issue 46: Qwen2.5-Omni's built-in arms and their shared helpers moved into its family's package
MOVED_MODULES = {
    "harness.talkers.main": "harness.families.qwen2_5_omni.main",
    "harness.talkers.pr": "harness.families.qwen2_5_omni.pr",
    "harness.talkers.qwen2_5_omni": "harness.families.qwen2_5_omni.helpers",
}


def current_module(name: str) -> str:
    return MOVED_MODULES.get(name, name)
