"""Weights that make the tiny Qwen2.5-Omni *speak*: its Talker says what its rows say (``harness.families.qwen2_5_omni.speaking``).

Built by hand, not trained, on top of the random tiny checkpoint (``harness.families.qwen2_5_omni.tiny_model``), and
run by vLLM-Omni 0.30.0's unmodified model code. Every number below is what it is for a reason
written beside it; docs/speaking-model.md has the whole construction and what it cannot model. The
pieces every speaking Talker shares (head 0's rotary pair weights, the logit design and its constants)
are ``harness.speaking.weights``'s; this module places them on Qwen2.5-Omni's dims.

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
  by ``gap * c`` over every other distance up to ``MAX_DISTANCE`` (weights from a linear
  program, checked at build time; ``harness.speaking.weights``). Its value copies ``BITS[0:5]`` and ``TEXT``.
* Head 1 finds the BOS row: query a bias, key the ``BOS`` dim, both on the slowest rotary pair
  (angle <= 0.01 rad over 4096 positions, so the score is content-only); its value copies ``BOS``.
  With a BOS row present it attends there (``STARTED`` ~ 2.4), without one it spreads over rows whose
  value is 0.
"""

from __future__ import annotations

from typing import Any

from harness.families.qwen2_5_omni import speaking
from harness.speaking.weights import (
    CODE,
    HEAD_DIM,
    bits,
    byte_chars,
    check_prev_head,
    check_row_id,
    write_codec_head,
    write_prev_head,
)

HIDDEN = 64
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
BOS_QK = 8.0  # head 1: 64 * 2.41 / sqrt(32) = 27 nats for the BOS row over rows without BOS
PAD_REF = 5.66  # head 0's copy of a PAD row's mark: 8/3 after the input RMSNorm of a row of two 8/3 dims


def byte_token_ids(tokenizer: Any) -> dict[int, int]:
    """Token id of each byte in the tiny byte-level tokenizer (GPT-2's byte-to-unicode map)."""
    out = {}
    for b, ch in byte_chars().items():
        tid = tokenizer.convert_tokens_to_ids(ch)
        if tid is None or tid < 0:
            raise RuntimeError(f"speaking model: byte {b} has no token")
        out[b] = int(tid)
    return out


def apply(state: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Overwrite the Thinker embedding/layers and the whole Talker in ``state`` (HF parameter names)."""
    import torch

    check_prev_head()

    def zero(name: str) -> torch.Tensor:
        t = state[name]
        t.zero_()
        return t

    # --- Thinker: byte codes in, nothing added by its layers ---
    emb = zero("thinker.model.embed_tokens.weight")
    for byte, tid in byte_token_ids(tokenizer).items():
        emb[tid, BITS] = torch.tensor(bits(byte, 8))
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
    # head 0: previous position, content-free; its value: tag bits, text flag, PAD mark
    write_prev_head(qb, kb, vw, ow, BITS[:5] + [TEXT, MARKS[151859]], PREV + [PREV_TEXT, PREV_PAD])
    slow = HEAD_DIM // 2 - 1  # head 1: the slowest rotary pair
    qb[HEAD_DIM + slow] = BOS_QK
    kw[HEAD_DIM + slow, BOS] = BOS_QK
    vw[HEAD_DIM, BOS] = 1.0
    ow[STARTED, HEAD_DIM] = 1.0

    # --- codec_head: one row per codec id ---
    write_codec_head(state["talker.codec_head.weight"], speaking.TABLE, tag_bits=5, text=TEXT, prev=PREV,
                     prev_text=PREV_TEXT, prev_pad=PREV_PAD, started=STARTED, one=ONE, eos_mark=MARKS[151861],
                     pad_mark=MARKS[151859],  # text-EOS (tts_text_end) and text-PAD (tts_text_pad), raw 8/3 in the row
                     prev_ref=2.47,  # head 0's copy of a +-8/3 dim after layer 0's input RMSNorm (2.41-2.53 by row)
                     started_ref=2.41,  # head 1's copy of BOS at the BOS row
                     pad_ref=PAD_REF)
    # the identity codes need rows that are zero there
    check_row_id(state, ("thinker.model.embed_tokens.weight", "talker.model.embed_tokens.weight"), ROW_ID)
    return state
