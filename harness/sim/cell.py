"""What a model family hands the sim's step loop: one cell's requests, Talker, model and contract.

Why a seam here: the step loop (``harness.sim.steploop.run_cell``: vLLM's scheduler, the runner's
copy rules, speculative decoding, arrivals, records) is every family's; which requests a prompt
set makes, what rows they carry, how the Talker reads its KV, which row each position must get
and how a codec stream reads back as words are the family's. A family's ``sim_cell`` hook
(``harness.family.Family.sim_cell``) builds a ``SimCell``; ``run_cell`` only steps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class SimRequest(Protocol):
    """One request's input to the stage under test (Qwen2.5-Omni: ``harness.families.qwen2_5_omni.thinker.ThinkerOutput``)."""

    request_id: str
    arrival_step: int  # when it reaches the stage under the seed's load (``load.mode: all``)
    reply_tokens: list[str]  # what the upstream stage produces (its length times the Thinker's pace)
    # optional ``streams`` (True: it reaches the stage with its first chunk while the upstream stage goes on,
    # Qwen3-Omni's async_chunk; harness.sim.load reads it with a default of False)

    @property
    def talker_prompt_ids(self) -> list[int]: ...

    @property
    def P(self) -> int: ...

    @property
    def reference_text(self) -> str: ...

    def payload(self, token_ids: dict[str, int]) -> dict: ...


class SimContract(Protocol):
    """The family's contract over the sim's row identities: the per-request KV the Talker reads,
    and the misaligned positions of a span, split into (text region, end region)."""

    def new_kv(self, out: Any, capacity: int) -> Any: ...

    def text_len(self, out: Any) -> int: ...  # the rows after the prompt up to text-EOS (misaligned_regions)

    def misaligned_one(self, kv: Any, out: Any, span_id: int, c: int, t_id: int, k_id: int) -> tuple[int, int]: ...

    def misaligned(self, kv: Any, out: Any, span_ids: np.ndarray, c: int, n: int, text_ids: np.ndarray,
                   codec_ids: np.ndarray) -> tuple[int, int]: ...

    # Optional, for a family whose requests carry a voice in a codec row (Qwen3-TTS's speaker):
    # ``foreign_voice(out, codec_ids) -> bool array``, the positions holding another request's voice, which
    # the runner counts as cross-request positions (``harness.sim.runner.SimRunner``).


@dataclass
class SimCell:
    """A cell built by its family, ready to step.

    ``speak(codes)``: the request's codec stream read back as (codes as recorded, oracle transcript,
    the units Code2Wav speaks)."""

    requests: list[Any]  # SimRequest, in prompt order
    token_ids: dict[str, int]  # the upstream stage's token table (the payload's ids)
    space: Any  # harness.sim.rows.RowSpace
    model: Any  # the arm bound onto the family's stand-in model
    talker: Any  # next_token(kv, generated), freeze(); the drafter and verifier use it too
    contract: SimContract
    stop_token_ids: list[int]
    speak: Any  # Callable[[list[int]], tuple[list[int], str, list[str]]]
    runner_class: Any = None  # the runner calling the family's hook (None: harness.sim.runner.SimRunner)
