"""Qwen3-TTS's contract: which row each position of a request must receive, whatever the schedule.

The rows are the release's own (vLLM-Omni 0.30.0, ``prompt_embeds_builder.py``
``build_prompt_embeds``, the streaming-text layout, ``non_streaming_mode: false``) and the runner's
(``gpu_model_runner.py`` l.1760-1925: a one-token decode span runs with its codec embedding plus the
``text_step`` row the hook returns, through ``talker_mtp``):

* ``p < P`` (the prompt, ``P = 9``): the role rows ``<|im_start|>``, ``assistant``, ``\\n``
  (text only); ``tts_pad`` + codec ``nothink``, ``think_bos``, ``think_eos``, the speaker's codec
  id; ``tts_bos`` + codec PAD; the text's first token + codec BOS;
* ``p >= P``, ``k = p - P``: the codec embedding of the position's own id plus ``trailing_text[k]``,
  where ``trailing_text`` is the text's tokens after the first, then ``tts_eos`` (``T`` rows for a
  text of ``T`` tokens); past it, ``tts_pad``.

The **text region** is ``p < P + T`` (the prompt and every position that carries a text token or
``tts_eos``); the **end region** is every later position (``tts_pad``), as
``harness.contract.misaligned_regions(positions, P, T - 1)`` splits them.

Pure: no torch, no sim. ``harness.families.qwen3_tts.sim.TTSContract`` is its array form over the
sim's row identities; the tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLE_ROWS = 3  # <|im_start|> assistant \n: input_ids[:, :3] of the assistant template
PREFIX_CODECS = ("nothink", "think_bos", "think_eos")  # codec_prefill_list without a language id ("Auto")
PROMPT_LEN = ROLE_ROWS + len(PREFIX_CODECS) + 2 + 1  # + speaker, + (tts_bos, codec PAD), + first text = 9
SPEAKER_POS = ROLE_ROWS + len(PREFIX_CODECS)  # the speaker's row: tts_pad + the speaker's codec id (P - 3)
# CustomVoice speakers, as Qwen3-TTS-12Hz-*-CustomVoice's config names them (``talker_config.spk_id``; the serving
# layer lowercases a request's ``voice``); a prompt set's ``speaker:`` names one (``harness.config``)
SPEAKERS = ("Vivian", "Serena", "Uncle_Fu", "Dylan", "Eric", "Ryan", "Aiden", "Ono_Anna", "Sohee")
DEFAULT_SPEAKER = "Vivian"  # the voice of a prompt without one


@dataclass(frozen=True)
class TTSRowRef:
    """One expected row: its text part and its codec part, by name."""

    text: str  # "role k" | "tts_pad" | "tts_bos" | "tts_eos" | "text k" (the text's k-th token)
    codec: str  # "none" | "nothink" | "think_bos" | "think_eos" | "speaker" | "pad" | "bos" | "own id"


def expected_row(p: int, P: int, T: int) -> TTSRowRef:
    """The row position ``p`` of a request with prompt length ``P`` and ``T`` text tokens must get."""
    if p < 0:
        raise ValueError(f"position {p} < 0")
    if p < P:
        if P != PROMPT_LEN:
            raise ValueError(f"Qwen3-TTS's streaming-text prompt has {PROMPT_LEN} rows, got P={P}")
        if p < ROLE_ROWS:
            return TTSRowRef(f"role {p}", "none")
        q = p - ROLE_ROWS
        if q < len(PREFIX_CODECS):
            return TTSRowRef("tts_pad", PREFIX_CODECS[q])
        if q == len(PREFIX_CODECS):
            return TTSRowRef("tts_pad", "speaker")
        if q == len(PREFIX_CODECS) + 1:
            return TTSRowRef("tts_bos", "pad")
        return TTSRowRef("text 0", "bos")
    k = p - P
    if k < T - 1:
        return TTSRowRef(f"text {k + 1}", "own id")
    if k == T - 1:
        return TTSRowRef("tts_eos", "own id")
    return TTSRowRef("tts_pad", "own id")


def text_region_end(P: int, T: int) -> int:
    """First position of the end region (``tts_pad`` after ``tts_eos``)."""
    return P + T


def flatten_payload(info: dict) -> dict:
    """A hook's payload with the serving layer's ``additional_information`` merged in (its keys never override
    the payload's own): where the release reads a request's text, speaker and layout from."""
    extra = info.get("additional_information")
    if not isinstance(extra, dict):
        return info
    merged = {k: v for k, v in info.items() if k != "additional_information"}
    for k, v in extra.items():
        merged.setdefault(k, v)
    return merged
