"""The speaking table every speaking tiny checkpoint follows, and how to read a codec stream back.

Pure functions, no torch (the real backend's worker, the sim and the weights all import it). A family's
rules module (``harness.families.<family>.speaking``) names its own codec ids and builds a :class:`Table`
of them; its ``tag``, ``codec_id``, ``next_code``, ``decode`` and ``encode_reply`` are that table's.

Text is bytes (each tiny tokenizer gives one token per UTF-8 byte). At each sampled position a
started Talker whose row carries byte ``b`` says the speech id ``BYTES * tag(prev) + b``, ``tag`` the
previous row's byte's low bits (``tags`` of them; 0 when that row carried no byte); an unstarted one
babbles; a row without a byte says ``silence`` (the text-EOS row, and a text-PAD row after a row that
is not text-PAD) or codec EOS (everything else). The families' module docstrings and
docs/speaking-model.md, docs/families/qwen3_tts.md say where their rows come from.

Reading back (:func:`decode_table`): each speech id gives its byte and the tag of the byte it heard
before; a byte whose tag disagrees with the byte actually said before it (what a listener heard) is
unintelligible, and so is the word that holds it (:data:`UNINTELLIGIBLE`). Babble and silence are no
speech.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BYTES = 256
EOS_MARK, PAD_MARK = "eos", "pad"  # the no-text rows rule 3 tells apart (any other: None)
UNINTELLIGIBLE = "<unk>"  # the word a listener could not make out
END_POSITIONS = 2  # end-region positions a correct request schedules: the first PAD and the persistent one


@dataclass(frozen=True)
class Row:
    """What a Talker reads of one KV position: its byte, its mark, whether its codec part is BOS (Qwen3-TTS and
    Qwen3-Omni, whose rows carry a codec part)."""

    byte: int | None = None
    mark: str | None = None  # EOS_MARK / PAD_MARK / a BOS mark for tts_eos / tts_pad / tts_bos; None otherwise
    bos: bool = False


@dataclass(frozen=True)
class Table:
    """One checkpoint's codec table: ``tags`` memory tags (speech ids ``0 .. BYTES * tags - 1``), its
    babble, silence and codec-EOS ids. Its methods are the family's rules."""

    tags: int
    babble: int
    silence: int
    eos: int

    def tag(self, prev: int | None) -> int:
        """The memory tag of the previous byte (``None``: the previous row had no byte)."""
        return 0 if prev is None else prev % self.tags

    def codec_id(self, byte: int, prev: int | None) -> int:
        """Rule 2: the speech id for ``byte`` said after a row carrying ``prev``."""
        if not 0 <= byte < BYTES:
            raise ValueError(f"byte {byte} out of range")
        return self.tag(prev) * BYTES + byte

    def next_code(self, started: bool, byte: int | None, prev: int | None, mark: str | None = None,
                  prev_mark: str | None = None) -> int:
        """Rules 1-3 for one sampled position: its row's ``byte`` (None = no byte) and ``mark``
        (:data:`EOS_MARK`, :data:`PAD_MARK` or None), the previous row's ``prev`` and ``prev_mark``."""
        if byte is None:
            if mark == EOS_MARK or (mark == PAD_MARK and prev_mark != PAD_MARK):
                return self.silence
            return self.eos
        if not started:
            return self.babble
        return self.codec_id(byte, prev)

    def say(self, kv: Sequence[Row], m: int) -> int:
        """The codec id sampled at position ``m`` from KV rows ``kv[0..m]`` (rules 1-3); the Talker has
        started once a row up to ``m`` carries the codec BOS."""
        if not 0 <= m < len(kv):
            raise ValueError(f"position {m} outside the KV (0..{len(kv) - 1})")
        started = any(r.bos for r in kv[:m + 1])
        prev = kv[m - 1] if m > 0 else Row()
        row = kv[m]
        return self.next_code(started, row.byte, prev.byte, row.mark, prev.mark)

    def talk(self, kv: Sequence[Row], first: int) -> list[int]:
        """The codec stream of a request whose rows never change: ``say`` at ``first`` (``P - 1``),
        ``first + 1``, ... up to codec EOS (included) or the end of ``kv``."""
        out: list[int] = []
        for m in range(first, len(kv)):
            out.append(self.say(kv, m))
            if out[-1] == self.eos:
                break
        return out

    def decode(self, codes: Iterable[int]) -> Spoken:
        """The oracle transcript of a codec stream (stops at codec EOS)."""
        return decode_table(codes, tags=self.tags, silence=self.silence, babble=self.babble, eos=self.eos)

    def encode_reply(self, text: str, end: bool = True) -> list[int]:
        """What a correctly conditioned Talker emits for ``text`` (EOS excluded): its bytes, then the end
        region's silence ids (text-EOS row, first PAD row). ``end=False``: the bytes only, what a Talker
        says whose row after the reply has no text-EOS/PAD component (0.30.0's empty queue)."""
        out: list[int] = []
        prev: int | None = None
        for byte in text.encode("utf-8"):
            out.append(self.codec_id(byte, prev))
            prev = byte
        return out + [self.silence, self.silence] if end else out  # said at the text-EOS and first PAD rows


def blind_spots(*, tag_bits: int, span: str, eos: str, pad: str, elsewhere: str) -> str:
    """What a speaking Talker on this table cannot hear (``Family.speaking_blind_spots``, the note under the
    summary table): wrong rows there change nothing it says, so only the misaligned columns count them.
    ``tag_bits``: the tag's bits; ``span``: what its rows carry (the reply, the text); ``eos``/``pad``: the
    end rows' names; ``elsewhere``: the family's prompt rows the Talker does not read."""
    return (f"the speaking Talker hears only whether a codec-BOS row exists, the byte of the row at each sampled "
            f"position, the low {tag_bits} bits of the byte before it, and past the {span} whether a row is {eos}, "
            f"{pad} or neither for two positions; wrong rows elsewhere ({elsewhere}, codec ids other than BOS, the "
            f"high bits of the previous byte, {pad} where {eos} belongs, the end region past its first two "
            f"positions, a row's scale) are counted only by the misaligned columns")


@dataclass(frozen=True)
class Spoken:
    """A codec stream read back: the text a listener heard and what got in the way."""

    text: str
    codes: int  # codec tokens read (EOS excluded)
    speech: int  # speech ids among them
    babble: int  # babble ids among them
    garbled: int  # speech ids whose memory tag disagreed with the byte said before
    other: int  # ids outside the table (a Talker that is not the speaking model)
    silence: int = 0  # silence ids among them (the end region: END_POSITIONS after a correct reply)


def decode_table(codes: Iterable[int], *, tags: int, silence: int, babble: int, eos: int) -> Spoken:
    """The oracle transcript of ``codes`` (stops at ``eos``) for a speaking table of this shape: speech id
    ``BYTES * tag + byte`` with ``tags`` memory tags, the previous byte's low bits."""
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
