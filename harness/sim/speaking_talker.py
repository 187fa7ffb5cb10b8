"""The sim's ``speaking`` Talker mode: a speaking tiny model's rules, on the sim's KV.

The rules module is the family's (``SpeakingTalker(space, rules)``, ``Family.speaking_rules()``):
Qwen2.5-Omni's ``harness.families.qwen2_5_omni.speaking``, Qwen3-TTS's ``harness.families.qwen3_tts.speaking``
(its codec ids, tags and end rows); the KV semantics below are the same for both.

``omni-stress run --sim-talker speaking`` runs this Talker instead of the default one
(``harness/sim/talker.py``), so the sim and the real server with the speaking tiny checkpoint run
the same Talker, and what differs between them is the scheduler, the runner and timing
(``omni-stress fidelity``, docs/fidelity.md). With it the sim tokenizes the Thinker prompt and reply
as the tiny model does (``harness.tokenizer.byte_tokenize``: one token per UTF-8 byte, each special
token whole), so ``P`` = Thinker prompt tokens + 2 is the real server's.

At each sampled position ``m = P - 1 + g`` (generated token ``g``), from the rows in the request's KV:

* **start**: some KV position ``0..m`` holds a codec-BOS component (the runner's identification of
  the row's codec part; vLLM-Omni puts ``thinker_result[0] + codec_bos`` at ``P-1``, and an
  unreplaced row at position 0 is the raw embedding of the Talker prompt's first id, codec BOS too);
* **byte**: the byte of the text component of row ``m``; **prev**: the byte of row ``m-1``. A text
  component that is NONE (zeros), UNKNOWN, a special token, the speaker row, text-BOS/EOS/PAD has no
  byte; another request's row (cross-talk) carries that request's byte;
* **mark**: whether a row without byte is the text-EOS row or the text-PAD row (the model's shared
  special rows), for rule 3's end region; **prev mark** the same of row ``m-1``;
* the code is ``harness.families.qwen2_5_omni.speaking.next_code(started, byte, prev, mark, prev_mark)``: speech id, BABBLE,
  SILENCE (text-EOS, first PAD) or codec EOS.

One codec token per text byte (no frames-per-token stretching) and no sampling randomness: the
speaking model's logits put probability ~1 on the rule's id, so temperature, top-k and top-p pick it.

A position past the KV (only the speculative-decoding drafter asks for one: the row of the next
position does not exist yet) has no row, so no byte: codec EOS. The drafter's proposals are then
rejected, never wrong: verification reads the written rows.

Code2Wav: the oracle transcript is ``harness.families.qwen2_5_omni.speaking.decode(codes).text``; the audio for Whisper
is that transcript spoken by the sim's TTS, an unintelligible word (``<unk>``) as one babble
syllable; babble ids carry no words, so a babbling request's WAV is silence.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np

from harness.sim.codec import CODEC_BOS, PAUSE, babble_unit
from harness.sim.rows import RowSpace
from harness.sim.talker import TalkerKV

MODE = "speaking"


class SpeakingKV(TalkerKV):
    """The per-request KV plus the first position holding a codec-BOS component (None: none)."""

    first_bos: int | None = None

    def write(self, c: int, text_ids, codec_ids) -> None:  # type: ignore[override]
        n = text_ids.shape[0]
        self._text_np[c:c + n] = np.asarray(text_ids)
        codec = np.asarray(codec_ids)
        self._codec_np[c:c + n] = codec
        self.length = c + n
        if self.first_bos is None or self.first_bos >= c:  # positions >= c were rewritten or dropped
            hits = np.flatnonzero(codec == CODEC_BOS)
            self.first_bos = c + int(hits[0]) if hits.size else None

    def write_one(self, c: int, text_id: int, codec_id: int) -> None:  # type: ignore[override]
        """``write`` of a one-position span ``[c, c+1)``, from two ints."""
        self._text_np[c] = text_id
        self._codec_np[c] = codec_id
        self.length = c + 1
        if self.first_bos is None or self.first_bos >= c:
            self.first_bos = c if codec_id == CODEC_BOS else None

    def started_at(self, m: int) -> bool:
        return self.first_bos is not None and self.first_bos <= m


class SpeakingTalker:
    """Rules 1-3 of a speaking tiny model on the rows of a ``SpeakingKV``.

    ``rules``: the family's rules module (``harness.families.qwen2_5_omni.speaking`` for Qwen2.5-Omni,
    ``harness.families.qwen3_tts.speaking`` for Qwen3-TTS): its ``next_code``, ``CODEC_EOS`` and marks.
    ``byte_kinds``: the registered row kinds whose one-byte word is heard as that byte (Qwen3-TTS's role
    header ``\\n`` row carries its byte, as the tiny tokenizer's does)."""

    def __init__(self, space: RowSpace, rules: ModuleType,
                 byte_kinds: tuple[str, ...] = ("prompt", "output")) -> None:
        self.space = space
        self.rules = rules
        self.byte_kinds = byte_kinds
        # a row's mark by index: text-EOS, text-PAD, and text-BOS where the rules name it (Qwen3-TTS's tts_bos)
        self.marks = (None, rules.EOS_MARK, rules.PAD_MARK, getattr(rules, "BOS_MARK", None))
        self._byte_np = np.zeros(0, dtype=np.int64)
        self._mark_np = np.zeros(0, dtype=np.int64)  # index into marks

    def freeze(self) -> None:
        """The byte of every registered text row, -1 for none (call once all rows exist)."""
        from harness.tokenizer import token_byte

        out = np.full(len(self.space.meanings), -1, dtype=np.int64)
        marks = np.zeros(len(self.space.meanings), dtype=np.int64)
        for i, m in enumerate(self.space.meanings):
            if m.kind in self.byte_kinds:
                b = token_byte(m.word)
                if b is not None:
                    out[i] = b
            elif m.kind == "text_eos":
                marks[i] = 1
            elif m.kind == "text_pad":
                marks[i] = 2
            elif m.kind == "text_bos":
                marks[i] = 3
        self._byte_np = out
        self._mark_np = marks

    def mark_of(self, text_id: int) -> str | None:
        """Whether a KV text component is the text-EOS, text-PAD or (rules naming it) text-BOS row (None: anything else)."""
        if text_id < 0 or text_id >= self._mark_np.shape[0]:
            return None
        return self.marks[int(self._mark_np[text_id])]

    def byte_of(self, text_id: int) -> int | None:
        """The byte of a KV text component (a registry id, NONE or UNKNOWN)."""
        if text_id < 0 or text_id >= self._byte_np.shape[0]:
            return None
        b = int(self._byte_np[text_id])
        return None if b < 0 else b

    def next_token(self, kv: SpeakingKV, generated: int) -> int:
        m = kv.P - 1 + generated
        if m >= kv.length or m < 1:
            return self.rules.CODEC_EOS
        text = kv._text_np
        here, before = int(text[m]), int(text[m - 1])
        return self.rules.next_code(kv.started_at(m), self.byte_of(here), self.byte_of(before), self.mark_of(here),
                                  self.mark_of(before))


def spoken_codes(output_token_ids: list[int], eos: int) -> list[int]:
    """The codec tokens a request spoke: everything before codec EOS ``eos`` (the stop token is not speech)."""
    codes = [int(c) for c in output_token_ids]
    return codes[:codes.index(eos)] if eos in codes else codes


def speech_units(transcript: str, frames_per_word: int, unintelligible: str) -> list[str]:
    """What the sim's TTS speaks for an oracle transcript: its words (punctuation as pauses), each
    ``unintelligible`` word (the rules' mark for one) as one babble syllable of ``frames_per_word`` codec frames."""
    from harness.tokenizer import is_spoken, tokenize

    units: list[str] = []
    for i, word in enumerate(transcript.split()):
        if word == unintelligible:
            units.append(babble_unit(1 + i % 64, frames_per_word))
        else:
            units.extend(tok if is_spoken(tok) else PAUSE for tok in tokenize(word))  # as tts.units_from_text
    return units


def speaking_parts(space: RowSpace, rules: ModuleType, frames_per_word: int,
                   byte_kinds: tuple[str, ...]) -> tuple[SpeakingTalker, Callable[[list[int]], tuple[list[int], str, list[str]]]]:
    """A family's speaking sim cell's Talker (frozen) and its ``speak``: the codec stream up to codec EOS, read
    back by the rules' ``decode`` (the real backend's oracle), spoken as ``speech_units`` for the sim's TTS."""
    talker = SpeakingTalker(space, rules, byte_kinds=byte_kinds)
    talker.freeze()

    def speak(codes: list[int]) -> tuple[list[int], str, list[str]]:
        codes = spoken_codes(codes, rules.CODEC_EOS)
        transcript = rules.decode(codes).text
        return codes, transcript, speech_units(transcript, frames_per_word, rules.UNINTELLIGIBLE)

    return talker, speak
