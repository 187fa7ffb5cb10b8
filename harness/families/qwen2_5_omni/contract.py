"""Qwen2.5-Omni's phase contract: which row each Talker position must receive (pure, no I/O).

DESIGN.md "The phase contract": ``p < P``: row ``p`` of the reconstructed Talker prompt (the
Thinker prompt rows, then speaker + codec-PAD, then ``thinker_result[0]`` + codec-BOS, so
``P = Pt + 2``); ``p >= P``: the codec row of the previous token + ``reply[k]``, ``k = p - P``,
``reply = thinker_result[1:] ++ [text_eos] ++ [text_pad]``, the final PAD persisting. The events
(chunks, replays, tails, mismatches) are every family's and live in ``harness.contract``.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.contract import ContractError


@dataclass(frozen=True)
class RowRef:
    """Names the row the fixed Talker must condition one position on.

    ``source``: ``prompt`` (row ``index`` of the reconstructed Talker prompt: Thinker prompt
    rows, then speaker + codec-PAD at P-2, then ``thinker_result[0]`` + codec-BOS at P-1),
    ``reply`` (``thinker_result[1 + index]``), ``text_eos`` or ``text_pad``; the last three
    are added to the codec embedding of the position's own input id.
    """

    source: str
    index: int



def expected_rows(P: int, c: int, n: int, num_thinker_tokens: int) -> list[RowRef]:
    """Which row each position of the span must receive.

    ``p < P``: prompt row ``p``. ``p >= P``: ``reply[k]``, ``k = p - P``, where
    ``reply = thinker_result[1:] ++ [text_eos] ++ [text_pad]`` and the final PAD row persists
    for every ``k`` past the end. Stateless: the same span always gives the same rows.
    """
    if num_thinker_tokens < 1:
        raise ContractError("empty Thinker output: the Talker prompt needs thinker_result[0]")
    if P < 2:
        raise ContractError(f"Talker prompt length {P} < 2 (needs speaker and codec-BOS rows)")
    if c < 0 or n < 1:
        raise ContractError(f"invalid span c={c} n={n}")
    eos_k = num_thinker_tokens - 1  # len(thinker_result[1:])
    out = []
    for p in range(c, c + n):
        k = p - P
        if k < 0:
            out.append(RowRef("prompt", p))
        elif k < eos_k:
            out.append(RowRef("reply", k))
        elif k == eos_k:
            out.append(RowRef("text_eos", k))
        else:
            out.append(RowRef("text_pad", k))
    return out
