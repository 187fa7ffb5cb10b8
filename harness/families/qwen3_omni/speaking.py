"""The speaking tiny Qwen3-Omni's rules: what its Talker says for the rows it reads, and how to read it back.

Pure functions, no torch: this checkpoint's codec ids and rows on the table every speaking checkpoint
follows (``harness.speaking.rules``: :func:`tag`, :func:`codec_id`, :func:`next_code`, :func:`decode` and
:func:`encode_reply` are :data:`TABLE`'s), shared by the weights that implement the rules inside vLLM-Omni
0.30.0's unmodified Qwen3-Omni (``harness.families.qwen3_omni.speaking_model``), its self-check
(``speaking_check``) and the real backend's oracle transcript (the Talker's codec stream decoded back to
text). The same rules as Qwen3-TTS's (``harness.families.qwen3_tts.speaking``); what differs is where the
rows come from, the prompt's length and the codec ids.

**The Thinker says the reply.** A tiny Thinker cannot compose one: its reply is forced per request
(``harness.serve.reply_forcer``, ``extra_args: {"omni_stress_reply": TEXT}`` in the Thinker's sampling
params). The Talker reads only the Thinker's *embedding* of each token (the release's
``text_projection(thinker_embed)``; ``tts_bos``/``tts_eos``/``tts_pad`` are Thinker embeddings too), so the
speaking Thinker is its embedding table: a byte's bits and a text flag, five marks, zero elsewhere.

**Text is bytes.** The tiny tokenizer gives one token per UTF-8 byte (token id = the byte), the role words
``system``/``user``/``assistant`` as single tokens and Qwen3-Omni's added tokens on their real ids. A reply
holding one of those words or tokens would not be one token per byte: refused (:func:`check_text`).

**A row** (:class:`Row`, as Qwen3-TTS's): the byte its text part carries, its mark (:data:`EOS_MARK`,
:data:`PAD_MARK`, :data:`BOS_MARK`), whether its codec part is codec BOS. The contract's rows
(:func:`contract_rows`, ``harness.families.qwen3_omni.contract``): the user turn's ``U`` rows
(``<|im_start|>user\\n{user}<|im_end|>\\n``), the assistant header (``<|im_start|>``, ``assistant``, ``\\n``),
four ``tts_pad`` rows (think tags, speaker), ``tts_bos`` on codec PAD, ``r_0`` on codec BOS at ``P - 1``
(``P = U + 9``), then one row per decode position: ``r_{k+1}``, then ``tts_eos``, then ``tts_pad`` for ever.

**The rules** (rules 1-3 of ``harness.families.qwen3_tts.speaking``) at each sampled position ``m >= P - 1``:
start only with a codec-BOS row in the KV (else babble); a started Talker says ``codec_id(byte, prev)``
= ``256 * tag(prev) + byte`` (``tag``: the previous row's byte's low 2 bits); a row without a byte says
:data:`SILENCE` at ``tts_eos`` and at the first ``tts_pad``, :data:`CODEC_EOS` otherwise. A correct
request says its reply's bytes, SILENCE, SILENCE, EOS.

**Codec ids** (the checkpoint's): the release suppresses the Talker's top 1,024 ids (2048-3071) but codec EOS
2150, and Code2Wav's codebook is 2,048, so everything the Talker says must sit below 2048: speech ids
``0 .. 1023`` (:data:`TAGS` = 4 tags of 256 bytes), :data:`BABBLE` 1024, :data:`SILENCE` 1025; Qwen3-Omni's
real specials PAD/BOS/EOS 2148-2150 (the release stops the Talker on 2150), think tags 2155-2157, speakers
2301-2303. The code predictor's 15 residual codes are whatever it samples (nothing reads them back).

Public API: the constants above, :class:`Row`, :func:`tag`, :func:`codec_id`, :func:`next_code`, :func:`say`,
:func:`talk`, :func:`user_turn_len`, :func:`prompt_len`, :func:`contract_rows`, :func:`text_token_ids`,
:func:`check_text`, :class:`Spoken`, :func:`decode`, :func:`encode_reply`.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.speaking.rules import BYTES, END_POSITIONS, EOS_MARK, PAD_MARK  # noqa: F401 - part of this module's API
from harness.speaking.rules import UNINTELLIGIBLE, Spoken, Table  # noqa: F401 - part of this module's API
from harness.speaking import rules

# The checkpoint's ids (``harness.families.qwen3_omni.tiny_model`` builds it with them):
# the role words, single tokens on Qwen's ids (0.30.0 qwen3_omni.py l.1050-1084 and
# stage_input_processors/qwen3_omni.py l.80-83 read the role id after <|im_start|>)
ROLE_TOKENS = {"user": 872, "system": 8948, "assistant": 77091}
# Qwen3-Omni's added tokens on their ids (its tokenizer_config.json)
SPECIAL_TOKENS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
    "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663, "<|file_sep|>": 151664, "<tool_response>": 151665, "</tool_response>": 151666,
    "<think>": 151667, "</think>": 151668, "<|audio_start|>": 151669, "<|audio_end|>": 151670,
    "<tts_pad>": 151671, "<tts_text_bos>": 151672, "<tts_text_eod>": 151673, "<tts_text_bos_single>": 151674,
    "<|audio_pad|>": 151675,
}
# Qwen3-Omni's codec ids (its talker_config)
CODEC = {"codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155,
         "codec_think_bos_id": 2156, "codec_think_eos_id": 2157}
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
TALKER_VOCAB = 3072
CODE2WAV_CODEBOOK = 2048  # Code2Wav's codebook
TAGS = 4  # the previous byte's low 2 bits: 1024 speech ids, below the release's suppressed top 1024
BABBLE = 1024  # rule 1: a Talker that never saw a codec-BOS row
SILENCE = 1025  # rule 3: said at tts_eos and at the first tts_pad
CODEBOOK = CODE2WAV_CODEBOOK  # 2048: the ids the Talker may say (plus EOS), Code2Wav's codebook
SUPPRESSED = range(TALKER_VOCAB - 1024, TALKER_VOCAB)  # the release's mask (but codec EOS)
CODEC_PAD, CODEC_BOS, CODEC_EOS = CODEC["codec_pad_id"], CODEC["codec_bos_id"], CODEC["codec_eos_token_id"]
CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = (CODEC["codec_nothink_id"], CODEC["codec_think_bos_id"],
                                                   CODEC["codec_think_eos_id"])
DEFAULT_SPEAKER = "chelsie"  # the release's default: the first key of talker_config.speaker_id
# Thinker token ids the Talker's rows come from (the tiny tokenizer's, Qwen's real ones)
IM_START, IM_END = SPECIAL_TOKENS["<|im_start|>"], SPECIAL_TOKENS["<|im_end|>"]
USER, ASSISTANT, SYSTEM = ROLE_TOKENS["user"], ROLE_TOKENS["assistant"], ROLE_TOKENS["system"]
TTS_PAD, TTS_BOS, TTS_EOS = SPECIAL_TOKENS["<tts_pad>"], SPECIAL_TOKENS["<tts_text_bos>"], SPECIAL_TOKENS["<tts_text_eod>"]
NL = ord("\n")
ASSISTANT_ROWS = 9  # contract.ASSISTANT_ROWS: 3 header + 4 tts_pad + tts_bos + r_0
USER_TEMPLATE = 5  # <|im_start|> user \n ... <|im_end|> \n
BOS_MARK = "bos"  # tts_bos's row (EOS_MARK, PAD_MARK: tts_eos's and tts_pad's)
TABLE = Table(tags=TAGS, babble=BABBLE, silence=SILENCE, eos=CODEC_EOS)
tag, codec_id, next_code, decode, encode_reply = TABLE.tag, TABLE.codec_id, TABLE.next_code, TABLE.decode, \
    TABLE.encode_reply
_WORDS = tuple(ROLE_TOKENS) + tuple(SPECIAL_TOKENS)  # what the tiny tokenizer reads as one token


Row = rules.Row  # what the Talker reads of one KV position (harness.speaking.rules)


def say(kv: Sequence[Row], m: int) -> int:
    """The codec id sampled at position ``m`` from KV rows ``kv[0..m]`` (rules 1-3, this family's table)."""
    return TABLE.say(kv, m)


def talk(kv: Sequence[Row], first: int) -> list[int]:
    """The codec stream of a request whose rows never change, from ``first`` (``P - 1``) to codec EOS."""
    return TABLE.talk(kv, first)


def check_text(text: str) -> None:
    """Refuse a text the tiny tokenizer would not turn into one token per byte (a role word or an added token)."""
    if not text:
        raise ValueError("the text is empty (the prompt needs its first byte at P - 1)")
    for word in _WORDS:
        if word in text:
            raise ValueError(f"the text {text[:40]!r} holds {word!r}, which the tiny tokenizer reads as one token")


def text_token_ids(text: str) -> list[int]:
    """The tiny tokenizer's ids of ``text``: its UTF-8 bytes."""
    check_text(text)
    return list(text.encode("utf-8"))


def user_turn_len(user: str) -> int:
    """``U``: the Thinker tokens of ``<|im_start|>user\\n{user}<|im_end|>\\n``."""
    return len(text_token_ids(user)) + USER_TEMPLATE


def prompt_len(user: str) -> int:
    """``P = U + 9`` (``_compute_talker_prompt_ids_length``)."""
    return user_turn_len(user) + ASSISTANT_ROWS


def user_rows(user: str) -> list[Row]:
    """The user turn's rows: ``<|im_start|>``, ``user`` (no byte, no mark), ``\\n``, the bytes, ``<|im_end|>``, ``\\n``."""
    return [Row(), Row(), Row(byte=NL)] + [Row(byte=b) for b in text_token_ids(user)] + [Row(), Row(byte=NL)]


def contract_rows(user: str, reply: str, end: int = END_POSITIONS + 1) -> list[Row]:
    """The rows a correct ``talker_preprocess`` gives positions ``0 .. P + K - 1 + end``."""
    raw = text_token_ids(reply)
    rows = user_rows(user) + [Row(), Row(), Row(byte=NL)]  # <|im_start|> assistant \n
    rows += [Row(mark=PAD_MARK)] * 4  # tts_pad on nothink, think_bos, think_eos, the speaker
    rows += [Row(mark=BOS_MARK), Row(byte=raw[0], bos=True)]  # tts_bos + codec PAD, r_0 + codec BOS
    rows += [Row(byte=b) for b in raw[1:]] + [Row(mark=EOS_MARK)] + [Row(mark=PAD_MARK)] * end
    return rows
