"""Arm ``main``: vLLM-Omni's Talker preprocess before the fix (routing by span length).

Faithful port of vLLM-Omni 0.30.0 (PyPI), file
``vllm_omni/model_executor/models/qwen2_5_omni/qwen2_5_omni.py``:
``talker_preprocess`` (l.686), ``thinker_to_talker_process`` (l.716) and
``thinker_to_talker_decode_one_step`` (l.805). Behaviour that matters under stress:

* ``n > 1`` takes the prefill branch, which rebuilds the *whole* prompt from row 0 whatever
  ``_omni_num_computed_tokens`` is, so the runner copies prompt rows ``0..n-1`` into
  positions ``c..c+n-1``; a chunked prefill never delivers the speaker (P-2) and codec-BOS
  (P-1) rows; a replay span gets only prompt rows.
* every prefill-branch call resets the ``thinker_reply`` queue to ``thinker_result[1:]``.
* ``n == 1`` takes the decode branch, which consumes one queue row per call (a one-token
  prefill tail is treated as decode). An empty queue falls back to ``embed.decode``, then to
  the model-level ``thinker_reply_part`` pool shared by all requests (zeros after the
  profile run), else leaves the codec embedding alone (no text component; 0.30.0 appends no
  text-EOS/PAD rows).
* the ``_omni_*`` keys are passed but never read.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.families.qwen2_5_omni.helpers import Qwen25OmniTalkerHelpers


class MainTalker(Qwen25OmniTalkerHelpers):
    thinker_reply_part: torch.Tensor

    def talker_preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **info_dict: Any):
        payload = info_dict
        if input_embeds is None and input_ids is not None:
            input_embeds = self.talker.embed_input_ids(input_ids)
        span_len = input_ids.shape[0]
        if span_len > 1:
            return self.thinker_to_talker_process(input_ids, input_embeds, payload)
        return self.thinker_to_talker_decode_one_step(input_ids, input_embeds, payload)

    def thinker_to_talker_process(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, payload: dict):
        embed = payload.get("embed", {})
        hs = payload.get("hidden_states", {})
        ids = payload.get("ids", {})
        update_dict: dict[str, Any] = {}

        prompt_embeds = embed.get("prefill")
        thinker_result = hs.get("output")
        prompt_token_ids = ids.get("prompt")
        thinker_output_token_ids = ids.get("output")

        hidden = self.talker.config.hidden_size
        if not isinstance(prompt_embeds, torch.Tensor):
            prompt_embeds = torch.zeros(0, hidden, dtype=input_embeds.dtype)
        if not isinstance(thinker_result, torch.Tensor):
            thinker_result = torch.zeros(0, hidden, dtype=input_embeds.dtype)
        if not isinstance(prompt_token_ids, (list, torch.Tensor)):
            prompt_token_ids = []
        if not isinstance(thinker_output_token_ids, (list, torch.Tensor)):
            thinker_output_token_ids = []

        req_input_ids, req_embeds = self._thinker_to_talker_prefill(
            speaker=self.voice_type,
            output_prompt_embeds=thinker_result.to(input_embeds.dtype),
            output_token_ids=thinker_output_token_ids,
            thinker_prompt_embeds=prompt_embeds.to(input_embeds.dtype),
            prompt_token_ids=prompt_token_ids,
        )
        if thinker_result.ndim == 2 and thinker_result.shape[0] > 0:
            update_dict.setdefault("embed", {})["thinker_reply"] = thinker_result[1:].detach().to("cpu").contiguous()
        return req_input_ids, req_embeds, update_dict

    def thinker_to_talker_decode_one_step(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, payload: dict):
        embed = payload.get("embed", {})
        update_dict: dict[str, Any] = {}
        step_vec = None
        q = embed.get("thinker_reply", None)
        if isinstance(q, torch.Tensor) and q.numel() > 0:
            step_vec = q[0:1]
            update_dict.setdefault("embed", {})["thinker_reply"] = q[1:].detach().to("cpu").contiguous()
        else:
            dv = embed.get("decode")
            if isinstance(dv, torch.Tensor) and dv.numel() > 0:
                step_vec = dv[0:1] if dv.ndim == 2 else dv.view(1, -1)
            elif (
                hasattr(self, "thinker_reply_part")
                and isinstance(self.thinker_reply_part, torch.Tensor)
                and self.thinker_reply_part.numel() > 0
            ):
                step_vec = self.thinker_reply_part[0:1]
                self.thinker_reply_part = self.thinker_reply_part[1:]

        if isinstance(step_vec, torch.Tensor) and step_vec.numel() > 0:
            one_id = input_ids[0:1]
            _, one_embed = self._thinker_to_talker_decode_one_step(
                output_prompt_embeds=step_vec.to(input_embeds.dtype), output_token_ids=one_id
            )
            input_embeds[0] = one_embed[0]
        return input_ids[0:1], input_embeds[0:1], update_dict
