"""The simulated Talker's codec vocabulary and Code2Wav's collapse of codes into speech units.

Codes (all below the real codec-PAD id 8292, like real codec ids):
* ``0``: silence frame;
* ``1 .. NOISE_CODES``: noise frames (babble);
* ``WORD_BASE + 4*w + v``: word ``w`` of the prompt set's vocabulary; ``v`` in {0, 1} are
  onset frames (a new word starts), ``v`` in {2, 3} sustain frames.
Specials are Qwen2.5-Omni's: codec PAD 8292, BOS 8293, EOS 8294, MASK 8296.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from harness.errors import ConfigError
from harness.speech_units import BABBLE_PREFIX, PAUSE, babble_unit, parse_babble  # noqa: F401 - re-exported
from harness.tokenizer import is_spoken

SILENCE = 0
# Stand-ins for the real codec's 8292 content codes when the Talker babbles. Only their count
# relative to the seed's top-k 40 matters: with 64 >= 40, top-k (then top-p 0.8), not the
# vocabulary, limits what a babbling Talker samples, as in the real vocabulary.
NOISE_CODES = 64
WORD_BASE = 128
VARIANTS = 4
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 8292, 8293, 8294, 8296
MAX_WORD_CODE = CODEC_PAD

@dataclass(frozen=True)
class CodecVocab:
    words: tuple[str, ...]

    @classmethod
    def build(cls, tokens: Iterable[str]) -> CodecVocab:
        words = sorted({t.lower() for t in tokens if is_spoken(t)})
        if WORD_BASE + VARIANTS * len(words) > MAX_WORD_CODE:
            raise ConfigError(f"prompt set has {len(words)} distinct words; the sim's codec vocabulary holds "
                              f"{(MAX_WORD_CODE - WORD_BASE) // VARIANTS}")
        return cls(tuple(words))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {w: i for i, w in enumerate(self.words)})

    def word_id(self, token: str) -> int | None:
        if not is_spoken(token):
            return None
        return self._index[token.lower()]  # type: ignore[attr-defined]

    def onset_codes(self, w: int) -> list[int]:
        return [WORD_BASE + VARIANTS * w, WORD_BASE + VARIANTS * w + 1]

    def sustain_codes(self, w: int) -> list[int]:
        return [WORD_BASE + VARIANTS * w + 2, WORD_BASE + VARIANTS * w + 3]


def collapse(codes: Sequence[int], vocab: CodecVocab, frames_per_token: int) -> list[str]:
    """Code2Wav's view of a codec stream: words, pauses and babble syllables, in order.

    A word starts at an onset code, or at a sustain code of a different word than the current
    one; a run of silence becomes one pause; every ``frames_per_token`` noise frames become one
    babble unit holding its frame count (a shorter run, or its remainder, is a shorter unit).
    Control ids (PAD/BOS/EOS/MASK) are stripped as vLLM-Omni's ``_strip_codec_boundaries`` does.
    """
    units: list[str] = []
    current_word: int | None = None
    noise_run = 0
    for code in codes:
        if code >= MAX_WORD_CODE or code < 0:
            continue
        if 1 <= code <= NOISE_CODES:
            if noise_run % frames_per_token == 0:
                units.append(babble_unit(code, 1))
            else:
                first, frames = parse_babble(units[-1])  # type: ignore[misc]
                units[-1] = babble_unit(first, frames + 1)
            noise_run += 1
            current_word = None
            continue
        noise_run = 0
        if code == SILENCE or code < WORD_BASE:
            if not units or units[-1] != PAUSE:
                units.append(PAUSE)
            current_word = None
            continue
        w, v = divmod(code - WORD_BASE, VARIANTS)
        if w >= len(vocab.words):
            continue
        if v < 2 or w != current_word:
            units.append(vocab.words[w])
        current_word = w
    return units


def oracle_transcript(units: Sequence[str]) -> str:
    """The words Code2Wav speaks: pauses and babble are not words, so they add none."""
    return " ".join(u for u in units if u != PAUSE and parse_babble(u) is None)
