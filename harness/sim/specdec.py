"""Speculative decoding in the sim: vLLM's own spec-decode scheduling plus a simulated drafter.

vLLM schedules ``1 + k`` positions per decode step once a request has draft tokens
(``scheduler.update_draft_token_ids``, as the engine core does after each step), so verify
spans reach ``talker_preprocess`` as multi-position decode spans. The drafter proposes, for
each of the ``k`` next positions, the token the Talker would sample given its current KV with
probability ``acceptance_rate`` (a generator seeded by (seed, request, position)), otherwise a
different token; the Talker then verifies like vLLM's rejection sampler: accepted drafts plus
the Talker's own token at the first mismatch (or a bonus token when all are accepted).
"""

from __future__ import annotations

from typing import Any

import torch

from harness.sim.codec import CODEC_EOS, NOISE_CODES
from harness.sim.rows import _seed
from harness.sim.talker import SimTalker, TalkerKV


def speculative_config(model_config: Any, k: int) -> Any:
    from vllm.config import ParallelConfig, SpeculativeConfig

    # The "ngram" method needs no draft model; the sim supplies its own drafts.
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4, prompt_lookup_min=2,
                             target_model_config=model_config, target_parallel_config=ParallelConfig())


class Drafter:
    def __init__(self, talker: SimTalker, k: int, acceptance_rate: float, seed: int) -> None:
        self.talker, self.k, self.rate, self.seed = talker, k, acceptance_rate, seed

    def propose(self, kv: TalkerKV, generated: int) -> list[int]:
        drafts = []
        for i in range(self.k):
            g = generated + i
            true = self.talker.next_token(kv, g)
            gen = torch.Generator().manual_seed(_seed(self.seed, "draft", kv.request_id, kv.P + g))
            if float(torch.rand(1, generator=gen)) < self.rate:
                drafts.append(true)
            else:
                drafts.append(1 + (true % NOISE_CODES) if true != CODEC_EOS else 1)
            if drafts[-1] == CODEC_EOS:
                break
        return drafts


def verify(talker: SimTalker, kv: TalkerKV, generated: int, drafts: list[int]) -> list[int]:
    """The tokens a verify step emits: accepted drafts, then the Talker's own token."""
    out: list[int] = []
    for i in range(len(drafts) + 1):
        token = talker.next_token(kv, generated + i)
        out.append(token)
        if token == CODEC_EOS or i == len(drafts) or drafts[i] != token:
            break
    return out
