"""The speaking tiny Qwen3-TTS's rules: what its Talker says for the rows it reads, and how to read it back.

Pure functions, no torch: this checkpoint's codec ids and rows on the table every speaking checkpoint
follows (``harness.speaking.rules``: :func:`tag`, :func:`codec_id`, :func:`next_code`, :func:`decode`
and :func:`encode_reply` are :data:`TABLE`'s), shared by the weights that implement the rules inside vLLM-Omni 0.30.0's
unmodified Qwen3-TTS Talker (``harness.families.qwen3_tts.speaking_model``), the real backend's oracle
transcript (the traced codec stream decoded back to text) and the sim's ``speaking`` Talker for this
family, so the sim and the real server run the same Talker. The same rules as Qwen2.5-Omni's
(docs/speaking-model.md); what differs is the codec ids and the row layout (docs/families/qwen3_tts.md).

**Text is bytes.** The tiny checkpoint's tokenizer gives one token per UTF-8 byte, token id = the
byte (:func:`text_token_ids`), plus Qwen's special tokens on their real ids and ``assistant`` as one
token (the release's builder slices ``input_ids[:, 3:-5]`` of ``<|im_start|>assistant\\n{text}<|im_end|>\\n
<|im_start|>assistant\\n``, so the role header and the tail must be 3 and 5 tokens). A text the
builder would split differently is refused (:func:`check_text`).

**A row** (:class:`Row`) is what the Talker reads at one position: the byte its text part carries
(``None``: a special token or no text part), its mark (:data:`EOS_MARK` for ``tts_eos``,
:data:`PAD_MARK` for ``tts_pad``, :data:`BOS_MARK` for ``tts_bos``, ``None`` otherwise) and whether its
codec part is codec BOS (the only codec embedding the Talker reads). The contract's rows
(:func:`contract_rows`, docs/families/qwen3_tts.md's table): ``P = 9`` prompt rows (role header, four
``tts_pad`` rows on the think tags and the speaker, ``tts_bos`` on codec PAD, the first byte on
codec BOS), then one row per decode position: the text's next byte, then ``tts_eos``, then
``tts_pad`` for ever.

**The rules**, at each sampled position ``m >= P - 1`` (its logits pick the next codec id):

1. **Start**: the Talker speaks only if some KV position ``0..m`` holds a codec-BOS row (the release
   puts ``first text + codec BOS`` at ``P - 1``); otherwise it babbles: :data:`BABBLE` while its row
   carries a byte.
2. **Speech**: a started Talker whose row at ``m`` carries byte ``b`` emits ``codec_id(b, prev)``
   = ``256 * tag(prev) + b`` (``tag``: the low 3 bits), ``prev`` the byte of row ``m - 1`` (``None``: no byte there, tag 0).
3. **End**: a row without a byte: ``tts_eos``, and ``tts_pad`` after a row that is not ``tts_pad``,
   emit :data:`SILENCE`; ``tts_pad`` after ``tts_pad`` (the persistent pad) and any other row
   without a byte (a bare codec row, ``tts_bos``, a role row) emit :data:`CODEC_EOS`, which ends
   the request. A correct request says its bytes, SILENCE (``tts_eos`` at ``P + T - 1``), SILENCE
   (the first ``tts_pad``), EOS (the second): :data:`END_POSITIONS` = 2 end-region positions.

**Codec ids** (the checkpoint's): speech ids ``0 .. 2047`` (``TAGS * BYTES``, the real codebook's
size; id 0, NUL after tag 0, is never said: the release masks id 0 and no text holds NUL),
:data:`BABBLE` 2048, :data:`SILENCE` 2049 (so :data:`CODEBOOK` = 2050 codes a frame may hold: the
release samples only ``[1, CODEBOOK)`` plus EOS, and Code2Wav decodes them); Qwen3-TTS's real
specials: codec PAD/BOS/EOS 2148/2149/2150 (the release's pipeline stops the Talker on 2150 whatever
the config says), think tags 2154-2157, speakers :data:`SPEAKERS`; the Talker's vocabulary 3072.

**Reading back** (:func:`decode`, the oracle transcript): each speech id gives its byte and the tag
of the byte it heard before; a byte whose tag disagrees with the byte said before it is
unintelligible, and so is the word that holds it (:data:`UNINTELLIGIBLE`); babble and silence say
nothing.

Public API (stable: the sim's ``speaking`` Talker for qwen3-tts is built on it): the constants
above, :class:`Row`, :func:`tag`, :func:`codec_id`, :func:`next_code`, :func:`say`, :func:`talk`,
:func:`contract_rows`, :func:`text_token_ids`, :func:`check_text`, :class:`Spoken`, :func:`decode`,
:func:`encode_reply`.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.speaking.rules import BYTES, END_POSITIONS, EOS_MARK, PAD_MARK  # noqa: F401 - part of this module's API
from harness.speaking.rules import UNINTELLIGIBLE, Spoken, Table  # noqa: F401 - part of this module's API
from harness.speaking import rules

TAGS = 8  # the previous byte's low 3 bits: 2048 speech ids, the real codebook's size
BABBLE = 2048  # rule 1: a Talker that never saw a codec-BOS row
SILENCE = 2049  # rule 3: said at tts_eos and at the first tts_pad
CODEBOOK = 2050  # codes a frame may hold (code predictor and Code2Wav vocabulary)
# Qwen3-TTS's real codec specials: the release's pipeline stops the Talker on 2150 (``stop_token_ids``)
CODEC_PAD, CODEC_BOS, CODEC_EOS = 2148, 2149, 2150
CODEC_THINK, CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = 2154, 2155, 2156, 2157
# CustomVoice speakers: Qwen3-TTS-12Hz-*-CustomVoice's names; ids of the tiny checkpoint (distinct, in the
# real vocabulary's speaker range)
SPEAKERS = {"vivian": 3000, "serena": 3001, "uncle_fu": 3002, "dylan": 3003, "eric": 3004,
            "ryan": 3005, "aiden": 3006, "ono_anna": 3007, "sohee": 3008}
DEFAULT_SPEAKER = "Vivian"
TALKER_VOCAB = 3072  # the Talker's codec vocabulary (codec_head rows), the real one's
# text token ids: bytes are 0..255; Qwen's special tokens keep their real ids (configuration_qwen3_tts.py)
IM_START, IM_END, ASSISTANT = 151644, 151645, 151646
TTS_PAD, TTS_BOS, TTS_EOS = 151671, 151672, 151673
TEXT_VOCAB = 151936
PROMPT_LEN = 9  # harness.families.qwen3_tts.contract.PROMPT_LEN
BOS_MARK = "bos"  # tts_bos's row (EOS_MARK, PAD_MARK: tts_eos's and tts_pad's)
TABLE = Table(tags=TAGS, babble=BABBLE, silence=SILENCE, eos=CODEC_EOS)
# rule 2's speech id, rules 1-3 for one position, the oracle transcript (3-bit tags, this checkpoint's BABBLE,
# SILENCE and codec EOS), a correct text's codec stream (its bytes, then SILENCE at tts_eos and the first tts_pad)
tag, codec_id, next_code, decode, encode_reply = TABLE.tag, TABLE.codec_id, TABLE.next_code, TABLE.decode, \
    TABLE.encode_reply


Row = rules.Row  # what the Talker reads of one KV position (harness.speaking.rules)


def say(kv: Sequence[Row], m: int) -> int:
    """The codec id sampled at position ``m`` from KV rows ``kv[0..m]`` (rules 1-3, this family's table)."""
    return TABLE.say(kv, m)


def talk(kv: Sequence[Row], first: int = PROMPT_LEN - 1) -> list[int]:
    """The codec stream of a request whose rows never change, from ``first`` (``P - 1``) to codec EOS."""
    return TABLE.talk(kv, first)


def check_text(text: str) -> None:
    """Refuse a text the tiny tokenizer would not turn into one token per byte between the 3-token role
    header and the 5-token tail (the release's builder slices ``input_ids[:, 3:-5]``)."""
    if not text:
        raise ValueError("the text is empty (the prompt needs its first byte at P - 1)")
    if "assistant" in text or "<|" in text:
        raise ValueError(f"the text {text[:40]!r} holds 'assistant' or '<|', which the tiny tokenizer reads as "
                         "special tokens")


def text_token_ids(text: str) -> list[int]:
    """The tiny tokenizer's ids of ``text``: its UTF-8 bytes."""
    check_text(text)
    return list(text.encode("utf-8"))


def contract_rows(text: str, end: int = END_POSITIONS + 1) -> list[Row]:
    """The rows a correct ``preprocess`` gives positions ``0 .. P + T - 1 + end`` (``tts_eos`` and ``end``
    ``tts_pad`` rows after the text's bytes; codec parts of decode positions carry no BOS)."""
    raw = text_token_ids(text)
    rows = [Row(), Row(), Row(byte=ord("\n"))]  # <|im_start|> assistant \n
    rows += [Row(mark=PAD_MARK)] * 4  # tts_pad on nothink, think_bos, think_eos, the speaker
    rows += [Row(mark=BOS_MARK), Row(byte=raw[0], bos=True)]  # tts_bos + codec PAD, first byte + codec BOS
    rows += [Row(byte=b) for b in raw[1:]] + [Row(mark=EOS_MARK)] + [Row(mark=PAD_MARK)] * end
    return rows
