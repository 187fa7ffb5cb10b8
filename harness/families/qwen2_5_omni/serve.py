"""Qwen2.5-Omni on the real server (``--backend vllm-omni``): the chat path.

``vllm serve --omni`` with the deploy as ``--stage-overrides`` (``harness.serve.deploy_args``), one
``POST /v1/chat/completions`` per prompt with text and audio out (``harness.serve.client``), trace lines
filed by the chat tag the request carries, and the speaking checkpoint's codec stream read back by
this family's speaking rules. The trace plugin's default target and wrapper are this family's Talker
and ``talker_preprocess``, so the worker's environment needs nothing more.
"""

from __future__ import annotations

from typing import Any

BY_TEXT = False  # trace lines name their request by the chat tag in the prompt, not by its text


def translate(deploy: Any, platform: str, speaking: bool) -> Any:
    from harness.serve.deploy_args import translate_deploy

    return translate_deploy(deploy, platform, speaking)


def request_body(model: str, prompts: Any, prompt: Any, deploy: Any, tag: str, speaking: bool,
                 stream: bool) -> dict[str, Any]:
    from harness.serve.client import build_body

    return build_body(model, prompts, prompt, deploy, tag, speaking, stream)


def oracle(codes: list[int]) -> str:
    """The speaking tiny Qwen2.5-Omni's codec stream read back (``speaking.decode``)."""
    from harness.families.qwen2_5_omni.speaking import decode

    return decode(codes).text


def server_env() -> dict[str, str]:
    return {}
