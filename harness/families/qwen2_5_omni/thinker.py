"""The scripted Thinker: prompt rows, reply rows and the Thinker->Talker payload.

The Thinker runs the deploy's ``thinker.max_num_seqs`` requests at a time (``S``; the seed's deploys:
one), first come first served: a request takes the Thinker sequence that frees first and holds it
for ``ceil((1 + K_i) * thinker_steps_per_token)`` Talker steps (its prefill and ``K_i`` reply
tokens; batched sequences advance one token per step each), and its Talker request arrives when it
finishes. With ``S = 1`` that is ``arrival_i = sum_{j<=i} ceil((1 + K_j) * thinker_steps_per_token)``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.config import Prompt, PromptSet
from harness.sim.codec import CODEC_BOS, CODEC_EOS, CODEC_PAD
from harness.sim.rows import RowSpace
from harness.tokenizer import tokenize

THINKER_TOKEN_BASE = 1000  # Thinker token ids: base + index in the cell's token table


@dataclass
class ThinkerOutput:
    prompt: Prompt
    request_id: str
    prompt_tokens: list[str]
    reply_tokens: list[str]
    prompt_rows: torch.Tensor  # [Pt, DIM]  embed.prefill
    output_rows: torch.Tensor  # [K, DIM]   hidden_states.output
    prompt_first_id: int  # registry id of prompt row 0
    output_first_id: int  # registry id of output row 0
    arrival_step: int

    @property
    def talker_prompt_ids(self) -> list[int]:
        """vLLM-Omni's ``thinker2talker_token_only``: [START] + [PAD]*Pt + [END]."""
        return [CODEC_BOS] + [CODEC_PAD] * len(self.prompt_tokens) + [CODEC_EOS]

    @property
    def P(self) -> int:
        return len(self.prompt_tokens) + 2

    @property
    def reference_text(self) -> str:
        """What the Talker must say (the WER reference): the Thinker's scripted reply."""
        return self.prompt.reply

    def payload(self, token_ids: dict[str, int]) -> dict:
        """What ``thinker2talker_full_payload`` ships: embed.prefill, hidden_states.output, ids."""
        return {
            "embed": {"prefill": self.prompt_rows.clone()},
            "hidden_states": {"output": self.output_rows.clone()},
            "ids": {
                "prompt": [token_ids[t] for t in self.prompt_tokens],
                "output": [token_ids[t] for t in self.reply_tokens],
            },
        }


def run_thinker(prompts: PromptSet, space: RowSpace, steps_per_token: float,
                tokenizer: Callable[[str], list[str]] = tokenize, thinker_seqs: int = 1) -> list[ThinkerOutput]:
    """``tokenizer``: the sim's word rule (default), or ``harness.tokenizer.byte_tokenize`` for the
    speaking Talker mode (the speaking tiny model's one token per byte). ``thinker_seqs``: the
    deploy's ``thinker.max_num_seqs``."""
    outputs: list[ThinkerOutput] = []
    free_at = [0] * max(1, thinker_seqs)  # when each Thinker sequence is free (a heap)
    for prompt in prompts.prompts:
        request_id = prompt.id
        p_tokens = tokenizer(prompt.thinker_prompt(prompts.system_prompt))
        r_tokens = tokenizer(prompt.reply)
        p_rows, p_first = space.make("prompt", list(p_tokens), request_id)
        o_rows, o_first = space.make("output", list(r_tokens), request_id)
        clock = heapq.heappop(free_at) + math.ceil((1 + len(r_tokens)) * steps_per_token)
        heapq.heappush(free_at, clock)
        outputs.append(ThinkerOutput(prompt, request_id, p_tokens, r_tokens, p_rows, o_rows, p_first, o_first, clock))
    return outputs


def token_id_table(outputs: list[ThinkerOutput]) -> dict[str, int]:
    vocab = sorted({t for o in outputs for t in o.prompt_tokens + o.reply_tokens})
    return {t: THINKER_TOKEN_BASE + i for i, t in enumerate(vocab)}
