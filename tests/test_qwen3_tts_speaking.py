"""The speaking tiny Qwen3-TTS: its rules and read-back (pure), and, in the real environment, the
checkpoint's build (deterministic) and the transformers-free self-check's margins."""

from __future__ import annotations

import pytest

from harness.families.qwen3_tts import speaking as sp

TEXT = "Heat the water."


def test_the_contract_rows_say_the_text_then_silence_silence_eos():
    rows = sp.contract_rows(TEXT)
    assert len(rows) == sp.PROMPT_LEN + len(TEXT) + sp.END_POSITIONS + 1
    assert rows[sp.PROMPT_LEN - 1] == sp.Row(byte=ord("H"), bos=True)
    assert rows[sp.PROMPT_LEN - 2] == sp.Row(mark=sp.BOS_MARK)
    codes = sp.talk(rows)
    assert codes == sp.encode_reply(TEXT) + [sp.CODEC_EOS]
    assert codes[0] == ord("H") and codes[1] == (ord("H") % 8) * 256 + ord("e") == 101
    assert codes[-3:] == [sp.SILENCE, sp.SILENCE, sp.CODEC_EOS]
    assert sp.decode(codes) == sp.Spoken(text=TEXT, codes=17, speech=15, babble=0, garbled=0, other=0, silence=2)


def test_without_a_bos_row_it_babbles_then_ends():
    rows = [sp.Row(r.byte, r.mark, False) for r in sp.contract_rows(TEXT)]
    codes = sp.talk(rows)
    assert codes == [sp.BABBLE] * len(TEXT) + [sp.SILENCE, sp.SILENCE, sp.CODEC_EOS]
    assert sp.decode(codes).text == "" and sp.decode(codes).babble == len(TEXT)


def test_a_wrong_row_is_heard():
    rows = sp.contract_rows(TEXT)
    m = sp.PROMPT_LEN - 1 + 6  # the 'h' of "the"
    wrong = list(rows)
    wrong[m] = sp.Row(byte=ord("q"))
    assert sp.decode(sp.talk(wrong)).text == "Heat tqe water."  # the wrong byte is said (and heard: the next tag agrees with it)
    assert sp.decode([*sp.encode_reply(TEXT)[:6], sp.codec_id(ord("t"), ord("x")), *sp.encode_reply(TEXT)[7:]]
                     ).text == "Heat <unk> water."
    pads = list(rows)
    pads[m] = pads[m + 1] = sp.Row(mark=sp.PAD_MARK)  # V1's replay: tts_pad rows inside the text
    codes = sp.talk(pads)
    assert codes[6:] == [sp.SILENCE, sp.CODEC_EOS] and sp.decode(codes).text == "Heat t"
    bare = list(rows)
    bare[m] = sp.Row()  # a bare codec row (multi-position decode): the request ends there
    assert sp.talk(bare)[6:] == [sp.CODEC_EOS]


def test_the_end_rules():
    assert sp.next_code(True, None, ord("a"), sp.EOS_MARK) == sp.SILENCE
    assert sp.next_code(False, None, None, sp.PAD_MARK, sp.EOS_MARK) == sp.SILENCE
    assert sp.next_code(True, None, None, sp.PAD_MARK, sp.PAD_MARK) == sp.CODEC_EOS
    assert sp.next_code(True, None, None, sp.BOS_MARK, None) == sp.CODEC_EOS
    assert sp.next_code(True, None, ord("a")) == sp.CODEC_EOS
    assert sp.next_code(True, ord("a"), ord(" ")) == 97


def test_ids_fit_the_codebook_and_the_specials_are_outside_it():
    assert sp.TAGS * sp.BYTES == sp.BABBLE < sp.SILENCE < sp.CODEBOOK <= sp.CODEC_PAD
    assert max(sp.SPEAKERS.values()) < sp.TALKER_VOCAB
    assert sp.text_token_ids("Hi") == [72, 105]
    with pytest.raises(ValueError, match="holds 'assistant'"):
        sp.check_text("an assistant")
    with pytest.raises(ValueError, match="empty"):
        sp.check_text("")
    with pytest.raises(ValueError, match="outside the KV"):
        sp.say([sp.Row()], 1)
