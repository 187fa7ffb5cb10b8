"""The speaking tiny Qwen3-TTS: its rules and read-back (pure), and, in the real environment, the
checkpoint's build (deterministic) and the transformers-free self-check's margins."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.families.qwen3_tts import speaking as sp

from conftest import REAL_PY, require_real_env

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


# ------------------------------------------------------------------ the checkpoint (real environment)

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "harness.cli"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """``omni-stress tiny-model DIR --family qwen3-tts``, once for the module."""
    require_real_env()
    out = tmp_path_factory.mktemp("tts") / "tiny"
    res = subprocess.run([*CLI, "tiny-model", str(out), "--family", "qwen3-tts", "--python", str(REAL_PY)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    return out, json.loads(res.stdout.strip().splitlines()[-1])


def test_the_checkpoint_is_built_offline_and_byte_identical_on_rebuild(built, tmp_path):
    out, summary = built
    assert (summary["family"], summary["hidden_size"], summary["codebook"], summary["speaking"]) == (
        "qwen3-tts", 64, sp.CODEBOOK, True)
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert {"config.json", "model.safetensors", "omni_stress_tiny_model.json", "tokenizer.json",
            "speech_tokenizer/config.json", "speech_tokenizer/model.safetensors",
            "speech_tokenizer/preprocessor_config.json"} <= set(names)
    again = tmp_path / "again"
    res = subprocess.run([str(REAL_PY), "-m", "harness.families.qwen3_tts.tiny_model", str(again)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    for name in names:
        if name != "omni_stress_tiny_model.json":  # holds the path
            assert (out / name).read_bytes() == (again / name).read_bytes(), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_self_check_holds_with_margins(built, dtype):
    out, _ = built
    res = subprocess.run([str(REAL_PY), "-m", "harness.families.qwen3_tts.speaking_check", str(out), "--dtype", dtype],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0 and result["ok"] is True, result
    text = result["text"]
    said = {case: result[case]["said"] for case in ("correct", "long", "no_bos", "v1_replay", "wrong_row", "bare",
                                                    "other_voice")}
    assert said == {"correct": text, "long": text, "no_bos": "", "v1_replay": "",
                    "wrong_row": text.replace("the", "tqe", 1), "bare": "Heat the", "other_voice": text}
    # the smallest gap between the rule's id and any other allowed id (docs/families/qwen3_tts.md: 31.1 in both dtypes)
    assert result["min_margin"] >= 30.0 and result["min_prob"] == 1.0, result


def test_the_cli_refuses_a_random_qwen3_tts_checkpoint_in_one_line(tmp_path):
    res = subprocess.run([*CLI, "tiny-model", str(tmp_path / "m"), "--family", "qwen3-tts", "--random",
                          "--python", sys.executable], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "omni-stress: error: tiny-model --family qwen3-tts: only the speaking checkpoint is built (drop --random)"]


def test_the_self_check_refuses_a_folder_that_is_no_checkpoint(tmp_path):
    res = subprocess.run([sys.executable, "-m", "harness.families.qwen3_tts.speaking_check", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"omni-stress: error: {tmp_path}: not a tiny Qwen3-TTS checkpoint (no config.json and model.safetensors)"]
