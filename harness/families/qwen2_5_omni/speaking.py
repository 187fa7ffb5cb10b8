"""The speaking tiny model's rules: what its Talker says for the rows it reads, and how to read it back.

Pure, no torch: Qwen2.5-Omni's codec ids on the table every speaking checkpoint follows
(``harness.speaking.rules``: :func:`tag`, :func:`codec_id`, :func:`next_code`, :func:`decode` and
:func:`encode_reply` are :data:`TABLE`'s), shared by the weights that implement the rules inside
vLLM-Omni's real model (``harness/families/qwen2_5_omni/speaking_model.py``), the real backend's oracle
transcript (the codec stream decoded through the table) and the sim's ``speaking`` Talker mode, so the
sim and the real server run the same Talker (docs/speaking-model.md).

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

Reading a codec stream back (:func:`decode`, ``harness.speaking.rules.decode_table``): each speech id gives its byte and the tag of the byte
it heard before; a byte whose tag disagrees with the byte actually said before it (what a listener
heard) is unintelligible, and so is the word that holds it. Babble and silence are no speech.

:data:`SILENCE` is codec id 0, the speech id of byte NUL after a byte with tag 0: a config file
cannot hold NUL (``harness.config`` refuses control characters), so no reply says it, and the
checkpoint's ``codec_head`` row 0 scores silence instead.
"""

from __future__ import annotations

from harness.speaking.rules import BYTES, END_POSITIONS, EOS_MARK, PAD_MARK  # noqa: F401 - part of this module's API
from harness.speaking.rules import UNINTELLIGIBLE, Spoken, Table  # noqa: F401 - part of this module's API

TAGS = 32  # the previous byte's low 5 bits: 256 * 32 = 8192 speech ids, all below Code2Wav's 8193 codes
BABBLE = 8192  # one id for a Talker that never saw its start row
CODEC_EOS = 8294
SILENCE = 0  # rule 3: said at the text-EOS row and the first text-PAD row (never a reply's byte: NUL)
TABLE = Table(tags=TAGS, babble=BABBLE, silence=SILENCE, eos=CODEC_EOS)
# rule 2's speech id, rules 1-3 for one position, the oracle transcript, a correct reply's codec stream
tag, codec_id, next_code, decode, encode_reply = TABLE.tag, TABLE.codec_id, TABLE.next_code, TABLE.decode, \
    TABLE.encode_reply
