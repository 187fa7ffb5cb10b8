"""Checks a speaking tiny Qwen3-TTS checkpoint without vLLM or transformers: the rules hold, with margins.

``python -m harness.families.qwen3_tts.speaking_check MODEL_DIR [--dtype bfloat16|float32]`` prints one
JSON object and exits 0 when every case holds (1 otherwise, 2 on bad input).

Why its own forward: transformers has no Qwen3-TTS class, and the check must not depend on the code
under test. This module reads ``config.json`` and ``model.safetensors`` and runs the Talker as
vLLM-Omni 0.30.0's does (``qwen3_tts_talker.py``: the row is ``text_projection(text_embedding(t))`` plus
``codec_embedding(c)``; vLLM's ``Qwen3Model``: RMSNorm, q/k/v with bias, per-head q/k RMSNorm, neox
rotary embedding, causal softmax attention scaled by ``head_dim ** -0.5``, SiLU MLP, final RMSNorm;
``compute_logits`` keeps codec ids ``[1, codebook)`` and EOS), in ``--dtype`` (vLLM runs the Talker in
bfloat16 on CPU).

Every case builds the rows the release would build (or a corrupted variant), runs one causal forward
over all of them (teacher forcing: the logits at ``m`` see rows ``0..m``, as the KV does), and compares
the argmax at every sampled position ``m >= P - 1`` with ``speaking.say`` on the same rows. The
margin is the rule's logit minus the best other allowed logit (after the final norm, before the
temperature); ``min_prob`` the rule's probability under temperature 0.9 and top-k 50 (the deploy's).

Cases: ``correct`` (the contract's rows: the text, then SILENCE, SILENCE, EOS); ``no_bos`` (codec PAD
instead of BOS at ``P - 1``: babble); ``v1_replay`` (0.30.0 on V1 after a preemption: replayed
positions get ``tts_pad`` and no codec row); ``wrong_row`` (one decode row carries another byte: that
byte is said, and the next byte's tag follows it); ``stale_prev`` (a row rewritten after its token was
said: the next id changes, the listener loses that word); ``bare`` (a decode row with no text part:
codec EOS); ``long`` (the correct case at positions past 3900); ``other_voice`` (the correct rows with another
speaker's row: the same speech).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from harness.families.qwen3_tts import speaking as sp
from harness.speaking.selfcheck import check_main, score_case, summarize

TEXT = "Heat the water until it is hot, then wait two minutes."
Tok = tuple[int | None, int | None]  # (text token id or None, codec id or None): one input row


def release_rows(text: str, speaker: str = sp.DEFAULT_SPEAKER, end: int = 3) -> list[Tok]:
    """The rows 0.30.0's builder and decode path give a CustomVoice request in the streaming-text layout."""
    raw = sp.text_token_ids(text)
    spk = sp.SPEAKERS[speaker.lower()]
    rows: list[Tok] = [(sp.IM_START, None), (sp.ASSISTANT, None), (ord("\n"), None)]
    rows += [(sp.TTS_PAD, c) for c in (sp.CODEC_NOTHINK, sp.CODEC_THINK_BOS, sp.CODEC_THINK_EOS, spk)]
    rows += [(sp.TTS_BOS, sp.CODEC_PAD), (raw[0], sp.CODEC_BOS)]
    said = sp.encode_reply(text)
    # decode position P + k carries the id said at P - 1 + k and trailing_text[k]
    for k, t in enumerate(raw[1:] + [sp.TTS_EOS] + [sp.TTS_PAD] * end):
        rows.append((t, said[k] if k < len(said) else sp.CODEC_EOS))
    return rows


def rule_rows(rows: list[Tok]) -> list[sp.Row]:
    """What the rules read of each row."""
    marks = {sp.TTS_EOS: sp.EOS_MARK, sp.TTS_PAD: sp.PAD_MARK, sp.TTS_BOS: sp.BOS_MARK}
    return [sp.Row(byte=t if t is not None and t < sp.BYTES else None, mark=marks.get(t),  # type: ignore[arg-type]
                   bos=c == sp.CODEC_BOS) for t, c in rows]


class Talker:
    """The tiny Talker's forward (one causal pass over given rows), from the checkpoint's files."""

    def __init__(self, model_dir: Path, dtype_name: str) -> None:
        import torch
        from safetensors.torch import load_file

        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["talker_config"]
        self.cfg = cfg
        self.dtype = getattr(torch, dtype_name)
        w = load_file(str(model_dir / "model.safetensors"))
        self.w = {k: v.to(self.dtype) for k, v in w.items() if not k.startswith("talker.code_predictor.")}
        self.heads, self.kv_heads, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.eps = cfg["rms_norm_eps"]
        self.theta = cfg["rope_theta"]
        self.codebook = cfg["code_predictor_config"]["vocab_size"]
        self.eos = cfg["codec_eos_token_id"]

    def _norm(self, x: Any, weight: Any) -> Any:
        import torch

        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(self.dtype) * weight

    def embed(self, rows: list[Tok]) -> Any:
        import torch
        import torch.nn.functional as F

        w = self.w
        h = w["talker.codec_head.weight"].shape[1]
        out = torch.zeros(len(rows), h, dtype=self.dtype)
        for i, (t, c) in enumerate(rows):
            if t is not None:
                e = self._text_row(t)
                mid = F.silu(e @ w["talker.text_projection.linear_fc1.weight"].T
                             + w["talker.text_projection.linear_fc1.bias"])
                out[i] += mid @ w["talker.text_projection.linear_fc2.weight"].T + w["talker.text_projection.linear_fc2.bias"]
            if c is not None:
                out[i] += w["talker.model.codec_embedding.weight"][c]
        return out

    def _text_row(self, t: int) -> Any:
        """The text embedding of token ``t`` before ``text_projection`` (Qwen3-Omni's is the Thinker's table)."""
        return self.w["talker.model.text_embedding.weight"][t]

    def _proj(self, a: Any, pre: str, p: str, heads: int) -> Any:
        y = a @ self.w[pre + f"self_attn.{p}_proj.weight"].T
        bias = self.w.get(pre + f"self_attn.{p}_proj.bias")
        if bias is not None:
            y = y + bias
        return y.reshape(a.shape[0], heads, self.hd)

    def _mlp(self, m: Any, pre: str) -> Any:
        """The layer's MLP on its normed input (a dense SwiGLU here; Qwen3-Omni's Talker is MoE)."""
        import torch.nn.functional as F

        w = self.w
        return (F.silu(m @ w[pre + "mlp.gate_proj.weight"].T) * (m @ w[pre + "mlp.up_proj.weight"].T)) \
            @ w[pre + "mlp.down_proj.weight"].T

    def _mask(self, out: Any) -> Any:
        """The ids the release lets the Talker sample (the codebook but id 0, and codec EOS)."""
        import torch

        allowed = torch.zeros(out.shape[1], dtype=torch.bool)
        allowed[1:self.codebook] = True
        allowed[self.eos] = True
        return out.masked_fill(~allowed, float("-inf"))

    def logits(self, rows: list[Tok], offset: int = 0) -> Any:
        """Masked logits (float32) at every position of ``rows`` placed at positions ``offset ..``."""
        import torch

        w, hd, n = self.w, self.hd, len(rows)
        x = self.embed(rows)
        pos = torch.arange(offset, offset + n, dtype=torch.float64)
        inv = self.theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = pos[:, None] * inv[None, :]
        cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
        i = 0
        while f"talker.model.layers.{i}.input_layernorm.weight" in w:
            pre = f"talker.model.layers.{i}."
            a = self._norm(x, w[pre + "input_layernorm.weight"])

            q = self._norm(self._proj(a, pre, "q", self.heads), w[pre + "self_attn.q_norm.weight"])
            k = self._norm(self._proj(a, pre, "k", self.kv_heads), w[pre + "self_attn.k_norm.weight"])
            v = self._proj(a, pre, "v", self.kv_heads)

            def rope(t: Any) -> Any:
                t = t.float()
                x1, x2 = t[..., : hd // 2], t[..., hd // 2:]
                c, s = cos[:, None, :], sin[:, None, :]
                return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(self.dtype)

            q, k = rope(q), rope(k)
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(hd)
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
            probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1).to(self.dtype)
            att = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
            x = x + att @ w[pre + "self_attn.o_proj.weight"].T
            x = x + self._mlp(self._norm(x, w[pre + "post_attention_layernorm.weight"]), pre)
            i += 1
        return self._mask((self._norm(x, w["talker.model.norm.weight"]) @ w["talker.codec_head.weight"].T).float())


def check_case(talker: Talker, rows: list[Tok], offset: int = 0) -> dict[str, Any]:
    """Argmax vs the rule at every sampled position (from ``P - 1``); the smallest margin and probability."""
    return score_case(talker.logits(rows, offset), rule_rows(rows), sp.PROMPT_LEN - 1, sp)


def cases() -> dict[str, tuple[list[Tok], int]]:
    """Each case's rows and position offset."""
    P = sp.PROMPT_LEN
    good = release_rows(TEXT)
    no_bos = list(good)
    no_bos[P - 1] = (no_bos[P - 1][0], sp.CODEC_PAD)
    replay = [(sp.TTS_PAD, None)] * (P + 6) + good[P + 6:]  # V1: the replayed span gets tts_pad, no codec row
    wrong = list(good)
    wrong[P + 5] = (ord("q"), wrong[P + 5][1])
    stale = list(good)
    stale[P + 5] = (ord("x"), stale[P + 5][1])  # the row at P + 5 rewritten with another byte after it was said
    bare = list(good)
    bare[P + 8] = (None, bare[P + 8][1])
    voice = release_rows(TEXT, "Ono_Anna")  # another voice: its own speaker row, the same speech
    return {"correct": (good, 0), "no_bos": (no_bos, 0), "v1_replay": (replay, 0), "wrong_row": (wrong, 0),
            "stale_prev": (stale, 0), "bare": (bare, 0), "long": (good, 3900), "other_voice": (voice, 0)}


def run(model_dir: Path, dtype_name: str = "bfloat16") -> dict[str, Any]:
    talker = Talker(model_dir, dtype_name)
    results: dict[str, Any] = {"P": sp.PROMPT_LEN, "text": TEXT, "dtype": dtype_name}
    for name, (rows, offset) in cases().items():
        results[name] = check_case(talker, rows, offset)
    return summarize(results, cases(), TEXT)


def _refuse(model_dir: Path) -> str | None:
    if not (model_dir / "config.json").is_file() or not (model_dir / "model.safetensors").is_file():
        return f"{model_dir}: not a tiny Qwen3-TTS checkpoint (no config.json and model.safetensors)"
    return None


def main(argv: list[str] | None = None) -> int:
    return check_main(argv, "python -m harness.families.qwen3_tts.speaking_check", run, _refuse)


if __name__ == "__main__":
    sys.exit(main())
