"""Arm ``pr``: the fix of vLLM-Omni PR "FIX #5018" (absolute-position span assembly).

As the PR describes it (seed discussion): each scheduled span is assembled from the runner's
positions. Prompt positions ``p < P`` take row ``p`` of the reconstructed Talker prompt (built
by the unchanged ``_thinker_to_talker_prefill``); generated positions take
``thinker_reply[k] + codec_embed(id)`` with ``k = p - P`` and
``thinker_reply = thinker_result[1:] ++ [text_eos] ++ [text_pad]``, the final PAD row
persisting past the end (#9371's end conditioning). Nothing is consumed, so a decode step, a
verify span and a replay of the same positions get the same rows. Missing metadata, or a
reconstructed prompt whose length differs from ``_omni_prompt_len``, raises.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.contract import ContractError, require_metadata
from harness.families.qwen2_5_omni.helpers import Qwen25OmniTalkerHelpers


class FixedTalker(Qwen25OmniTalkerHelpers):
    embed_text_eos_token: torch.Tensor
    embed_text_pad_token: torch.Tensor

    def talker_preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **info_dict: Any):
        require_metadata(info_dict)
        prompt_len = int(info_dict["_omni_prompt_len"])
        computed = int(info_dict["_omni_num_computed_tokens"])
        if input_embeds is None:
            input_embeds = self.talker.embed_input_ids(input_ids)
        span_len = int(input_ids.shape[0])

        embed = info_dict.get("embed", {})
        hs = info_dict.get("hidden_states", {})
        ids = info_dict.get("ids", {})
        thinker_result = hs.get("output")
        if not isinstance(thinker_result, torch.Tensor) or thinker_result.shape[0] == 0:
            raise ContractError("talker_preprocess: empty Thinker output (hidden_states.output)")
        thinker_result = thinker_result.to(input_embeds.dtype)

        out_ids = input_ids.clone()
        out_embeds = input_embeds.clone()
        n_prompt = max(0, min(prompt_len - computed, span_len))
        if n_prompt > 0:
            prompt_ids, prompt_embeds = self._thinker_to_talker_prefill(
                speaker=self.voice_type,
                output_prompt_embeds=thinker_result,
                output_token_ids=list(ids.get("output", [])),
                thinker_prompt_embeds=embed["prefill"].to(input_embeds.dtype),
                prompt_token_ids=list(ids.get("prompt", [])),
            )
            if prompt_embeds.shape[0] != prompt_len:
                raise ContractError(
                    f"talker_preprocess: reconstructed prompt has {prompt_embeds.shape[0]} rows, "
                    f"runner scheduled prompt length {prompt_len}"
                )
            out_embeds[:n_prompt] = prompt_embeds[computed : computed + n_prompt]
            out_ids[:n_prompt] = prompt_ids[computed : computed + n_prompt]
        if n_prompt < span_len:
            reply = torch.cat([thinker_result[1:], self.embed_text_eos_token, self.embed_text_pad_token], dim=0)
            first_k = computed + n_prompt - prompt_len
            ks = torch.arange(first_k, first_k + span_len - n_prompt).clamp(max=reply.shape[0] - 1)
            dec_ids = input_ids[n_prompt:]
            _, dec_embeds = self._thinker_to_talker_decode_one_step(reply[ks], dec_ids)
            out_embeds[n_prompt:] = dec_embeds
        return out_ids, out_embeds, {}
