"""GLM-TTS's AR stage (stage 0), from the real upstream code (upstream issue #5018's list).

Hook: ``GLMTTSForConditionalGeneration.preprocess`` in ``vllm_omni/model_executor/models/glm_tts/glm_tts.py``
(0.30.0 and 0.32.0rc1: l.1264), with ``_resolve_prefill_target_text_len`` and ``_model_dtype`` it reaches. The
model is ``SupportsMultiModal``, so V1 fills the span's rows with ``embed_input_ids`` (the prompt's text and the
reference audio's embeddings) before the hook; the hook hands them back in the model's dtype for every prefill
span, a one-token prefill tail included, and for every one-token decode (an AR speech token: the runner's
embedding of the sampled id). So the rows are the runner's own, position for position.

Payload: what the request builder mirrors from the multimodal processor into the buffer: ``input_len``,
``glm_tts_prompt_text_token_len``, ``prompt_speech_token_len`` (so the target text length is
``input_len - prompt_text_len - 1``). Prompts: text ids, BOA, then prompt speech tokens; generated tokens are
speech tokens ``ATS .. ATE``. The prompt's audio embeddings are stood in by the embedding table of the ids
(the check needs position-addressed rows, not the audio encoder's values).

Stand-in (``GLMTTSStandIn``): ``model.embed_tokens`` and ``model.parameters()`` (bf16, as the shipped deploy's
``dtype: bfloat16``), the special ids ``_ats``, ``_ate``, ``_eoa``, ``_pad``, ``_boa``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from harness.conform.adapter import Adapter, ConformRequest, fixed_tokens, tagged
from harness.conform.reach import ModelDeploys

HIDDEN = 64
TABLE = 4096
PAD, BOA, EOA, ATS, ATE = 3000, 3001, 3002, 3100, 3100 + 511


class _Model:
    def __init__(self) -> None:
        self.weight = tagged(TABLE, HIDDEN, "glm-tts", "embed_tokens").to(torch.bfloat16)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids.long().clamp(0, TABLE - 1)]

    def parameters(self) -> Any:
        return iter([self.weight])


class GLMTTSStandIn:
    """What ``GLMTTSForConditionalGeneration.preprocess`` touches."""

    def __init__(self) -> None:
        self.model = _Model()
        self.model_stage = "glm_tts"
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))
        self._pad, self._boa, self._eoa, self._ats, self._ate = PAD, BOA, EOA, ATS, ATE

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: Any = None,
                        is_multimodal: Any = None, **_: Any) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)


class GLMTTSAdapter(Adapter):
    name = "glm-tts"
    title = "GLM-TTS AR stage"
    # stage 0: max_num_seqs 1, budget 512, max_model_len 2048 (glm_tts.yaml)
    deploys = ModelDeploys(("glm_tts.yaml", "glm_tts*.yaml"), stage=0, max_model_len=2048)
    member = "vllm_omni/model_executor/models/glm_tts/glm_tts.py"
    class_name = "GLMTTSForConditionalGeneration"
    module_name = "vllm_omni.model_executor.models.glm_tts.glm_tts"
    entries = ("preprocess",)
    codec_vocab = ATE - ATS + 1
    hidden = HIDDEN
    notes = ("stand-in: embed_tokens (bf16), special ids; payload: the processor's length metadata; the runner "
             "embeds the ids first (SupportsMultiModal)")

    def stand_in_class(self) -> type:
        return GLMTTSStandIn

    def embed(self, model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model.embed_input_ids(ids).float()

    def requests(self, count: int, generated: int) -> list[ConformRequest]:
        from harness.config import load_prompts
        from harness.tokenizer import tokenize

        vocab: dict[str, int] = {}
        out = []
        for prompt in load_prompts("default").prompts[:count]:
            text = [vocab.setdefault(w, 100 + len(vocab)) for w in tokenize(prompt.user)]
            target = [vocab.setdefault(w, 100 + len(vocab)) for w in tokenize(prompt.reply)]
            speech = [ATS + t for t in fixed_tokens(prompt.id + "/prompt-speech", 24, self.codec_vocab)]
            prompt_ids = text + target + [BOA] + speech
            payload = {"input_len": torch.tensor([len(text) + len(target) + 1]),
                       "glm_tts_prompt_text_token_len": torch.tensor([len(text)]),
                       "prompt_speech_token_len": torch.tensor([len(speech)])}
            gen = [ATS + t for t in fixed_tokens(prompt.id, generated + 1, self.codec_vocab)]
            out.append(ConformRequest(prompt.id, prompt_ids, payload, gen))
        return out
