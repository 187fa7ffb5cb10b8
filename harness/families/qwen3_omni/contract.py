"""Qwen3-Omni's contract: which row each Talker position of a request must receive, whatever the schedule.

The rows are the release's own (vLLM-Omni 0.30.0 ``qwen3_omni.py`` ``_thinker_to_talker_prefill``,
``_get_talker_user_parts``, ``_get_talker_assistant_parts``, l.1007-1282) and the runner's (a one-token
decode span runs through ``talker_mtp``: its codec embedding plus the ``text_step`` row the hook returns
in ``mtp_inputs``). Both Thinker-to-Talker paths (``async_chunk: false``, the full payload; ``true``,
chunk 0 then one ``decode`` row per Thinker step) must give the same rows; only where they come from
differs. For a Thinker prompt whose user turn spans ``U`` tokens (``<|im_start|>user\\n ... <|im_end|>\\n``;
the system turn is skipped) and a reply of ``K`` tokens ``r_0 .. r_{K-1}``:

* ``p < U``: the projected Thinker embedding of user-turn token ``p`` (codec part none);
* ``U .. U+2``: the assistant header ``<|im_start|>``, ``assistant``, ``\\n`` (projected, codec none);
* ``U+3 .. U+6``: ``tts_pad`` + codec ``nothink``, ``think_bos``, ``think_eos``, the speaker's codec id;
* ``U+7``: ``tts_bos`` + codec PAD; ``U+8 = P-1``: ``r_0`` + codec BOS (``P = U + 9``,
  ``_compute_talker_prompt_ids_length``);
* ``p >= P``, ``k = p - P``: the position's own codec embedding plus ``r_{k+1}`` for ``k < K-1``,
  ``tts_eos`` at ``k = K-1``, ``tts_pad`` after.

The **text region** is ``p < P + K`` (every position that carries a reply token or ``tts_eos``), the
**end region** every later position, as ``harness.contract.misaligned_regions(positions, P, K - 1)``
splits them. Pure: no torch. ``harness.families.qwen3_omni.sim.OmniContract`` is its array form over the
sim's row identities; the tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

ASSISTANT_ROWS = 9  # 3 header + 4 tts_pad + tts_bos + first text: _compute_talker_prompt_ids_length's "3 + 4 + 1 + 1"
HEADER_ROWS = 3
THINK_CODECS = ("nothink", "think_bos", "think_eos")


@dataclass(frozen=True)
class OmniRowRef:
    """One expected row: its text part and its codec part, by name."""

    text: str  # "user i" | "header i" | "tts_pad" | "tts_bos" | "tts_eos" | "reply k"
    codec: str  # "none" | "nothink" | "think_bos" | "think_eos" | "speaker" | "pad" | "bos" | "own id"


USER_TURN_TEMPLATE = 5  # <|im_start|> user \n ... <|im_end|> \n around the user's words


def user_turn_len(user: str) -> int:
    """``U``: the Thinker tokens of a user turn saying ``user`` (the sim's word rule, ``harness.tokenizer``)."""
    from harness.tokenizer import tokenize

    return len(tokenize(user)) + USER_TURN_TEMPLATE


def prompt_len(user_len: int) -> int:
    """``P`` for a user turn of ``user_len`` Thinker tokens."""
    return user_len + ASSISTANT_ROWS


def expected_row(p: int, user_len: int, K: int) -> OmniRowRef:
    """The row position ``p`` must get, for a user turn of ``user_len`` tokens and a reply of ``K`` tokens."""
    if p < 0:
        raise ValueError(f"position {p} < 0")
    if K < 1:
        raise ValueError(f"a reply of {K} tokens: the Thinker says at least one")
    P = prompt_len(user_len)
    if p < user_len:
        return OmniRowRef(f"user {p}", "none")
    q = p - user_len
    if q < HEADER_ROWS:
        return OmniRowRef(f"header {q}", "none")
    q -= HEADER_ROWS
    if q < len(THINK_CODECS):
        return OmniRowRef("tts_pad", THINK_CODECS[q])
    if q == len(THINK_CODECS):
        return OmniRowRef("tts_pad", "speaker")
    if p == P - 2:
        return OmniRowRef("tts_bos", "pad")
    if p == P - 1:
        return OmniRowRef("reply 0", "bos")
    k = p - P
    if k < K - 1:
        return OmniRowRef(f"reply {k + 1}", "own id")
    if k == K - 1:
        return OmniRowRef("tts_eos", "own id")
    return OmniRowRef("tts_pad", "own id")


def text_region_end(user_len: int, K: int) -> int:
    """First position of the end region (``tts_pad`` after ``tts_eos``)."""
    return prompt_len(user_len) + K
