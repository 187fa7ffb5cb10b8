"""Weights that make the tiny Qwen3-TTS *speak*: its Talker says what its rows say
(``harness.families.qwen3_tts.speaking``), inside vLLM-Omni 0.30.0's unmodified Qwen3-TTS code.

Built by hand, not trained. The pieces it shares with Qwen2.5-Omni's construction come from
``harness.speaking.weights`` (the rotary "previous position" head and its pair weights, the logit
design); what differs is where the rows come from and Qwen3's attention (q/k RMSNorm per head).

**Where a Talker row comes from** (docs/families/qwen3_tts.md's contract table): position ``p``'s input row
is ``text_projection(text_embedding(text token))`` plus a codec embedding (``codec_embedding(id)``;
at a decode step also the 15 residual codebooks' embeddings, which the code predictor samples).

* ``text_embedding``: a byte token carries its bits (``BITS``, +-``CODE``) and ``TEXT`` (``CODE``);
  ``tts_eos``, ``tts_pad``, ``tts_bos``, ``<|im_start|>`` and ``assistant`` one ``MARKS`` dim each
  (``CODE``); every other token zero.
* ``text_projection`` (``fc2(silu(fc1(x)))``, both with bias): the identity, exactly:
  ``fc1`` writes ``x`` and ``-x`` to two channel halves, ``fc2`` subtracts them, and
  ``silu(x) - silu(-x) = x``.
* ``codec_embedding``: zero except codec BOS (``BOS`` = ``CODE``), the CustomVoice speakers (``VOICE``: a
  value of its own per speaker) and the think tags (``THINK``: one per tag), on dims no weight reads: a
  request's speech is the same in every voice, but the prompt rows at ``3 .. P - 3`` are distinct by value,
  so the worker's contract check (which compares values) sees a request conditioned on another's voice and
  a replayed prompt row without its codec part, as the sim's identities do (issue 45); the code predictor's 15
  residual embeddings zero, so what the code predictor samples is never heard by the Talker.

**The Talker** (one Qwen3 layer, hidden 64, two heads of 32, no MLP: ``down_proj`` zero):

* head 0 reads the previous position: query and key are biases only (their projection weights
  zero), on the eight fastest rotary pairs, the key rotated one position back, as in Qwen2.5-Omni's
  construction (``harness.speaking.weights.write_prev_head``); Qwen3 RMS-normalises each head's query and key, so ``q_norm``/``k_norm`` weights on
  those dims equal the biases' RMS, which gives the bias back. Its value copies the previous row's
  tag bits (``BITS[0:3]``), ``TEXT`` and the ``tts_pad`` mark into ``PREV``, ``PREV_TEXT``, ``PREV_PAD``.
* head 1 finds the codec-BOS row: query a bias, key the ``BOS`` dim, both on the slowest rotary
  pair (content-only score); after ``k_norm`` a BOS row's key is the same whatever its scale, a row
  without BOS has key 0. Its value copies ``BOS`` to ``STARTED``, and its value *bias* writes
  ``ONE`` = ``CODE`` into every position (attention weights sum to 1): the constant the logits'
  offsets need (Qwen3's rows have no projection bias that reaches a bare codec row).
* ``codec_head`` (``lm_head``): the logit design Qwen2.5-Omni's has too
  (``harness.speaking.weights.write_codec_head``) on these dims (speech id
  ``256 * tag + byte``, babble, silence, EOS); margins in docs/families/qwen3_tts.md.
"""

from __future__ import annotations

import math
from typing import Any

from harness.families.qwen3_tts import speaking as sp
from harness.speaking.weights import (
    CODE,
    HEAD_DIM,
    PREV_PAIR_WEIGHTS,
    PREV_SCORE,
    ROPE_THETA,  # noqa: F401 - the Talker config's (tiny_model)
    bits,
    check_prev_head,
    check_row_id,
    write_codec_head,
    write_prev_head,
)

HIDDEN = 64
TEXT_HIDDEN = 64
HEADS = 2
BITS = list(range(8))
TEXT = 8
MARKS = {sp.TTS_EOS: 9, sp.TTS_PAD: 10, sp.TTS_BOS: 11, sp.IM_START: 12, sp.ASSISTANT: 13}
BOS = 14  # codec BOS (outside the text projection's reach: it writes dims < 32 from text dims < 14)
PREV = [16, 17, 18]  # head 0: the previous byte's tag bits
PREV_TEXT = 19
PREV_PAD = 20
STARTED = 24  # head 1: a codec-BOS row in the KV
ONE = 25  # head 1's value bias: CODE at every position
# the speaker's codec row: CODE * (k + 1) / 9 for the k-th speaker (distinct in bfloat16). Read by no weight; it
# changes only the speaker row's scale after the input norm, which the previous-position head copies into the
# row at P - 2, whose logits are never sampled (the first sampled position, P - 1, reads P - 2)
VOICE = 40
THINK = 41  # the think tags' codec rows (the prompt's positions 3-5): CODE * (k + 1) / 4, read by no weight either
ROW_ID = [60, 61, 62, 63]  # never written (zero in every row): free for a worker's row-identity codes
TAG_BITS = 3  # log2(sp.TAGS)
# head 0's copy of a +-CODE dim after the layer's input RMSNorm: a byte row has nine such dims (8/3 each
# after the norm); the row at P-1 also has BOS (8/sqrt(10) = 2.53); a tts_pad row has one dim (8)
PREV_REF = 8.0 / 3.0
STARTED_REF = 8.0 / math.sqrt(10.0)  # head 1's copy of BOS at the P-1 row (first byte + codec BOS)
PAD_REF = 8.0  # head 0's copy of a tts_pad row's mark
BOS_QK = 12.4  # head 1: 12.4 * 12.4 / sqrt(32) = 27 nats for the BOS row over rows without it
# the logit design's constants are harness.speaking.weights's (``write_codec_head``, docs/speaking-model.md)


BASE_VOICES = 4  # the Base voices of the CPU prompt sets (prompts/voices/tiny-base-*.npy)


def base_voice(k: int) -> list[float]:
    """The ``k``-th speaker embedding the speaking tiny Base checkpoint takes (a prompt's ``speaker_embedding``):
    zero but ``VOICE`` (``CODE * (k + 1) / BASE_VOICES``), so its row (``tts_pad`` + the vector) is a CustomVoice
    speaker's row in all but its value there: the same speech, and a voice the worker's value comparison tells
    apart. A real x-vector (ECAPA, 1024 or 2048 values) would make the tiny Talker babble."""
    if not 0 <= k < BASE_VOICES:
        raise ValueError(f"base voice {k}: the tiny checkpoint's are 0..{BASE_VOICES - 1}")
    vector = [0.0] * HIDDEN
    vector[VOICE] = CODE * (k + 1) / BASE_VOICES
    return vector


def write_talker(state: dict[str, Any], table: Any, prev: list[int], tag_bits: int, pad: int, eos: int) -> None:
    """Layer 0's attention and the codec head, on the dims above: head 0 copies the previous position's tag
    bits, TEXT and tts_pad mark (``prev`` + PREV_TEXT, PREV_PAD), head 1 finds a codec-BOS row (STARTED) and
    writes ONE everywhere; the codec head is the shared logit design for ``table``. Qwen3-Omni's Talker has the
    same shape (``harness.families.qwen3_omni.speaking_model``) with its own table and tag bits. ``pad``,
    ``eos``: the dims of the tts_pad and tts_eos marks."""
    pre = "talker.model.layers.0.self_attn."
    qb, kb, vb = state[pre + "q_proj.bias"], state[pre + "k_proj.bias"], state[pre + "v_proj.bias"]
    kw, vw, ow = state[pre + "k_proj.weight"], state[pre + "v_proj.weight"], state[pre + "o_proj.weight"]
    qn, kn = state[pre + "q_norm.weight"], state[pre + "k_norm.weight"]
    hd = HEAD_DIM // 2
    # head 0: previous position, content-free; its value copies tag bits, TEXT and the tts_pad mark -> PREV*
    write_prev_head(qb, kb, vw, ow, BITS[:tag_bits] + [TEXT, pad], prev + [PREV_TEXT, PREV_PAD])
    rms0 = math.sqrt(PREV_SCORE / HEAD_DIM)  # the biases' RMS over the head: q_norm/k_norm give it back
    for j in range(len(PREV_PAIR_WEIGHTS)):
        qn[j] = kn[j] = qn[j + hd] = kn[j + hd] = rms0
    slow = hd - 1  # head 1: the slowest rotary pair; after the norm a one-dim vector is sqrt(32) * weight
    qb[HEAD_DIM + slow] = 1.0
    qn[slow] = BOS_QK / math.sqrt(HEAD_DIM)
    kw[HEAD_DIM + slow, BOS] = 1.0
    kn[slow] = BOS_QK / math.sqrt(HEAD_DIM)
    vw[HEAD_DIM, BOS] = 1.0  # head 1's value slot 0: BOS -> STARTED
    ow[STARTED, HEAD_DIM] = 1.0
    vb[HEAD_DIM + 1] = CODE  # head 1's value slot 1: a bias -> ONE at every position
    ow[ONE, HEAD_DIM + 1] = 1.0

    # --- codec_head: one row per codec id (the shared logit design on these dims) ---
    write_codec_head(state["talker.codec_head.weight"], table, tag_bits=tag_bits, text=TEXT, prev=prev,
                     prev_text=PREV_TEXT, prev_pad=PREV_PAD, started=STARTED, one=ONE,
                     eos_mark=eos, pad_mark=pad, prev_ref=PREV_REF, started_ref=STARTED_REF, pad_ref=PAD_REF)


def apply(state: dict[str, Any]) -> dict[str, Any]:
    """Overwrite the Talker's weights in ``state`` (HF names, ``talker.`` prefix) with the construction."""
    import torch

    check_prev_head()
    for name in list(state):  # the Talker: zero, norms 1; the code predictor's body and heads stay random
        if name.startswith("talker.") and not name.startswith("talker.code_predictor."):
            state[name].fill_(1.0 if name.endswith("norm.weight") else 0.0)
        if name.startswith("talker.code_predictor.model.codec_embedding."):
            state[name].zero_()  # residual codebooks add nothing to the Talker's next row

    # --- text side: byte codes and marks, projected unchanged ---
    emb = state["talker.model.text_embedding.weight"]
    for b in range(sp.BYTES):
        emb[b, BITS] = torch.tensor(bits(b, 8)) * CODE
        emb[b, TEXT] = CODE
    for tid, dim in MARKS.items():
        emb[tid, dim] = CODE
    half = TEXT_HIDDEN // 2
    fc1, fc2 = state["talker.text_projection.linear_fc1.weight"], state["talker.text_projection.linear_fc2.weight"]
    for j in range(half):
        fc1[j, j], fc1[half + j, j] = 1.0, -1.0
        fc2[j, j], fc2[j, half + j] = 1.0, -1.0
    state["talker.model.codec_embedding.weight"][sp.CODEC_BOS, BOS] = CODE
    for k, spk in enumerate(sorted(sp.SPEAKERS.values())):
        state["talker.model.codec_embedding.weight"][spk, VOICE] = CODE * (k + 1) / len(sp.SPEAKERS)
    tags = (sp.CODEC_THINK, sp.CODEC_NOTHINK, sp.CODEC_THINK_BOS, sp.CODEC_THINK_EOS)
    for k, tag in enumerate(tags):
        state["talker.model.codec_embedding.weight"][tag, THINK] = CODE * (k + 1) / len(tags)

    write_talker(state, sp.TABLE, PREV, TAG_BITS, MARKS[sp.TTS_PAD], MARKS[sp.TTS_EOS])
    check_row_id(state, ("talker.model.text_embedding.weight", "talker.model.codec_embedding.weight"), ROW_ID)
    return state
