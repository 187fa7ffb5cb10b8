"""Helpers of ``Qwen2_5OmniForConditionalGeneration`` that both built-in arms share.

Ported from vLLM-Omni 0.30.0 (PyPI wheel ``vllm_omni-0.30.0-py3-none-any.whl``),
``vllm_omni/model_executor/models/qwen2_5_omni/qwen2_5_omni.py``:
``_get_embed_text_spk_token`` (l.672), ``_thinker_to_talker_prefill`` (l.760) and
``_thinker_to_talker_decode_one_step`` (l.839), unchanged apart from typing. The methods run
on a host object that provides what the upstream class provides (``harness.families.qwen2_5_omni.model``):
``talker.embed_input_ids``, ``talker_config``, the special-token embeddings, ``voice_type``,
``model`` and ``_module_device``.
"""

from __future__ import annotations

from typing import Any

import torch


class Qwen25OmniTalkerHelpers:
    OMNI_STRESS_HELPER_PORT = True  # the worker binds the arm's own members only (harness.serve.arm_binding)
    talker: Any
    talker_config: Any
    voice_type: str
    embed_text_bos_token: torch.Tensor
    embed_text_spk_tokens: dict[str, torch.Tensor]
    embed_codec_pad_token: torch.Tensor
    embed_codec_bos_token: torch.Tensor

    def _get_embed_text_spk_token(self, voice_type: str) -> torch.Tensor:
        if not hasattr(self, "embed_text_spk_tokens") or voice_type not in self.embed_text_spk_tokens:
            return self.embed_text_bos_token
        return self.embed_text_spk_tokens[voice_type]

    def _thinker_to_talker_prefill(
        self,
        speaker: str,
        output_prompt_embeds: torch.Tensor,
        output_token_ids: list[int],
        thinker_prompt_embeds: torch.Tensor,
        prompt_token_ids: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        talker_hf_config = self.talker_config
        if hasattr(talker_hf_config, "talker_config"):
            talker_hf_config = talker_hf_config.talker_config

        prompt_embeds = torch.cat(
            [
                thinker_prompt_embeds,
                self._get_embed_text_spk_token(speaker) + self.embed_codec_pad_token,
                output_prompt_embeds[:1] + self.embed_codec_bos_token,
            ],
            dim=0,
        )
        # Upstream indexes output_token_ids[0]: an empty Thinker output raises IndexError here.
        prompt_token_ids_processed = list(prompt_token_ids) + [
            talker_hf_config.tts_codec_pad_token_id,
            output_token_ids[0],
        ]
        input_tokens_len = len(prompt_token_ids_processed)
        if input_tokens_len > 2:
            prompt_token_ids_processed = [self.talker_config.tts_codec_mask_token_id] * (input_tokens_len - 2) + [
                self.talker_config.tts_codec_pad_token_id,
                self.talker_config.tts_codec_start_token_id,
            ]
        else:
            prompt_token_ids_processed = [
                self.talker_config.tts_codec_pad_token_id,
                self.talker_config.tts_codec_start_token_id,
            ][-input_tokens_len:]
        ids = torch.tensor(prompt_token_ids_processed, dtype=torch.int64, device=self._module_device(self.talker))
        return ids, prompt_embeds

    def _thinker_to_talker_decode_one_step(
        self, output_prompt_embeds: torch.Tensor, output_token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        processed_output_token_embeds = output_prompt_embeds + self.talker.embed_input_ids(output_token_ids)
        return output_token_ids, processed_output_token_embeds

    @staticmethod
    def _module_device(module: Any) -> torch.device:
        return torch.device("cpu")
