"""The speaking tiny Qwen3-Omni: its rules and read-back (pure), and, in the real environment, the
checkpoint's build (deterministic) and the transformers-free self-check's margins."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.families.qwen3_omni import contract
from harness.families.qwen3_omni import speaking as sp

from conftest import REAL_PY, require_real_env

USER = "Say hello."
TEXT = "Heat the water."


def test_the_contract_rows_say_the_reply_then_silence_silence_eos():
    P = sp.prompt_len(USER)
    assert P == sp.user_turn_len(USER) + contract.ASSISTANT_ROWS == len(USER) + 5 + 9
    rows = sp.contract_rows(USER, TEXT)
    assert len(rows) == P + len(TEXT) + sp.END_POSITIONS + 1
    assert rows[P - 1] == sp.Row(byte=ord("H"), bos=True)
    assert rows[P - 2] == sp.Row(mark=sp.BOS_MARK)
    assert [r for r in rows[:P - 1] if r.bos] == []
    codes = sp.talk(rows, P - 1)
    assert codes == sp.encode_reply(TEXT) + [sp.CODEC_EOS]
    assert codes[0] == ord("H") and codes[1] == (ord("H") % 4) * 256 + ord("e") == 101
    assert codes[-3:] == [sp.SILENCE, sp.SILENCE, sp.CODEC_EOS]
    assert sp.decode(codes) == sp.Spoken(text=TEXT, codes=17, speech=15, babble=0, garbled=0, other=0, silence=2)


def test_the_round_trip_is_exact_for_every_byte_pair():
    text = "".join(chr(c) for c in range(32, 127)) + " caf\u00e9 \u00fcber"
    for t in (text, text[::-1], "a", "Heat the water until it is hot, then wait two minutes."):
        if "user" in t or "system" in t:
            continue
        assert sp.decode(sp.encode_reply(t)).text == " ".join(t.split())
        assert sp.decode(sp.encode_reply(t) + [sp.CODEC_EOS, ord("x")]).text == " ".join(t.split())
    for prev in range(256):
        for byte in range(1, 256):
            code = sp.codec_id(byte, prev)
            assert 0 <= code < sp.BABBLE and code % 256 == byte and code // 256 == prev % sp.TAGS


def test_without_a_bos_row_it_babbles_and_a_wrong_row_is_heard():
    P = sp.prompt_len(USER)
    rows = sp.contract_rows(USER, TEXT)
    no_bos = [sp.Row(r.byte, r.mark, False) for r in rows]
    assert sp.talk(no_bos, P - 1) == [sp.BABBLE] * len(TEXT) + [sp.SILENCE, sp.SILENCE, sp.CODEC_EOS]
    wrong = list(rows)
    wrong[P - 1 + 6] = sp.Row(byte=ord("q"))
    assert sp.decode(sp.talk(wrong, P - 1)).text == "Heat tqe water."
    assert sp.decode([*sp.encode_reply(TEXT)[:6], sp.codec_id(ord("t"), ord("y")), *sp.encode_reply(TEXT)[7:]]
                     ).text == "Heat <unk> water."
    bare = list(rows)
    bare[P - 1 + 6] = sp.Row()
    assert sp.talk(bare, P - 1)[6:] == [sp.CODEC_EOS]


def test_every_id_it_says_survives_the_release_mask_and_code2wav():
    said = {sp.BABBLE, sp.SILENCE, *range(sp.TAGS * sp.BYTES)}
    assert max(said) < sp.CODEBOOK == 2048  # Code2Wav's codebook; the release suppresses 2048-3071
    assert sp.CODEC_EOS in sp.SUPPRESSED and min(sp.SUPPRESSED) == sp.CODEBOOK
    assert (sp.CODEC_PAD, sp.CODEC_BOS, sp.CODEC_EOS) == (2148, 2149, 2150)
    assert (sp.TTS_PAD, sp.TTS_BOS, sp.TTS_EOS, sp.ASSISTANT) == (151671, 151672, 151673, 77091)


def test_texts_the_tiny_tokenizer_would_not_split_into_bytes_are_refused():
    assert sp.text_token_ids("Hi") == [72, 105]
    for text in ("ask the assistant", "a user", "<|im_end|>", "x<tts_pad>"):
        with pytest.raises(ValueError, match="reads as one token"):
            sp.check_text(text)
    with pytest.raises(ValueError, match="empty"):
        sp.check_text("")


# ------------------------------------------------------------------ the checkpoint (real environment)

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "harness.cli"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """``omni-stress tiny-model DIR --family qwen3-omni --speaking``, once for the module."""
    require_real_env()
    out = tmp_path_factory.mktemp("omni") / "tiny"
    res = subprocess.run([*CLI, "tiny-model", str(out), "--family", "qwen3-omni", "--speaking",
                          "--python", str(REAL_PY)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    return out, json.loads(res.stdout.strip().splitlines()[-1])


def test_the_speaking_checkpoint_is_built_with_attention_bias(built):
    out, summary = built
    assert (summary["family"], summary["hidden_size"], summary["speaking"]) == ("qwen3-omni", 64, True)
    config = json.loads((out / "config.json").read_text())
    assert config["talker_config"]["text_config"]["attention_bias"] is True
    assert config["thinker_config"]["text_config"]["attention_bias"] is False


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_self_check_holds_with_margins(built, dtype):
    out, _ = built
    res = subprocess.run([str(REAL_PY), "-m", "harness.families.qwen3_omni.speaking_check", str(out), "--dtype", dtype],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0 and result["ok"] is True, result
    text = result["text"]
    said = {case: result[case]["said"] for case in ("correct", "long", "no_bos", "v1_replay", "wrong_row", "bare",
                                                    "full_payload_tail")}
    assert said == {"correct": text, "long": text, "no_bos": "", "v1_replay": text[0],
                    "wrong_row": text.replace("the", "tqe", 1), "bare": "Heat the", "full_payload_tail": text[:-1]}
    # the smallest gap between the rule's id and any other allowed id (26.9 in both dtypes: v1_replay's end rows)
    assert result["min_margin"] >= 25.0 and result["min_prob"] == 1.0, result


def test_the_self_check_refuses_a_folder_that_is_no_checkpoint(tmp_path):
    res = subprocess.run([sys.executable, "-m", "harness.families.qwen3_omni.speaking_check", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"omni-stress: error: {tmp_path}: not a tiny Qwen3-Omni checkpoint (no config.json and model.safetensors)"]
