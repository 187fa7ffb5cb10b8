"""The models ``omni-stress conform`` checks: one small adapter module each.

Upstream models read their real code from ``--source``; the two built-in Qwen2.5-Omni arms are
the calibration (``main`` must fail, ``pr`` must conform).
"""

from __future__ import annotations

from collections.abc import Callable

from harness.conform.adapter import Adapter


def _qwen25(arm: str) -> Callable[[], Adapter]:
    def make() -> Adapter:
        from harness.conform.models.qwen2_5_omni import Qwen25OmniAdapter

        return Qwen25OmniAdapter(arm)

    return make


def _qwen3_omni() -> Adapter:
    from harness.conform.models.qwen3_omni import Qwen3OmniAdapter

    return Qwen3OmniAdapter()


def _qwen3_tts() -> Adapter:
    from harness.conform.models.qwen3_tts import Qwen3TTSAdapter

    return Qwen3TTSAdapter()


def _minicpmo() -> Adapter:
    from harness.conform.models.minicpmo import MiniCPMoAdapter

    return MiniCPMoAdapter()


def _glm_tts() -> Adapter:
    from harness.conform.models.glm_tts import GLMTTSAdapter

    return GLMTTSAdapter()


def _moss_tts() -> Adapter:
    from harness.conform.models.moss_tts import MossTTSAdapter

    return MossTTSAdapter()


def _fish_speech() -> Adapter:
    from harness.conform.models.fish_speech import FishSpeechAdapter

    return FishSpeechAdapter()


def _gepard() -> Adapter:
    from harness.conform.models.gepard import GepardAdapter

    return GepardAdapter()


MODELS: dict[str, Callable[[], Adapter]] = {
    "qwen2.5-omni": _qwen25("upstream"),
    "qwen3-omni": _qwen3_omni,
    "qwen3-tts": _qwen3_tts,
    "minicpmo-4.5": _minicpmo,
    "glm-tts": _glm_tts,
    "moss-tts": _moss_tts,
    "fish-speech": _fish_speech,
    "gepard": _gepard,
    "qwen2.5-omni:main": _qwen25("main"),
    "qwen2.5-omni:pr": _qwen25("pr"),
}
UPSTREAM_MODELS = ("qwen2.5-omni", "qwen3-omni", "qwen3-tts", "minicpmo-4.5", "glm-tts", "moss-tts", "fish-speech",
                   "gepard")


def resolve_model(name: str) -> Callable[[], Adapter] | None:
    """A known model, or ``MODEL:package.module:attr``: a plugin arm for an upstream model (None: unknown).
    For Qwen2.5-Omni the plugin is an arm as ``run``/``gate`` take it; for the others, a class whose methods
    replace the release's methods of the same name (at least the hook)."""
    if name in MODELS:
        return MODELS[name]
    base, _, target = name.partition(":")
    if base not in UPSTREAM_MODELS or ":" not in target:
        return None
    if base == "qwen2.5-omni":
        def make_q25() -> Adapter:
            from harness.conform.models.qwen2_5_omni import Qwen25OmniAdapter

            return Qwen25OmniAdapter("plugin", target)

        return make_q25

    def make() -> Adapter:
        adapter = MODELS[base]()
        adapter.plugin, adapter.name, adapter.title = target, name, f"{adapter.title}, plugin arm {target}"
        return adapter

    return make
CALIBRATION = {"qwen2.5-omni:main": "fails", "qwen2.5-omni:pr": "conforms"}
