"""The speaking tiny model's rules: what its Talker says for the rows it reads, and how to read it back.

Pure functions, no torch: shared by the weights that implement the rules inside vLLM-Omni's real
model (``harness/families/qwen2_5_omni/speaking_model.py``), the real backend's oracle transcript (the codec stream
decoded through the table) and the sim's ``speaking`` Talker mode, so the sim and the real server
run the same Talker (docs/speaking-model.md).

Text is bytes: the tiny checkpoint's tokenizer gives one token per UTF-8 byte, so a text row
carries one byte (0..255) or no text (special tokens, text-EOS/PAD, a row with no text component).

The rules, at each sampled position ``m`` of a request (its logits pick the next codec token):

1. **Start** (attention to the whole KV): the Talker speaks only if some position of its KV holds a
   codec-BOS row (vLLM-Omni puts ``thinker_result[0] + codec_bos`` at ``P-1``). Otherwise it babbles:
   it emits :data:`BABBLE` while its row carries text.
2. **Speech**: a started Talker whose row at ``m`` carries byte ``b`` emits
   ``codec_id(b, prev)``, where ``prev`` is the byte carried by the KV row at ``m-1`` (attention to the
   previous position), or ``None`` if that row carries no text.
3. **End** (issue 32: the end region is heard): a row with no text ends the speech, after
   :data:`END_POSITIONS` = 2 end-region positions when the rows there are right. A text-EOS row, and
   a text-PAD row whose previous row is not text-PAD, emit :data:`SILENCE`; a text-PAD row after a
   text-PAD row (the persistent PAD), and a row with neither text nor a text-EOS/PAD component (0.30.0's
   codec-only row once its reply queue is empty, a dropped PAD row), emit codec EOS, which ends the
   request. So a correct Talker input schedules text-EOS, PAD, PAD (positions ``P + K .. P + K + 2``
   for ``K`` reply tokens after the first) and says SILENCE, SILENCE, EOS there: the two PAD positions
   are the end region
   (``harness.contract.misaligned_regions``), and an arm that drops or shifts the persistent PAD rows
   ends the request early or late there, which the contract check counts (misaligned end) and the
   codec stream shows (one :data:`SILENCE` fewer or more).

Reading a codec stream back (:func:`decode`): each speech id gives its byte and the tag of the byte
it heard before; a byte whose tag disagrees with the byte actually said before it (what a listener
heard) is unintelligible, and so is the word that holds it. Babble and silence are no speech.

:data:`SILENCE` is codec id 0, the speech id of byte NUL after a byte with tag 0: a config file
cannot hold NUL (``harness.config`` refuses control characters), so no reply says it, and the
checkpoint's ``codec_head`` row 0 scores silence instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BYTES = 256
TAGS = 32  # the previous byte's low 5 bits: 256 * 32 = 8192 speech ids, all below Code2Wav's 8193 codes
BABBLE = 8192  # one id for a Talker that never saw its start row
CODEC_EOS = 8294
SILENCE = 0  # rule 3: said at the text-EOS row and the first text-PAD row (never a reply's byte: NUL)
END_POSITIONS = 2  # end-region positions a correct request schedules: the first PAD and the persistent one
EOS_MARK, PAD_MARK = "eos", "pad"  # the no-text rows rule 3 tells apart (any other: None)
UNINTELLIGIBLE = "<unk>"  # the word a listener could not make out


def tag(prev: int | None) -> int:
    """The memory tag of the previous byte (``None``: the previous row had no text)."""
    return 0 if prev is None else prev % TAGS


def codec_id(byte: int, prev: int | None) -> int:
    """Rule 2: the speech id for ``byte`` said after a row carrying ``prev``."""
    if not 0 <= byte < BYTES:
        raise ValueError(f"byte {byte} out of range")
    return tag(prev) * BYTES + byte


def next_code(started: bool, byte: int | None, prev: int | None, mark: str | None = None,
              prev_mark: str | None = None) -> int:
    """Rules 1-3 for one sampled position: row byte ``byte`` (None = no text), previous row ``prev``;
    ``mark``/``prev_mark``: :data:`EOS_MARK`, :data:`PAD_MARK` or None, for rows without text."""
    if byte is None:
        if mark == EOS_MARK or (mark == PAD_MARK and prev_mark != PAD_MARK):
            return SILENCE
        return CODEC_EOS
    if not started:
        return BABBLE
    return codec_id(byte, prev)


@dataclass(frozen=True)
class Spoken:
    """A codec stream read back: the text a listener heard and what got in the way."""

    text: str
    codes: int  # codec tokens read (EOS excluded)
    speech: int  # speech ids among them
    babble: int  # babble ids among them
    garbled: int  # speech ids whose memory tag disagreed with the byte said before
    other: int  # ids outside the table (a Talker that is not the speaking model)
    silence: int = 0  # SILENCE ids among them (the end region: END_POSITIONS after a correct reply)


def decode(codes: Iterable[int]) -> Spoken:
    """The oracle transcript of a codec stream (stops at codec EOS)."""
    return decode_table(codes, tags=TAGS, silence=SILENCE, babble=BABBLE, eos=CODEC_EOS)


def decode_table(codes: Iterable[int], *, tags: int, silence: int, babble: int, eos: int) -> Spoken:
    """:func:`decode` for any speaking table of this shape (speech id ``BYTES * tag + byte`` with ``tags``
    memory tags, the previous byte's low bits): Qwen3-TTS's checkpoint has 8 tags and its own specials."""
    out = bytearray()
    bad: list[int] = []  # indices into ``out`` of unintelligible bytes
    said: int | None = None  # the byte said just before (None at the start or after non-speech)
    n = speech = babble_n = garbled = other = silence_n = 0
    for code in codes:
        code = int(code)
        if code == eos:
            break
        n += 1
        if code == silence:
            silence_n += 1
            said = None
        elif 0 <= code < BYTES * tags:
            speech += 1
            byte, t = code % BYTES, code // BYTES
            if t != (0 if said is None else said % tags):
                garbled += 1
                bad.append(len(out))
            out.append(byte)
            said = byte
        elif code == babble:
            babble_n += 1
            said = None
        else:
            other += 1
            said = None
    return Spoken(text=_words(bytes(out), bad), codes=n, speech=speech, babble=babble_n, garbled=garbled, other=other,
                  silence=silence_n)


def _words(raw: bytes, bad: Sequence[int]) -> str:
    """Bytes to words; a word holding an unintelligible byte becomes :data:`UNINTELLIGIBLE`."""
    if not bad:
        return " ".join(raw.decode("utf-8", errors="replace").split())
    marked = bytearray(raw)
    for i in bad:
        marked[i] = 0  # NUL is not whitespace: a garbled space joins its two words into one lost word
    words = marked.decode("utf-8", errors="replace").split()
    return " ".join(UNINTELLIGIBLE if "\x00" in w else w for w in words)


def encode_reply(text: str, end: bool = True) -> list[int]:
    """What a correctly conditioned speaking Talker emits for ``text`` (EOS excluded): its bytes, then
    the end region's :data:`SILENCE` ids (text-EOS row, first PAD row). ``end=False``: the bytes only,
    what a Talker says whose row after the reply has no text-EOS/PAD component (0.30.0's empty queue)."""
    out = []
    prev: int | None = None
    for byte in text.encode("utf-8"):
        out.append(codec_id(byte, prev))
        prev = byte
    return out + [SILENCE, SILENCE] if end else out  # said at the text-EOS row and the first PAD row
