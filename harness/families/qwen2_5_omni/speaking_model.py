"""Weights that make the tiny Qwen2.5-Omni *speak*: its Talker says what its rows say (``harness.families.qwen2_5_omni.speaking``).

Built by hand, not trained, on top of the random tiny checkpoint (``harness.families.qwen2_5_omni.tiny_model``), and
run by vLLM-Omni 0.30.0's unmodified model code. Every number below is what it is for a reason
written beside it; docs/speaking-model.md has the whole construction and what it cannot model.

Dimensions of the 64-wide rows (Thinker hidden = Talker embedding = Talker hidden = 64):

* ``BITS`` (0-7): the byte a text row carries, one +-1 per bit; ``TEXT`` (8): +1 on every byte row.
* ``BOS`` (9): set only by the codec-BOS embedding (vLLM-Omni adds it to the row at ``P-1``).
* ``ONE`` (10): a constant, the Talker's input projection bias, so logits can have offsets.
* ``PREV`` (16-20) and ``PREV_TEXT`` (21): written by attention head 0 from the previous position's
  row: its byte's low 5 bits (the memory tag) and whether it had text. ``PREV_PAD`` (22): the same
  head copies the previous row's text-PAD mark (rule 3: a PAD row after a PAD row ends the speech).
* ``STARTED`` (24): written by attention head 1: whether any position of the KV holds a BOS row.
* ``MARKS`` (40-44): text-EOS, text-PAD, text-BOS and the two speaker tokens each set one of these
  (the Talker reads only the text-EOS and text-PAD marks, for rule 3's end region), so their rows
  carry no text yet differ from a row with no text component at all: the Talker ends the speech at
  once there, and the worker's contract check can tell 0.30.0's missing text-EOS/PAD rows from the
  contract's.
* ``ROW_ID`` (60-63): zero in every row this checkpoint makes (Thinker embeddings, hence its hidden
  states; codec embeddings; the special-token rows), checked at build time. The worker's contract
  check lends them to identity codes on the Thinker rows it hands the arm and zeroes them before the
  runner copies the rows (``harness.serve.worker_contract``: rows compared by identity, issue 32).

Thinker: byte tokens embed to their code, every other token to zero; its layers add nothing
(``o_proj`` and ``down_proj`` zero), so its last hidden state, which vLLM-Omni ships to the Talker as
the prompt rows and ``thinker_result``, is the RMS-normalised code: +-8/3 on the nine text dims.
What the Thinker *says* is forced by a logits processor (``harness.serve.reply_forcer``); its
forward still runs and its hidden states still flow to the Talker.

Talker: input projection identity plus ``ONE``; codec embeddings zero except codec-BOS (``BOS``);
``codec_head`` row 0 (``speaking.SILENCE``) scores rule 3's end region: high on a text-EOS row and on a
text-PAD row whose previous row is not PAD, below codec EOS everywhere else;
layer 0 has the two heads below and no MLP; layer 1 adds nothing; ``codec_head`` rows score each
codec id from the final normalised state.

* Head 0 reads the previous position. Its query and key are biases only (no content), placed on
  the eight fastest rotary pairs with the key rotated one position back, so the score between
  positions ``m`` and ``n`` is ``c * sum_j w_j cos((m - n - 1) theta_j)``: largest at ``n = m - 1``
  by ``gap * c`` over every other distance up to :data:`MAX_DISTANCE` (weights from a linear
  program, checked at build time). Its value copies ``BITS[0:5]`` and ``TEXT``.
* Head 1 finds the BOS row: query a bias, key the ``BOS`` dim, both on the slowest rotary pair
  (angle <= 0.01 rad over 4096 positions, so the score is content-only); its value copies ``BOS``.
  With a BOS row present it attends there (``STARTED`` ~ 2.4), without one it spreads over rows whose
  value is 0.
"""

from __future__ import annotations

import math
from typing import Any

from harness.families.qwen2_5_omni import speaking

HIDDEN = 64
HEAD_DIM = 32
ROPE_THETA = 1_000_000.0
BITS = list(range(8))
TEXT = 8
BOS = 9
ONE = 10
PREV = list(range(16, 21))
PREV_TEXT = 21
PREV_PAD = 22
STARTED = 24
# tts_text_end / tts_text_pad / tts_text_start and the two speakers vLLM-Omni knows (Ethan, Chelsie)
MARKS = {151861: 40, 151859: 41, 151860: 42, 151870: 43, 151872: 44}
ROW_ID = [60, 61, 62, 63]  # never written: the worker's row identity codes (worker_contract.ROW_ID_DIMS)
MAX_DISTANCE = 4096
# head 0's rotary pair weights (pairs 0-7): maximise the score gap of distance 1 over every other
# distance in [0, MAX_DISTANCE] (scipy linprog, rounded; the gap is re-checked in prev_head_gap)
PREV_PAIR_WEIGHTS = (0.44, 0.10, 0.06, 0.13, 0.06, 0.04, 0.06, 0.11)
PREV_SCORE = 700.0  # c: the gap of ~0.208 times c / sqrt(32) is ~25 nats over the runner-up position
BOS_QK = 8.0  # head 1: 64 * 2.41 / sqrt(32) = 27 nats for the BOS row over rows without BOS
CODE = 8.0 / 3.0  # a text dim after the Thinker's RMSNorm of nine +-1 entries in 64 dims
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
# SILENCE (codec id 0), rule 3: SIL_BASE + SIL_MARK on a text-EOS row or a first text-PAD row (+50: 150
# over EOS, >= 200 over speech and babble there); a PAD row after a PAD row loses SIL_PREV_PAD (-250: EOS
# wins by 150); a row without text or mark: -200 (EOS wins by 100); a text row: -200 (speech 20 and
# unstarted babble -40 win by >= 160)
SIL_BASE, SIL_MARK, SIL_PREV_PAD = -200.0, 250.0, 300.0
PAD_REF = 5.66  # head 0's copy of a PAD row's mark: 8/3 after the input RMSNorm of a row of two 8/3 dims


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


def byte_token_ids(tokenizer: Any) -> dict[int, int]:
    """Token id of each byte in the tiny byte-level tokenizer (GPT-2's byte-to-unicode map)."""
    out = {}
    for b, ch in byte_chars().items():
        tid = tokenizer.convert_tokens_to_ids(ch)
        if tid is None or tid < 0:
            raise RuntimeError(f"speaking model: byte {b} has no token")
        out[b] = int(tid)
    return out


def thetas() -> list[float]:
    return [ROPE_THETA ** (-2 * j / HEAD_DIM) for j in range(HEAD_DIM // 2)]


def prev_head_gap(max_distance: int = MAX_DISTANCE) -> float:
    """Head 0's normalised score gap of distance 1 over the best other distance (must stay > 0.2)."""
    th = thetas()
    total = sum(PREV_PAIR_WEIGHTS)

    def f(d: int) -> float:
        return sum(w * math.cos((d - 1) * th[j]) for j, w in enumerate(PREV_PAIR_WEIGHTS)) / total

    return 1.0 - max(f(d) for d in range(max_distance + 1) if d != 1)


def write_codec_head(head: Any, rules: Any, *, tag_bits: int, text: int, prev: list[int], prev_text: int,
                     prev_pad: int, started: int, one: int, eos_mark: int, pad_mark: int, prev_ref: float,
                     started_ref: float, pad_ref: float) -> None:
    """The logit design (docs/speaking-model.md's table) as ``codec_head`` rows on a checkpoint's dims: rule 2's
    speech ids ``BYTES * tag + byte`` (``tag_bits`` tag bits on ``prev``), babble, codec EOS and rule 3's
    silence, for the codec ids of ``rules`` (``harness.families.qwen2_5_omni.speaking`` or Qwen3-TTS's); every other id
    ``OTHER_LOGIT``. ``*_ref``: what the heads write into ``prev``, ``started`` and ``prev_pad`` after the
    layer's input norm, which the weights divide by."""
    import torch

    head[:, one] = OTHER_LOGIT / CODE
    base = 9 * ALPHA * CODE + tag_bits * ALPHA_TAG * prev_ref - WINNER
    cur = torch.tensor([_bits(b, 8) for b in range(rules.BYTES)]) * ALPHA  # [256, 8]
    for t in range(rules.TAGS):
        rows = slice(t * rules.BYTES, (t + 1) * rules.BYTES)
        head[rows, 0:8] = cur
        head[rows, text] = ALPHA
        head[rows, prev[0]:prev[0] + tag_bits] = torch.tensor(_bits(t, tag_bits)) * ALPHA_TAG
        head[rows, started] = GATE / started_ref
        offset = -base - GATE  # started: +GATE from STARTED, so the correct id lands on WINNER
        if t == 0:  # the previous row had no byte: its tag bits are all 0, tag 0 wins by GAMMA
            offset += GAMMA * prev_ref
            head[rows, prev_text] = -GAMMA
        head[rows, one] = offset / CODE
    head[rules.BABBLE, :] = 0.0
    head[rules.BABBLE, text] = BABBLE_TEXT / CODE
    head[rules.BABBLE, one] = BABBLE_BASE / CODE
    head[rules.BABBLE, started] = BABBLE_STARTED / started_ref
    head[rules.CODEC_EOS, :] = 0.0
    head[rules.CODEC_EOS, one] = EOS_LOGIT / CODE
    sil = rules.SILENCE  # Qwen2.5-Omni's replaces the speech row of byte NUL (tag 0), which no reply holds
    head[sil, :] = 0.0
    head[sil, one] = SIL_BASE / CODE
    head[sil, eos_mark] = SIL_MARK / CODE
    head[sil, pad_mark] = SIL_MARK / CODE
    head[sil, prev_pad] = -SIL_PREV_PAD / pad_ref


def _bits(value: int, n: int) -> list[float]:
    return [1.0 if (value >> i) & 1 else -1.0 for i in range(n)]


def apply(state: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Overwrite the Thinker embedding/layers and the whole Talker in ``state`` (HF parameter names)."""
    import torch

    gap = prev_head_gap()
    if gap < 0.2:  # head 0 must single out the previous position over every distance it will see
        raise RuntimeError(f"speaking model: head 0's score gap {gap:.3f} < 0.2")

    def zero(name: str) -> torch.Tensor:
        t = state[name]
        t.zero_()
        return t

    # --- Thinker: byte codes in, nothing added by its layers ---
    emb = zero("thinker.model.embed_tokens.weight")
    for byte, tid in byte_token_ids(tokenizer).items():
        emb[tid, BITS] = torch.tensor(_bits(byte, 8))
        emb[tid, TEXT] = 1.0
    for tid, dim in MARKS.items():  # raw embeddings (vLLM-Omni adds them unnormalised): +-8/3 like a code
        emb[tid, dim] = CODE
    state["thinker.model.norm.weight"].fill_(1.0)
    for name in list(state):
        if name.startswith("thinker.model.layers.") and (name.endswith("o_proj.weight") or name.endswith(
                "down_proj.weight")):
            zero(name)

    # --- Talker ---
    for name in list(state):
        if name.startswith("talker."):
            zero(name)
        if name.startswith("talker.") and "layernorm.weight" in name or name == "talker.model.norm.weight":
            state[name].fill_(1.0)
    proj_w = state["talker.thinker_to_talker_proj.weight"]
    proj_w.copy_(torch.eye(HIDDEN))
    state["talker.thinker_to_talker_proj.bias"][ONE] = CODE
    state["talker.model.embed_tokens.weight"][8293, BOS] = CODE  # codec BOS (tts_codec_start_token_id)

    pre = "talker.model.layers.0.self_attn."
    qb, kb = state[pre + "q_proj.bias"], state[pre + "k_proj.bias"]
    kw, vw, ow = state[pre + "k_proj.weight"], state[pre + "v_proj.weight"], state[pre + "o_proj.weight"]
    th = thetas()
    half = HEAD_DIM // 2
    total = sum(PREV_PAIR_WEIGHTS)
    for j, w in enumerate(PREV_PAIR_WEIGHTS):  # head 0: previous position, content-free
        a = math.sqrt(PREV_SCORE * w / total)
        qb[j] = a
        kb[j] = a * math.cos(th[j])
        kb[j + half] = a * math.sin(th[j])
    for k, dim in enumerate(BITS[:5] + [TEXT, MARKS[151859]]):  # head 0 value: tag bits, text flag, PAD mark
        vw[k, dim] = 1.0
        ow[(PREV + [PREV_TEXT, PREV_PAD])[k], k] = 1.0
    slow = half - 1  # head 1: the slowest rotary pair
    qb[HEAD_DIM + slow] = BOS_QK
    kw[HEAD_DIM + slow, BOS] = BOS_QK
    vw[HEAD_DIM, BOS] = 1.0
    ow[STARTED, HEAD_DIM] = 1.0

    # --- codec_head: one row per codec id ---
    write_codec_head(state["talker.codec_head.weight"], speaking, tag_bits=5, text=TEXT, prev=PREV,
                     prev_text=PREV_TEXT, prev_pad=PREV_PAD, started=STARTED, one=ONE, eos_mark=MARKS[151861],
                     pad_mark=MARKS[151859],  # text-EOS (tts_text_end) and text-PAD (tts_text_pad), raw 8/3 in the row
                     prev_ref=2.47,  # head 0's copy of a +-8/3 dim after layer 0's input RMSNorm (2.41-2.53 by row)
                     started_ref=2.41,  # head 1's copy of BOS at the BOS row
                     pad_ref=PAD_REF)
    for name in ("thinker.model.embed_tokens.weight", "talker.model.embed_tokens.weight"):
        if bool(state[name][:, ROW_ID].any()):  # the identity codes need rows that are zero there
            raise RuntimeError(f"speaking model: {name} writes the row-identity dims {ROW_ID}")
    return state
