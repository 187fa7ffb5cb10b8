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

import re
from typing import Any

from harness.families.qwen3_omni import speaking as sp
# the dims and references of Qwen3-TTS's Talker design, which this Talker shares (write_talker)
from harness.families.qwen3_tts.speaking_model import (  # noqa: F401 - the shared dims, part of this design
    BOS, BOS_QK, ONE, PAD_REF, PREV_PAD, PREV_REF, PREV_TEXT, STARTED, STARTED_REF, TEXT, write_talker,
)
from harness.speaking.weights import (
    CODE,
    bits,
    check_prev_head,
    check_row_id,
)

HIDDEN = 64
BITS = list(range(8))
MARKS = {sp.TTS_EOS: 9, sp.TTS_PAD: 10, sp.TTS_BOS: 11, sp.IM_START: 12, sp.ASSISTANT: 13}
PREV = [16, 17]  # head 0: the previous byte's tag bits
ROW_ID = [60, 61, 62, 63]  # never written: free for a worker's row-identity codes
TAG_BITS = 2  # log2(sp.TAGS)
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
    write_talker(state, sp.TABLE, PREV, TAG_BITS, MARKS[sp.TTS_PAD], MARKS[sp.TTS_EOS])
    check_row_id(state, ("thinker.model.embed_tokens.weight", "talker.model.codec_embedding.weight"), ROW_ID)
    return state
