"""The sim's text tokenizer and Qwen2.5-Omni's chat template.

The sim needs token counts close to Qwen's BPE (so Talker prompt lengths land where the real
ones do) and tokens that map back to words (so a row can "speak" its word). No tokenizer
download is allowed at run time, so this is a documented rule instead of Qwen's BPE: special
tokens, words (with an apostrophe suffix), single punctuation marks and newlines are tokens.
Qwen's BPE gives about the same count for plain English (one token per common word).
"""

from __future__ import annotations

import re

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

AUDIO_BOS, AUDIO, AUDIO_EOS = "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"
AUDIO_TOKENS_PER_SECOND = 25  # Qwen2.5-Omni's audio encoder: 50 Hz frames pooled by 2

_TOKEN_RE = re.compile(r"<\|[A-Za-z_]+\|>|[A-Za-z0-9]+(?:'[A-Za-z]+)?|\n|[^\sA-Za-z0-9]")


def tokenize(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


def chat_prompt(system_prompt: str, user: str, audio_seconds: float = 0.0) -> str:
    """Qwen2.5-Omni's chat template for one user turn with the generation prompt.

    ``audio_seconds`` > 0 puts an audio input before the text, as the processor expands it:
    ``<|audio_bos|>`` + one ``<|AUDIO|>`` placeholder per 40 ms + ``<|audio_eos|>``.
    """
    audio = ""
    if audio_seconds > 0:
        audio = AUDIO_BOS + AUDIO * round(audio_seconds * AUDIO_TOKENS_PER_SECOND) + AUDIO_EOS
    return (f"{IM_START}system\n{system_prompt}{IM_END}\n"
            f"{IM_START}user\n{audio}{user}{IM_END}\n{IM_START}assistant\n")


def is_spoken(token: str) -> bool:
    """Words are spoken; punctuation, newlines and special tokens are silence."""
    return bool(re.fullmatch(r"[A-Za-z0-9]+(?:'[A-Za-z]+)?", token))


# ----------------------------------------------------------------------------- the speaking tiny model's
# tokenizer (``omni-stress tiny-model``, harness/families/qwen2_5_omni/tiny_model.py): byte-level with no merges, so one token
# per UTF-8 byte, plus Qwen2.5-Omni's added special tokens, each one token that carries no byte. The sim's
# ``speaking`` Talker mode tokenizes with it so that its Talker prompt length P is the real server's.
# Must list the same tokens as ``harness.families.qwen2_5_omni.tiny_model.SPECIAL_TOKENS`` (tests/test_sim_speaking.py).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>",
    "<|VIDEO|>",
)
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len, reverse=True)))


def byte_tokenize(text: str) -> list[str]:
    """The tiny model's tokens of ``text``: each special token whole, every other UTF-8 byte one token.

    A byte token is the one-character string ``chr(byte)`` (so ``token_byte`` reads it back); a
    special token is its text, which is longer, so the two kinds never collide.
    """
    out: list[str] = []
    pos = 0
    for m in _SPECIAL_RE.finditer(text):
        out.extend(chr(b) for b in text[pos:m.start()].encode("utf-8"))
        out.append(m.group())
        pos = m.end()
    out.extend(chr(b) for b in text[pos:].encode("utf-8"))
    return out


def token_byte(token: str | None) -> int | None:
    """The byte a ``byte_tokenize`` token carries; None for a special token (or no token)."""
    if token is None or len(token) != 1:
        return None
    return ord(token)
