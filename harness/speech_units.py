"""The units Code2Wav speaks, shared by the sim (which makes them from codec tokens) and the audio
stage (which speaks them): a word, a pause, or a babbling stretch. A module below both, so neither
imports the other for them.
"""

from __future__ import annotations

PAUSE = "<pause>"  # a unit that stands for silence (punctuation, text-PAD frames)

# A babbling stretch: noise frames, grouped one unit per R frames (the time one text token
# takes), spoken by Code2Wav as non-speech (harness/audio/tts.py) and never as words.
BABBLE_PREFIX = "<babble:"


def babble_unit(code: int, frames: int) -> str:
    """The unit for ``frames`` noise frames starting with noise code ``code``."""
    return f"{BABBLE_PREFIX}{code}:{frames}>"


def parse_babble(unit: str) -> tuple[int, int] | None:
    """(code, frames) of a babble unit, ``None`` for any other unit."""
    if not unit.startswith(BABBLE_PREFIX) or not unit.endswith(">"):
        return None
    code, _, frames = unit[len(BABBLE_PREFIX):-1].partition(":")
    try:
        return int(code), int(frames)
    except ValueError:
        return None
