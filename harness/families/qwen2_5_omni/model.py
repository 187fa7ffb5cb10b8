"""A stand-in for ``Qwen2_5OmniForConditionalGeneration`` (talker stage) built from sim rows.

It provides exactly what the upstream ``talker_preprocess`` and its helpers touch, with the
sim's deterministic rows: ``talker.embed_input_ids`` (the codec table), ``talker.config``,
``talker_config`` token ids, the special text/codec embeddings, ``voice_type`` and the
model-level ``thinker_reply_part`` pool. An arm's class (or function) is bound onto it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from harness.sim.codec import CODEC_BOS, CODEC_EOS, CODEC_MASK, CODEC_PAD
from harness.sim.rows import DIM, RowSpace

VOICE = "Chelsie"  # upstream forward() default voice_type
TTS_TEXT_START, TTS_TEXT_END, TTS_TEXT_PAD = 151860, 151861, 151859
SPK_TOKEN_IDS = {"m02": 151870, "Ethan": 151870, "f030": 151872, "Chelsie": 151872, "prefix_caching": 151870}


@dataclass(frozen=True)
class TalkerHFConfig:
    """The Qwen2.5-Omni talker config ids the preprocess reads."""

    hidden_size: int = DIM
    tts_text_start_token_id: int = TTS_TEXT_START
    tts_text_end_token_id: int = TTS_TEXT_END
    tts_text_pad_token_id: int = TTS_TEXT_PAD
    tts_codec_start_token_id: int = CODEC_BOS
    tts_codec_end_token_id: int = CODEC_EOS
    tts_codec_pad_token_id: int = CODEC_PAD
    tts_codec_mask_token_id: int = CODEC_MASK


class _TalkerModule:
    EMBEDS_CODEC_TABLE = True  # the runner may read ids' rows from the table directly (harness.sim.runner)

    def __init__(self, space: RowSpace) -> None:
        self.config = TalkerHFConfig()
        self._space = space

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._space.embed_codec(input_ids)


class SimTalkerModelBase:
    """Model-level state of the talker stage; arms add ``talker_preprocess``."""

    @classmethod
    def omni_stress_probe(cls) -> SimTalkerModelBase:
        """An instance for ``build_mixin`` to read its attributes from."""
        return cls(RowSpace(0))

    def __init__(self, space: RowSpace) -> None:
        self.talker = _TalkerModule(space)
        self.model = self.talker
        self.talker_config = TalkerHFConfig()
        self.voice_type = VOICE
        self.tts_text_spk_token_ids = dict(SPK_TOKEN_IDS)
        # Special text rows are shared by all requests (request=None), one per token id.
        rows: dict[str, torch.Tensor] = {}
        for kind in ("text_bos", "text_eos", "text_pad"):
            r, _ = space.make(kind, [None], None)
            rows[kind] = r
        spk_rows: dict[int, torch.Tensor] = {}
        for tid in sorted(set(SPK_TOKEN_IDS.values())):
            r, _ = space.make(f"spk:{tid}", [None], None)
            spk_rows[tid] = r
        self.embed_text_bos_token = rows["text_bos"]
        self.embed_text_eos_token = rows["text_eos"]
        self.embed_text_pad_token = rows["text_pad"]
        self.embed_text_spk_tokens = {k: spk_rows[v] for k, v in SPK_TOKEN_IDS.items()}
        ids = torch.tensor([CODEC_BOS, CODEC_EOS, CODEC_PAD])
        self.embed_codec_bos_token, self.embed_codec_eos_token, self.embed_codec_pad_token = (
            e.unsqueeze(0) for e in space.embed_codec(ids)
        )
        self.thinker_reply_part = torch.zeros(0, DIM)

    def profile_run(self, num_tokens: int) -> None:
        """What upstream ``forward`` does on the profile run (``input_ids is None``)."""
        self.thinker_reply_part = torch.zeros(num_tokens, DIM)

    @staticmethod
    def _module_device(module: Any) -> torch.device:
        return torch.device("cpu")


def bind_arm(impl: type | Callable[..., Any], space: RowSpace) -> SimTalkerModelBase:
    """A fresh model instance whose ``talker_preprocess`` is the arm's.

    ``impl`` is a class providing ``talker_preprocess`` (mixed in before the base, as a method
    of the upstream class would be), or a plain function ``f(self, input_ids, input_embeds,
    **info)`` bound as that method.
    """
    if isinstance(impl, type):
        cls = type(f"Sim{impl.__name__}", (impl, SimTalkerModelBase), {})
        if not callable(getattr(cls, "talker_preprocess", None)):
            raise TypeError(f"{impl.__module__}.{impl.__qualname__} has no talker_preprocess method")
        model = cls.__new__(cls)
        SimTalkerModelBase.__init__(model, space)
        return model
    model = SimTalkerModelBase(space)
    model.talker_preprocess = types.MethodType(impl, model)  # type: ignore[attr-defined]
    return model
