"""The hand-built pieces every speaking tiny Talker is made of (docs/speaking-model.md, docs/families/qwen3_tts.md).

Both families' constructions (``harness.families.<family>.speaking_model``) give their Talker the same
two attention heads and the same logit design on their own row dimensions; what is shared lives here:

* the rotary **previous-position head** (head 0): query and key are biases only, on the eight fastest
  rotary pairs of a 32-wide head (:data:`HEAD_DIM`, rope theta :data:`ROPE_THETA`), the key rotated one
  position back, so the score between positions ``m`` and ``n`` is ``c * sum_j w_j cos((m - n - 1)
  theta_j)``: largest at ``n = m - 1`` by ``gap * c`` over every other distance up to
  :data:`MAX_DISTANCE` (:data:`PREV_PAIR_WEIGHTS` from a linear program, :func:`prev_head_gap` checked at
  build time); its value copies the previous row's tag bits, text flag and PAD mark
  (:func:`write_prev_head`);
* the **logit design** (:func:`write_codec_head`): one ``codec_head`` row per codec id of a
  ``harness.speaking.rules.Table`` (rule 2's speech ids, babble, codec EOS, rule 3's silence), in units
  of the residual before the final norm;
* GPT-2's byte-to-unicode map (:func:`byte_chars`), the character each byte is in both tiny
  checkpoints' byte-level tokenizers, and the row-identity check (:func:`check_row_id`).

Only the standard library at import (torch inside the functions): the worker's import stays light.
"""

from __future__ import annotations

import math
from typing import Any

HEAD_DIM = 32  # both Talkers' head size: the pair angles of thetas()
ROPE_THETA = 1_000_000.0
MAX_DISTANCE = 4096
# head 0's rotary pair weights (pairs 0-7): maximise the score gap of distance 1 over every other
# distance in [0, MAX_DISTANCE] (scipy linprog, rounded; the gap is re-checked in prev_head_gap)
PREV_PAIR_WEIGHTS = (0.44, 0.10, 0.06, 0.13, 0.06, 0.04, 0.06, 0.11)
PREV_SCORE = 700.0  # c: the gap of ~0.208 times c / sqrt(32) is ~25 nats over the runner-up position
MIN_GAP = 0.2  # head 0 must single out the previous position over every distance it will see
CODE = 8.0 / 3.0  # a text dim after an RMSNorm of nine +-1 entries in 64 dims: every content dim's value in a row
# logit design, in units of the residual before the final norm (margins of >= 40 there are >= 28
# after the norm, more after temperature 0.9: the chosen id has probability ~1 under top-k/top-p)
ALPHA = 7.5  # per bit of the current byte: a wrong bit costs 2 * 7.5 * 8/3 = 40
ALPHA_TAG = 8.0  # per bit of the previous byte's tag: a wrong bit costs 2 * 8 * 2.4 >= 38
GAMMA = 16.0  # tag 0 when the previous row had no text (its bits are all zero: every tag ties)
GATE = 200.0  # speech ids lose GATE unless started (STARTED gives it back)
WINNER = 20.0  # the correct speech id's logit when the previous row had text
EOS_LOGIT = -100.0  # codec EOS: above speech without text (<= -160), below speech with text (>= -39)
BABBLE_TEXT, BABBLE_BASE, BABBLE_STARTED = 110.0, -150.0, -100.0  # -40 unstarted with text; else <= -140
OTHER_LOGIT = -500.0  # ids outside the table
# SILENCE, rule 3: SIL_BASE + SIL_MARK on a text-EOS row or a first text-PAD row (+50: 150 over EOS,
# >= 200 over speech and babble there); a PAD row after a PAD row loses SIL_PREV_PAD (-250: EOS wins by
# 150); a row without text or mark: -200 (EOS wins by 100); a text row: -200 (speech 20 and unstarted
# babble -40 win by >= 160)
SIL_BASE, SIL_MARK, SIL_PREV_PAD = -200.0, 250.0, 300.0


def byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-unicode map: the character the ByteLevel pre-tokenizer turns each byte into (both tiny
    checkpoints' byte-level tokenizers)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def bits(value: int, n: int) -> list[float]:
    """The low ``n`` bits of ``value``, one +-1 per bit (least significant first)."""
    return [1.0 if (value >> i) & 1 else -1.0 for i in range(n)]


def thetas() -> list[float]:
    return [ROPE_THETA ** (-2 * j / HEAD_DIM) for j in range(HEAD_DIM // 2)]


def prev_head_gap(max_distance: int = MAX_DISTANCE) -> float:
    """Head 0's normalised score gap of distance 1 over the best other distance (must stay > 0.2)."""
    th = thetas()
    total = sum(PREV_PAIR_WEIGHTS)

    def f(d: int) -> float:
        return sum(w * math.cos((d - 1) * th[j]) for j, w in enumerate(PREV_PAIR_WEIGHTS)) / total

    return 1.0 - max(f(d) for d in range(max_distance + 1) if d != 1)


def check_prev_head() -> None:
    """Refuse to build when head 0 would not single out the previous position (:data:`MIN_GAP`)."""
    gap = prev_head_gap()
    if gap < MIN_GAP:
        raise RuntimeError(f"speaking model: head 0's score gap {gap:.3f} < {MIN_GAP}")


def write_prev_head(qb: Any, kb: Any, vw: Any, ow: Any, src: list[int], dst: list[int]) -> None:
    """Head 0 (the first ``HEAD_DIM`` rows of the layer's q/k/v projections): content-free query and key
    biases ``qb``/``kb`` on the fastest rotary pairs, the key one position back; its value (``vw``, then
    ``ow``) copies row dims ``src`` of the previous position into dims ``dst``."""
    th = thetas()
    half = HEAD_DIM // 2
    total = sum(PREV_PAIR_WEIGHTS)
    for j, w in enumerate(PREV_PAIR_WEIGHTS):
        a = math.sqrt(PREV_SCORE * w / total)
        qb[j] = a
        kb[j] = a * math.cos(th[j])
        kb[j + half] = a * math.sin(th[j])
    for k, dim in enumerate(src):
        vw[k, dim] = 1.0
        ow[dst[k], k] = 1.0


def write_codec_head(head: Any, table: Any, *, tag_bits: int, text: int, prev: list[int], prev_text: int,
                     prev_pad: int, started: int, one: int, eos_mark: int, pad_mark: int, prev_ref: float,
                     started_ref: float, pad_ref: float) -> None:
    """The logit design (docs/speaking-model.md's table) as ``codec_head`` rows on a checkpoint's dims: rule 2's
    speech ids ``BYTES * tag + byte`` (``tag_bits`` tag bits on ``prev``), babble, codec EOS and rule 3's
    silence, for the codec ids of ``table`` (a ``harness.speaking.rules.Table``: the family's
    ``speaking.TABLE``); every other id ``OTHER_LOGIT``. The byte's bits are row dims 0-7, ``text`` its flag,
    ``one`` a constant ``CODE``. ``*_ref``: what the heads write into ``prev``, ``started`` and ``prev_pad``
    after the layer's input norm, which the weights divide by."""
    import torch

    from harness.speaking.rules import BYTES

    head[:, one] = OTHER_LOGIT / CODE
    base = 9 * ALPHA * CODE + tag_bits * ALPHA_TAG * prev_ref - WINNER
    cur = torch.tensor([bits(b, 8) for b in range(BYTES)]) * ALPHA  # [256, 8]
    for t in range(table.tags):
        rows = slice(t * BYTES, (t + 1) * BYTES)
        head[rows, 0:8] = cur
        head[rows, text] = ALPHA
        head[rows, prev[0]:prev[0] + tag_bits] = torch.tensor(bits(t, tag_bits)) * ALPHA_TAG
        head[rows, started] = GATE / started_ref
        offset = -base - GATE  # started: +GATE from STARTED, so the correct id lands on WINNER
        if t == 0:  # the previous row had no byte: its tag bits are all 0, tag 0 wins by GAMMA
            offset += GAMMA * prev_ref
            head[rows, prev_text] = -GAMMA
        head[rows, one] = offset / CODE
    head[table.babble, :] = 0.0
    head[table.babble, text] = BABBLE_TEXT / CODE
    head[table.babble, one] = BABBLE_BASE / CODE
    head[table.babble, started] = BABBLE_STARTED / started_ref
    head[table.eos, :] = 0.0
    head[table.eos, one] = EOS_LOGIT / CODE
    sil = table.silence  # Qwen2.5-Omni's replaces the speech row of byte NUL (tag 0), which no reply holds
    head[sil, :] = 0.0
    head[sil, one] = SIL_BASE / CODE
    head[sil, eos_mark] = SIL_MARK / CODE
    head[sil, pad_mark] = SIL_MARK / CODE
    head[sil, prev_pad] = -SIL_PREV_PAD / pad_ref


def check_row_id(state: dict[str, Any], names: tuple[str, ...], row_id: list[int]) -> None:
    """Refuse embeddings that write the row-identity dims ``row_id``: the worker's contract check lends them
    to identity codes on the rows it hands the arm (``harness.serve.worker_contract``), so they must be zero."""
    for name in names:
        if bool(state[name][:, row_id].any()):
            raise RuntimeError(f"speaking model: {name} writes the row-identity dims {row_id}")
