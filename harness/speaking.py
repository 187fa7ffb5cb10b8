"""The speaking tiny model's rules: what its Talker says for the rows it reads, and how to read it back.

Pure functions, no torch: shared by the weights that implement the rules inside vLLM-Omni's real
model (``harness/serve/speaking_model.py``), the real backend's oracle transcript (the codec stream
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
3. **End**: a row with no text makes it emit codec EOS, which ends the request.

Reading a codec stream back (:func:`decode`): each speech id gives its byte and the tag of the byte
it heard before; a byte whose tag disagrees with the byte actually said before it (what a listener
heard) is unintelligible, and so is the word that holds it. Babble is no speech.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BYTES = 256
TAGS = 32  # the previous byte's low 5 bits: 256 * 32 = 8192 speech ids, all below Code2Wav's 8193 codes
BABBLE = 8192  # one id for a Talker that never saw its start row
CODEC_EOS = 8294
UNINTELLIGIBLE = "<unk>"  # the word a listener could not make out


def tag(prev: int | None) -> int:
    """The memory tag of the previous byte (``None``: the previous row had no text)."""
    return 0 if prev is None else prev % TAGS


def codec_id(byte: int, prev: int | None) -> int:
    """Rule 2: the speech id for ``byte`` said after a row carrying ``prev``."""
    if not 0 <= byte < BYTES:
        raise ValueError(f"byte {byte} out of range")
    return tag(prev) * BYTES + byte


def next_code(started: bool, byte: int | None, prev: int | None) -> int:
    """Rules 1-3 for one sampled position: row byte ``byte`` (None = no text), previous row ``prev``."""
    if byte is None:
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


def decode(codes: Iterable[int]) -> Spoken:
    """The oracle transcript of a codec stream (stops at codec EOS)."""
    out = bytearray()
    bad: list[int] = []  # indices into ``out`` of unintelligible bytes
    said: int | None = None  # the byte said just before (None at the start or after non-speech)
    n = speech = babble = garbled = other = 0
    for code in codes:
        code = int(code)
        if code == CODEC_EOS:
            break
        n += 1
        if 0 <= code < BYTES * TAGS:
            speech += 1
            byte, t = code % BYTES, code // BYTES
            if t != tag(said):
                garbled += 1
                bad.append(len(out))
            out.append(byte)
            said = byte
        elif code == BABBLE:
            babble += 1
            said = None
        else:
            other += 1
            said = None
    return Spoken(text=_words(bytes(out), bad), codes=n, speech=speech, babble=babble, garbled=garbled, other=other)


def _words(raw: bytes, bad: Sequence[int]) -> str:
    """Bytes to words; a word holding an unintelligible byte becomes :data:`UNINTELLIGIBLE`."""
    if not bad:
        return " ".join(raw.decode("utf-8", errors="replace").split())
    marked = bytearray(raw)
    for i in bad:
        marked[i] = 0  # NUL is not whitespace: a garbled space joins its two words into one lost word
    words = marked.decode("utf-8", errors="replace").split()
    return " ".join(UNINTELLIGIBLE if "\x00" in w else w for w in words)


def encode_reply(text: str) -> list[int]:
    """What a correctly conditioned speaking Talker emits for ``text`` (EOS excluded)."""
    out = []
    prev: int | None = None
    for byte in text.encode("utf-8"):
        out.append(codec_id(byte, prev))
        prev = byte
    return out
