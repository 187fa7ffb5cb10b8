"""A vLLM logits processor that makes the speaking tiny model's Thinker say a scripted reply.

Why: a tiny model cannot *compose* a reply; the harness needs one it knows (the prompt set's
``reply``), different per prompt, so the real backend's WER has a reference and the sim can run the
same work. The Thinker's forward still runs on every token, so its hidden states (what vLLM-Omni
ships to the Talker) are the real model's; only the choice of the next token is forced.

Loaded in the Thinker stage (stage 0) through vLLM-Omni's per-stage ``logits_processors`` (the
launcher adds ``harness.serve.reply_forcer:ReplyForcer`` to stage 0's overrides for a speaking
checkpoint). A request opts in with ``extra_args: {"omni_stress_reply": TEXT}`` in its Thinker
sampling params; the processor tokenizes TEXT once with the model's own tokenizer and, at output
position ``k``, leaves only token ``k`` of TEXT (then the tokenizer's EOS) with a finite logit.
Requests without the key are untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

EXTRA_ARG = "omni_stress_reply"


class ReplyForcer(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._device = device
        self._tokenizer = None
        self._path = getattr(getattr(vllm_config, "model_config", None), "tokenizer", None)
        self._reqs: dict[int, tuple[list[int], list[int]]] = {}  # batch index -> (forced ids, output ids)

    def _tok(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._path)
        return self._tokenizer

    def forced_ids(self, text: str) -> list[int]:
        tok = self._tok()
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        return ids + [int(tok.eos_token_id)]

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params: Any, _prompt: Any, output: list[int]) -> tuple[list[int], list[int]] | None:
            extra = getattr(params, "extra_args", None) or {}
            text = extra.get(EXTRA_ARG)
            if not isinstance(text, str):
                return None
            return self.forced_ids(text), output

        process_dict_updates(self._reqs, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (forced, output) in self._reqs.items():
            if index >= logits.shape[0]:
                continue
            token = forced[min(len(output), len(forced) - 1)]
            keep = logits[index, token].clone()
            logits[index].fill_(float("-inf"))
            logits[index, token] = torch.where(torch.isfinite(keep), keep, torch.zeros_like(keep))
        return logits
