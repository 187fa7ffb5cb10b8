"""Checks a speaking tiny Qwen3-Omni checkpoint without vLLM or transformers: the rules hold, with margins.

``python -m harness.families.qwen3_omni.speaking_check MODEL_DIR [--dtype bfloat16|float32]`` prints one
JSON object and exits 0 when every case holds (1 otherwise, 2 on bad input).

Its own forward, from ``config.json`` and ``model.safetensors``, as vLLM-Omni 0.30.0 runs it: a row is
``text_projection(thinker.embed_tokens(t))`` (the release's ``_get_talker_user_parts``,
``_get_talker_assistant_parts``, ``_get_tts_embed``, the decode ``text_step``) plus
``codec_embedding(c)`` (the code predictor's residual embeddings are zero); the Talker is vLLM's
``Qwen3MoeModel``: RMSNorm, q/k/v with bias, per-head q/k RMSNorm, neox rotary embedding (M-RoPE with the
three position components equal, as for a text prompt), causal softmax attention, the MoE block (softmax
router, top-k, the shared expert behind its sigmoid gate), final RMSNorm, ``codec_head``; the release's
``compute_logits`` suppresses the top 1,024 ids but codec EOS. In ``--dtype`` (the release casts the rows
to bfloat16).

Every case builds the rows the release would build for a user turn and a forced reply (or a corrupted
variant), runs one causal forward (teacher forcing), and compares the argmax at every sampled position
``m >= P - 1`` with ``speaking.say``. Margin: the rule's logit minus the best other allowed logit;
``min_prob``: the rule's probability under temperature 0.9, top-k 50 (the shipped Talker sampling).

Cases (Qwen3-TTS's): ``correct``, ``no_bos`` (codec PAD at ``P - 1``: babble), ``v1_replay`` (replayed
positions get ``tts_pad`` and no codec row), ``wrong_row`` (a decode row carries another byte),
``stale_prev``, ``bare`` (a decode row with no text part: codec EOS), ``long`` (positions past 3900),
``full_payload_tail`` (0.30.0's full payload without the reply's last row: the reply minus its last byte).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from harness.families.qwen3_omni import speaking as sp
from harness.families.qwen3_tts.speaking_check import Talker as TTSTalker
from harness.speaking.selfcheck import check_main, score_case, summarize

USER = "Say hello."
TEXT = "Heat the water until it is hot, then wait two minutes."
Tok = tuple[int | None, int | None]  # (Thinker token id or None, codec id or None): one Talker input row


def release_rows(user: str, text: str, speaker: str = sp.DEFAULT_SPEAKER, end: int = 3) -> list[Tok]:
    """The rows 0.30.0's ``talker_preprocess`` gives a text request (user turn, assistant block, decode)."""
    raw = sp.text_token_ids(text)
    rows: list[Tok] = [(t, None) for t in [sp.IM_START, sp.USER, sp.NL, *sp.text_token_ids(user), sp.IM_END, sp.NL]]
    rows += [(sp.IM_START, None), (sp.ASSISTANT, None), (sp.NL, None)]
    rows += [(sp.TTS_PAD, c) for c in (sp.CODEC_NOTHINK, sp.CODEC_THINK_BOS, sp.CODEC_THINK_EOS, sp.SPEAKERS[speaker])]
    rows += [(sp.TTS_BOS, sp.CODEC_PAD), (raw[0], sp.CODEC_BOS)]
    said = sp.encode_reply(text)
    for k, t in enumerate(raw[1:] + [sp.TTS_EOS] + [sp.TTS_PAD] * end):
        rows.append((t, said[k] if k < len(said) else sp.CODEC_EOS))
    return rows


def rule_rows(rows: list[Tok]) -> list[sp.Row]:
    marks = {sp.TTS_EOS: sp.EOS_MARK, sp.TTS_PAD: sp.PAD_MARK, sp.TTS_BOS: sp.BOS_MARK}
    return [sp.Row(byte=t if t is not None and t < sp.BYTES else None, mark=marks.get(t),  # type: ignore[arg-type]
                   bos=c == sp.CODEC_BOS) for t, c in rows]


class Talker(TTSTalker):
    """The tiny Talker's forward, Qwen3-TTS's (``harness.families.qwen3_tts.speaking_check.Talker``) with what
    Qwen3-Omni's differs in: the text rows come from the Thinker's embedding table, the MLP is a MoE block
    (router, top-k, sigmoid-gated shared expert), and the release suppresses ids 2048-3071 but codec EOS."""

    def __init__(self, model_dir: Path, dtype_name: str) -> None:  # Qwen3-Omni's layout: no super().__init__
        import torch
        from safetensors.torch import load_file

        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["talker_config"]
        text = cfg["text_config"]
        self.dtype = getattr(torch, dtype_name)
        w = load_file(str(model_dir / "model.safetensors"))
        keep = ("talker.model.", "talker.text_projection.", "talker.codec_head.")
        self.w = {k: v.to(self.dtype) for k, v in w.items() if k.startswith(keep)}
        self.embed_table = w["thinker.model.embed_tokens.weight"].to(self.dtype)
        self.heads, self.kv_heads, self.hd = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
        self.eps = text["rms_norm_eps"]
        rope = text.get("rope_parameters") or {}
        self.theta = rope.get("rope_theta", text.get("rope_theta", 1000000.0))
        self.top_k, self.norm_topk = text["num_experts_per_tok"], text.get("norm_topk_prob", True)
        self.vocab = text["vocab_size"]
        self.eos = cfg["codec_eos_token_id"]
        for name, bias in self.w.items():  # vLLM's Qwen3-MoE o_proj has no bias: the checkpoint's must be zero
            if name.endswith("self_attn.o_proj.bias") and bool(bias.any()):
                raise RuntimeError(f"{name} is not zero (vLLM would drop it)")

    def _text_row(self, t: int) -> Any:
        return self.embed_table[t]

    def _mlp(self, m: Any, pre: str) -> Any:
        import torch
        import torch.nn.functional as F

        w = self.w

        def ffn(p: str) -> Any:
            return (F.silu(m @ w[p + "gate_proj.weight"].T) * (m @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T

        if pre + "mlp.gate.weight" not in w:
            return ffn(pre + "mlp.")
        probs = torch.softmax((m @ w[pre + "mlp.gate.weight"].T).float(), dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(m)
        for e in range(probs.shape[-1]):
            sel = (idx == e).any(-1)
            if sel.any():
                weight = (top * (idx == e)).sum(-1, keepdim=True).to(self.dtype)
                out[sel] += (ffn(pre + f"mlp.experts.{e}.")[sel] * weight[sel])
        if pre + "mlp.shared_expert.gate_proj.weight" in w:
            gate = torch.sigmoid(m @ w[pre + "mlp.shared_expert_gate.weight"].T)
            out = out + ffn(pre + "mlp.shared_expert.") * gate
        return out

    def _mask(self, out: Any) -> Any:
        import torch

        suppressed = torch.zeros(out.shape[1], dtype=torch.bool)
        suppressed[self.vocab - 1024:] = True
        suppressed[self.eos] = False
        return out.masked_fill(suppressed, float("-inf"))


def check_case(talker: Talker, rows: list[Tok], first: int, offset: int = 0) -> dict[str, Any]:
    """Argmax vs the rule at every sampled position ``m >= first``; the smallest margin and probability."""
    return score_case(talker.logits(rows, offset), rule_rows(rows), first, sp)


def cases(user: str = USER, text: str = TEXT) -> dict[str, tuple[list[Tok], int]]:
    """Each case's rows and position offset."""
    P = sp.prompt_len(user)
    good = release_rows(user, text)
    no_bos = list(good)
    no_bos[P - 1] = (no_bos[P - 1][0], sp.CODEC_PAD)
    replay = good[:P] + [(sp.TTS_PAD, None)] * 6 + good[P + 6:]  # V1: the replayed span gets tts_pad, no codec row
    wrong = list(good)
    wrong[P + 5] = (ord("q"), wrong[P + 5][1])
    stale = list(good)
    stale[P + 5] = (ord("x"), stale[P + 5][1])
    bare = list(good)
    bare[P + 8] = (None, bare[P + 8][1])
    # 0.30.0's full payload (thinker2talker_full_payload) drops the Thinker's last row as a stop token's, which
    # was never fed: the reply's last token goes, tts_eos comes one position early
    K = len(sp.text_token_ids(text))
    short = release_rows(user, text[:-1]) if K > 1 else good
    return {"correct": (good, 0), "no_bos": (no_bos, 0), "v1_replay": (replay, 0), "wrong_row": (wrong, 0),
            "stale_prev": (stale, 0), "bare": (bare, 0), "long": (good, 3900), "full_payload_tail": (short, 0)}


def run(model_dir: Path, dtype_name: str = "bfloat16") -> dict[str, Any]:
    talker = Talker(model_dir, dtype_name)
    P = sp.prompt_len(USER)
    results: dict[str, Any] = {"P": P, "user": USER, "text": TEXT, "dtype": dtype_name}
    all_cases = cases()
    for name, (rows, offset) in all_cases.items():
        results[name] = check_case(talker, rows, P - 1, offset)
    return summarize(results, all_cases, TEXT)


def _refuse(model_dir: Path) -> str | None:
    if not (model_dir / "config.json").is_file() or not (model_dir / "model.safetensors").is_file():
        return f"{model_dir}: not a tiny Qwen3-Omni checkpoint (no config.json and model.safetensors)"
    return None


def main(argv: list[str] | None = None) -> int:
    return check_main(argv, "python -m harness.families.qwen3_omni.speaking_check", run, _refuse)


if __name__ == "__main__":
    sys.exit(main())
