"""Qwen3-TTS's talker (stage 0), from the real upstream code.

Hooks: ``Qwen3TTSTalkerForConditionalGeneration.preprocess`` (0.30.0:
``vllm_omni/model_executor/models/qwen3_tts/qwen3_tts_talker.py`` l.868) for every span but
one-token decodes, and ``preprocess_decode_batch`` (l.1071), which vLLM-Omni's runner calls for
one-token decode spans whenever the model defines it (gpu_model_runner.py l.1762: a batch of
one here). The model has ``talker_mtp``, so a one-token decode position runs with its codec
embedding plus the ``text_step`` row the hook returns; a decode span of ``n > 1`` gets the bare
codec rows ``preprocess`` returns.

Payload: a TTS request's ``additional_information`` (``text``, ``task_type: CustomVoice``,
``speaker``) with the words of the first replies of ``prompts/default.yaml``. The prompt itself
is built inside the hook by ``self._prompt_builder.build_prompt_embeds`` (``prompt_embeds_builder.py``:
tokenizer, speaker encoder, reference audio), which the stand-in replaces: it returns
deterministic rows per text in the release's CustomVoice layout: a prompt of ``P = 9`` rows (the role's
3, the codec prefix's 4 with the speaker, ``tts_bos``, the text's first token) and a ``trailing_text``
queue of the text's other tokens plus ``tts_eos`` (a word is a token here; text rows consumed one per
decode step), so what is checked is how ``preprocess`` slices and queues those rows, not how they are
built. ``P`` is also the scheduler's placeholder prompt length. The vLLM runs take the family's own
deploys (``qwen3-tts-reference`` / ``-stress``, their MRV2 twins for the MRV2 row) for the ``reference`` /
``stress`` columns.

Stand-in (``Qwen3TTSStandIn``): the codec table (``embed_input_ids``), ``_tts_pad_embed``,
``talker_config.codec_pad_id`` / ``num_code_groups``, ``_codebook_vocab_size``, float32.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from harness.conform.adapter import Adapter, ConformRequest, fixed_tokens, tagged
from harness.conform.reach import ModelDeploys

HIDDEN = 64
CODEC_TABLE = 3072


class _PromptBuilderStandIn:
    """``Qwen3TTSPromptEmbedsBuilder.build_prompt_embeds`` in the release's CustomVoice layout, with
    deterministic rows per text: ``PROMPT_LEN`` = 9 prompt rows (the role's 3, the codec prefix's 4 with the
    speaker, ``tts_bos``, the text's first token) and a ``trailing_text`` queue of the text's other tokens plus
    ``tts_eos`` (a word is a token here: ``words`` rows)."""

    def build_prompt_embeds(self, *, task_type: str, info_dict: dict[str, Any]) -> tuple[Any, Any, None, None]:
        text = info_dict["text"][0]
        words = len(text.split())
        return (tagged(prompt_len(text), HIDDEN, "qwen3-tts", "prompt", text),
                tagged(words, HIDDEN, "qwen3-tts", "trailing", text), None, None)

    def preprocess_batch(self, *, req_ids: list[str], model_intermediate_buffer: dict[str, dict[str, Any]],
                         device: Any) -> None:
        """The runners' batch hook delegates here: the release's builder batches Base voice-clone work only
        (reference texts and codes); these requests are CustomVoice, for which it stores nothing."""

    def preprocess_infos_batch(self, *, req_infos: list[dict[str, Any]], device: Any) -> None:
        """MRV2's form of :meth:`preprocess_batch`: the same."""


def prompt_len(text: str) -> int:
    """The release's CustomVoice prompt: 9 rows whatever the text (``harness.families.qwen3_tts.contract``)."""
    from harness.families.qwen3_tts.contract import PROMPT_LEN

    return PROMPT_LEN


class Qwen3TTSStandIn:
    """What ``preprocess`` / ``preprocess_decode_batch`` of the Qwen3-TTS talker touch."""

    def __init__(self) -> None:
        self.codec_table = tagged(CODEC_TABLE, HIDDEN, "qwen3-tts", "codec")
        self._prompt_builder = _PromptBuilderStandIn()
        self._embedding_dtype = torch.float32
        self._tts_pad_embed = tagged(1, HIDDEN, "qwen3-tts", "tts_pad")[0]
        self._codebook_vocab_size = 2048
        self._use_v2_model_runner = False
        self._silence_ban_frames = 0  # the release's default: the batch hooks' x-vector bookkeeping is off
        self._req_x_vector_only: dict[str, bool | None] = {}
        self.talker_config = SimpleNamespace(codec_pad_id=2148, num_code_groups=16)

    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.codec_table[input_ids.long().clamp(0, CODEC_TABLE - 1)]


class Qwen3TTSAdapter(Adapter):
    stale_rows = True  # not SupportsMultiModal: V1 hands it the persistent inputs_embeds rows
    name = "qwen3-tts"
    # the Talker is stage 0 (no stage feeds it: async_chunk only changes what it publishes, not its rows)
    deploys = ModelDeploys(
        ("qwen3_tts.yaml", "qwen3_tts_mrv2.yaml", "qwen3_tts_high_concurrency.yaml",
         "qwen3_tts_high_concurrency_mrv2.yaml", "qwen3_tts_high_concurrency_mrv2_b4.yaml",
         "qwen3_tts_high_concurrency_mrv2_single_gpu.yaml", "qwen3_tts*.yaml"), stage=0, max_model_len=4096)
    # CUDA runs MRV2 (model_runner: v2), the other platforms V1: one matrix row each (qwen3-tts, qwen3-tts@mrv2)
    title = "Qwen3-TTS talker"
    member = "vllm_omni/model_executor/models/qwen3_tts/qwen3_tts_talker.py"
    class_name = "Qwen3TTSTalkerForConditionalGeneration"
    module_name = "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker"
    entries = ("preprocess", "preprocess_decode_batch")
    # the Qwen3-TTS family's deploys (the same stress: a 32-token budget, 42 KV blocks) in place of Qwen2.5-Omni's
    own_deploys = {("v1", "reference"): "qwen3-tts-reference", ("v1", "stress"): "qwen3-tts-stress",
                   ("v2", "reference"): "qwen3-tts-mrv2-reference", ("v2", "stress"): "qwen3-tts-mrv2-stress"}
    has_mtp = True
    codec_vocab = 2048
    hidden = HIDDEN
    notes = ("stand-in: codec table, tts_pad row, config ids, and the prompt builder (deterministic prompt and "
             "trailing_text rows per text); payload: text / task_type / speaker; decode n == 1 through "
             "preprocess_decode_batch and the runner's talker_mtp path (codec row + text_step)")

    def stand_in_class(self) -> type:
        return Qwen3TTSStandIn

    def embed(self, model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model.embed_input_ids(ids).float()

    def requests(self, count: int, generated: int) -> list[ConformRequest]:
        from harness.config import load_prompts

        out = []
        for prompt in load_prompts("default").prompts[:count]:
            payload = {"text": [prompt.reply], "task_type": ["CustomVoice"], "speaker": ["Vivian"]}
            out.append(ConformRequest(prompt.id, [0] * prompt_len(prompt.reply), payload,
                                      fixed_tokens(prompt.id, generated + 1, self.codec_vocab)))
        return out

    def request_tables(self, req: ConformRequest) -> dict[str, torch.Tensor]:
        text = req.payload["text"][0]
        built = _PromptBuilderStandIn().build_prompt_embeds(task_type="CustomVoice", info_dict={"text": [text]})
        return {"prompt row": built[0], "trailing_text row": built[1]}

    def named_rows(self, model: Any) -> dict[str, torch.Tensor]:
        return {"the tts_pad row": model._tts_pad_embed}
