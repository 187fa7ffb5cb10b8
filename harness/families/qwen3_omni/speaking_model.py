"""Weights that make the tiny Qwen3-Omni *speak*: its Talker says what its rows say
(``harness.families.qwen3_omni.speaking``), inside vLLM-Omni 0.30.0's unmodified Qwen3-Omni code.

Built by hand on the random state dict ``tiny_model`` makes (HF names), Qwen3-TTS's construction
(``harness.families.qwen3_tts.speaking_model``: the same hidden 64, two heads of 32, per-head q/k RMSNorm,
previous-position head, codec-BOS head, ``write_codec_head``) moved onto Qwen3-Omni's pieces:

* **The Thinker's embedding table** (``thinker.model.embed_tokens``) is Qwen3-TTS's ``text_embedding``: the
  release builds every Talker text row from it (``text_projection(thinker_embed)`` for the user turn, the
  assistant header and the reply; ``tts_bos``/``tts_eos``/``tts_pad`` are its rows of those tokens). A byte
  carries its bits (``BITS``, +-``CODE``) and ``TEXT``; ``tts_eos``, ``tts_pad``, ``tts_bos``,
  ``<|im_start|>`` and ``assistant`` one ``MARKS`` dim each; every other token zero. The Thinker's layers
  write nothing (``o_proj`` and every expert's ``down_proj`` zero): a safeguard, the Talker never reads
  past layer 0's input for a text prompt. What the Thinker *says* is forced (``harness.serve.reply_forcer``).
* **``text_projection``** (``fc2(silu(fc1(x)))``, intermediate 128): the identity, exactly, on all 64 dims
  (``silu(x) - silu(-x) = x``); ``hidden_projection`` (multimodal rows) zero.
* **``codec_embedding``**: zero but codec BOS (``BOS`` = ``CODE``); the code predictor's 15 residual
  embeddings zero (what it samples is never heard by the Talker); its body and heads stay random.
* **The Talker layer** (one Qwen3-MoE layer): attention as Qwen3-TTS's, whose q/k/v biases the tiny
  config's ``attention_bias: true`` gives (vLLM's ``Qwen3MoeAttention`` reads it as ``qkv_bias``; its
  ``o_proj`` has no bias, so the checkpoint's ``o_proj.bias`` is zero and vLLM's loader skips it); the MoE
  block writes nothing (every expert's and the shared expert's ``down_proj`` zero).
* **``codec_head``**: the shared logit design with a 2-bit tag (speech ids ``256 * tag + byte`` < 1024,
  babble 1024, silence 1025, codec EOS 2150), every other id ``OTHER_LOGIT``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from harness.families.qwen3_omni import speaking as sp
from harness.speaking.weights import (
    CODE,
    HEAD_DIM,
    PREV_PAIR_WEIGHTS,
    PREV_SCORE,
    bits,
    check_prev_head,
    check_row_id,
    write_codec_head,
    write_prev_head,
)

HIDDEN = 64
BITS = list(range(8))
TEXT = 8
MARKS = {sp.TTS_EOS: 9, sp.TTS_PAD: 10, sp.TTS_BOS: 11, sp.IM_START: 12, sp.ASSISTANT: 13}
BOS = 14  # codec BOS (the text embedding writes dims < 14 only)
PREV = [16, 17]  # head 0: the previous byte's tag bits
PREV_TEXT = 19
PREV_PAD = 20
STARTED = 24  # head 1: a codec-BOS row in the KV
ONE = 25  # head 1's value bias: CODE at every position
ROW_ID = [60, 61, 62, 63]  # never written: free for a worker's row-identity codes
TAG_BITS = 2  # log2(sp.TAGS)
PREV_REF = 8.0 / 3.0  # head 0's copy of a +-CODE dim of a byte row after the input norm (nine dims)
STARTED_REF = 8.0 / math.sqrt(10.0)  # head 1's copy of BOS at the P-1 row (r_0 + codec BOS)
PAD_REF = 8.0  # head 0's copy of a tts_pad row's mark
BOS_QK = 12.4  # head 1: 12.4 * 12.4 / sqrt(32) = 27 nats for the BOS row over rows without it
_THINKER_WRITES = re.compile(r"^thinker\.model\.layers\.\d+\.(self_attn\.o_proj\.weight|mlp\..*down_proj\.weight)$")


def apply(state: dict[str, Any]) -> dict[str, Any]:
    """Overwrite the Thinker's embedding and layer outputs and the Talker's weights in ``state`` (HF names)."""
    import torch

    check_prev_head()
    # --- the Thinker: its embedding table is the text side; its layers write nothing ---
    emb = state["thinker.model.embed_tokens.weight"]
    if emb.shape[1] != HIDDEN:
        raise RuntimeError(f"speaking model: the Thinker's hidden size is {emb.shape[1]}, not {HIDDEN}")
    emb.zero_()
    for b in range(sp.BYTES):
        emb[b, BITS] = torch.tensor(bits(b, 8)) * CODE
        emb[b, TEXT] = CODE
    for tid, dim in MARKS.items():
        emb[tid, dim] = CODE
    for name in state:
        if _THINKER_WRITES.match(name):
            state[name].zero_()

    # --- the Talker: zero, norms 1; the code predictor's body and heads stay random ---
    for name in list(state):
        if name.startswith("talker.") and not name.startswith("talker.code_predictor."):
            state[name].fill_(1.0 if name.endswith("norm.weight") else 0.0)
        if name.startswith("talker.code_predictor.model.codec_embedding."):
            state[name].zero_()  # residual codebooks add nothing to the Talker's next row
    fc1, fc2 = state["talker.text_projection.linear_fc1.weight"], state["talker.text_projection.linear_fc2.weight"]
    width = fc1.shape[1]
    if fc1.shape[0] < 2 * width:
        raise RuntimeError(f"speaking model: text_projection's intermediate {fc1.shape[0]} < 2 x {width}")
    for j in range(width):
        fc1[j, j], fc1[width + j, j] = 1.0, -1.0
        fc2[j, j], fc2[j, width + j] = 1.0, -1.0
    state["talker.model.codec_embedding.weight"][sp.CODEC_BOS, BOS] = CODE

    # --- layer 0 attention (Qwen3-TTS's heads) ---
    pre = "talker.model.layers.0.self_attn."
    if pre + "q_proj.bias" not in state:
        raise RuntimeError("speaking model: the Talker has no attention bias (its config needs attention_bias: true)")
    qb, kb, vb = state[pre + "q_proj.bias"], state[pre + "k_proj.bias"], state[pre + "v_proj.bias"]
    kw, vw, ow = state[pre + "k_proj.weight"], state[pre + "v_proj.weight"], state[pre + "o_proj.weight"]
    qn, kn = state[pre + "q_norm.weight"], state[pre + "k_norm.weight"]
    hd = HEAD_DIM // 2
    write_prev_head(qb, kb, vw, ow, BITS[:TAG_BITS] + [TEXT, MARKS[sp.TTS_PAD]], PREV + [PREV_TEXT, PREV_PAD])
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

    # --- codec_head ---
    write_codec_head(state["talker.codec_head.weight"], sp.TABLE, tag_bits=TAG_BITS, text=TEXT, prev=PREV,
                     prev_text=PREV_TEXT, prev_pad=PREV_PAD, started=STARTED, one=ONE,
                     eos_mark=MARKS[sp.TTS_EOS], pad_mark=MARKS[sp.TTS_PAD], prev_ref=PREV_REF,
                     started_ref=STARTED_REF, pad_ref=PAD_REF)
    check_row_id(state, ("thinker.model.embed_tokens.weight", "talker.model.codec_embedding.weight"), ROW_ID)
    return state
