"""MOSS-TTS's AR talker (stage 0, ``MossTTSDelayModel``), from the real upstream code (upstream issue #5018's list).

Hook: ``MossTTSDelayTalkerForGeneration.preprocess`` in
``vllm_omni/model_executor/models/moss_tts/modeling_moss_tts_talker.py`` (0.30.0 and 0.32.0rc1: l.410), with the
``_initial_state`` / ``_advance_state`` state machine it reaches. A span of ``n > 1`` (or the first call) is a
prefill: text embeddings plus, where the request carries reference-audio codes (``codes.ref``, one row of
``n_vq`` codes per prompt position), their summed audio embeddings, sliced at ``ref_offset``, a counter the hook
advances by each prefill span's length. A one-token span after the first call is a decode: the id's text embedding
plus the audio embedding of ``audio_codes.current``, the frame the model sampled at the previous step.

Payload: ``codes.ref`` for every prompt position (deterministic codes). The previous step's frame is model
output, not under test: the driver stores a fixed frame per position in ``audio_codes.current`` before each call
at or past ``P`` (``deliver``), as the model's sampling would, so every schedule sees the same frames.

Stand-in (``MossTTSStandIn``): ``model.embed_tokens``, ``_stacked_audio_emb_w`` (``n_vq = 4`` tables of 1025
rows), ``audio_pad_code`` and the audio special ids. Not ``SupportsMultiModal``: under V1 the span starts from the
runner's stale buffer rows.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.conform.adapter import Adapter, ConformRequest, fixed_tokens, tagged
from harness.conform.reach import ModelDeploys

HIDDEN = 64
TABLE = 4096
N_VQ = 4
AUDIO_VOCAB = 1024
AUDIO_START, AUDIO_END, GEN_SLOT, DELAY_SLOT = 3001, 3002, 3003, 3004


class _Model:
    def __init__(self) -> None:
        self.weight = tagged(TABLE, HIDDEN, "moss-tts", "embed_tokens")

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids.long().clamp(0, TABLE - 1)]


class MossTTSStandIn:
    """What ``MossTTSDelayTalkerForGeneration.preprocess`` touches."""

    _shared: dict[str, Any] = {}

    def __init__(self) -> None:
        if not self._shared:
            MossTTSStandIn._shared.update(model=_Model(), stacked=tagged(N_VQ * (AUDIO_VOCAB + 1), HIDDEN, "moss-tts",
                                                                         "audio").view(N_VQ, AUDIO_VOCAB + 1, HIDDEN))
        self.model = self._shared["model"]
        self._stacked_audio_emb_w = self._shared["stacked"]
        self.audio_embeddings: list[Any] = []
        self.n_vq = N_VQ
        self.audio_vocab_size = AUDIO_VOCAB
        self.audio_pad_code = AUDIO_VOCAB
        self.audio_start_token_id = AUDIO_START
        self.audio_end_token_id = AUDIO_END
        self.audio_assistant_gen_slot_token_id = GEN_SLOT
        self.audio_assistant_delay_slot_token_id = DELAY_SLOT

    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)


def _codes(tag: str, count: int) -> torch.Tensor:
    return torch.tensor(fixed_tokens(tag, count * N_VQ, AUDIO_VOCAB), dtype=torch.long).view(count, N_VQ)


class MossTTSAdapter(Adapter):
    name = "moss-tts"
    title = "MOSS-TTS AR talker (MossTTSDelayModel)"
    # the deploys that run MossTTSDelayModel (their header comments): stage 0 is its talker
    deploys = ModelDeploys(("moss_tts.yaml", "moss_tts_80gb.yaml", "moss_ttsd.yaml", "moss_sound_effect.yaml",
                            "moss_voice_generator.yaml"), stage=0, max_model_len=4096)
    member = "vllm_omni/model_executor/models/moss_tts/modeling_moss_tts_talker.py"
    class_name = "MossTTSDelayTalkerForGeneration"
    module_name = "vllm_omni.model_executor.models.moss_tts.modeling_moss_tts_talker"
    entries = ("preprocess",)
    stale_rows = True
    codec_vocab = 2048
    hidden = HIDDEN
    notes = ("stand-in: embed_tokens, stacked audio tables (n_vq 4), special ids; payload: codes.ref per prompt "
             "position; the previous step's sampled frame stored in audio_codes.current before each decode call")

    def __init__(self) -> None:
        self._frames: dict[str, torch.Tensor] = {}

    def stand_in_class(self) -> type:
        return MossTTSStandIn

    def embed(self, model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model.embed_input_ids(ids).float()

    def deliver(self, req: ConformRequest, state: dict[str, Any], calls: int, c: int = 0) -> dict[str, Any] | None:
        if c < req.P:
            return None
        frames = self._frames[req.request_id]
        return {"audio_codes": {"current": frames[min(c - req.P, frames.shape[0] - 1)]}}

    def requests(self, count: int, generated: int) -> list[ConformRequest]:
        from harness.config import load_prompts
        from harness.tokenizer import tokenize

        vocab: dict[str, int] = {}
        out = []
        for prompt in load_prompts("default").prompts[:count]:
            text = [vocab.setdefault(w, 100 + len(vocab)) for w in tokenize(prompt.reply)]
            prompt_ids = text + [AUDIO_START] + [GEN_SLOT] * 8
            ref = _codes(prompt.id + "/ref", len(prompt_ids))
            self._frames[prompt.id] = _codes(prompt.id + "/frames", generated + 2)  # the frame sampled at P-1+k
            out.append(ConformRequest(prompt.id, prompt_ids, {"codes": {"ref": ref}},
                                      fixed_tokens(prompt.id, generated + 1, self.codec_vocab)))
        return out
