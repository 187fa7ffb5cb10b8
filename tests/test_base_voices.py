"""Issue 45, item 3, the Base model's voices: a prompt gives its voice as a speaker embedding (the x-vector a Qwen3-TTS
Base checkpoint puts in the speaker's row; the API's ``speaker_embedding``), the sim tells the voices apart by value
(a codec id of its own per distinct vector), the real backend sends it as the API takes it and refuses a checkpoint
that cannot take it, and state an arm keeps across requests shows as cross-request positions, as it does for a
CustomVoice speaker.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.config import load_prompts

ROOT = Path(__file__).resolve().parents[1]
FIX = "harness.families.qwen3_tts.fix:Qwen3TTSFixedTalker"
VOICE_OF_FIRST = "tests.fixtures.tts_mutants:VoiceOfFirstRequest"


def test_the_shipped_base_voices_are_the_tiny_checkpoints():
    """``prompts/voices/tiny-base-*.npy`` are ``speaking_model.base_voice(0..3)``: zero but the VOICE dim, four values."""
    from harness.families.qwen3_tts import speaking_model as sm

    for k, name in enumerate("abcd"):
        vector = np.load(ROOT / "prompts" / "voices" / f"tiny-base-{name}.npy")
        assert vector.dtype == np.float32 and vector.shape == (sm.HIDDEN,)
        assert vector.tolist() == np.array(sm.base_voice(k), dtype=np.float32).tolist()
        assert np.flatnonzero(vector).tolist() == [sm.VOICE]
    with pytest.raises(ValueError, match="the tiny checkpoint's are 0..3"):
        sm.base_voice(4)


def test_a_base_set_reads_each_prompts_vector_from_its_file():
    for name, count in (("qwen3_tts_base", 16), ("qwen3_tts_base_cpu_smoke", 4)):
        prompts = load_prompts(name)
        assert len(prompts.prompts) == count and all(p.speaker is None for p in prompts.prompts)
        values = [p.speaker_embedding[40] for p in prompts.prompts]  # type: ignore[index]
        assert values[:4] == [np.float32(8 / 3 * k / 4).item() for k in (1, 2, 3, 4)] and values[4:] == values[:-4]
        assert {len(p.speaker_embedding or ()) for p in prompts.prompts} == {64}


def test_a_set_level_vector_inline_and_a_two_row_file(tmp_path):
    np.save(tmp_path / "v.npy", np.array([[0.5, -1.0, 2.0]], dtype=np.float64))
    (tmp_path / "p.yaml").write_text("family: qwen3-tts\nspeaker_embedding: [1, 2.5, 3]\nprompts:\n"
                                     "  - id: a\n    text: Hello there.\n"
                                     "  - id: b\n    text: Good night.\n    speaker_embedding: v.npy\n")
    prompts = load_prompts(str(tmp_path / "p.yaml"))
    assert [p.speaker_embedding for p in prompts.prompts] == [(1.0, 2.5, 3.0), (0.5, -1.0, 2.0)]


def test_vectors_of_two_lengths_are_refused(tmp_path):
    from harness.errors import ConfigError

    (tmp_path / "p.yaml").write_text("family: qwen3-tts\nspeaker_embedding: [1, 2, 3]\nprompts:\n"
                                     "  - id: a\n    text: Hello there.\n"
                                     "  - id: b\n    text: Good night.\n    speaker_embedding: [1, 2]\n")
    with pytest.raises(ConfigError) as err:
        load_prompts(str(tmp_path / "p.yaml"))
    assert str(err.value) == (f"{tmp_path / 'p.yaml'}: prompts[1].speaker_embedding: 2 values, but prompts[0]'s has 3 "
                              "(a checkpoint takes one size: its Talker's hidden size)")


def _cell(arm_target: str) -> tuple:
    """The Qwen3-TTS stress deploy's sim cell on the Base set, and a runner over it."""
    from test_cross_request import _cell as cross_cell

    return cross_cell(arm_target, prompt_set="qwen3_tts_base")


def test_a_base_request_carries_its_vector_as_the_serving_layer_does():
    from harness.families.qwen3_tts.sim import XVECTOR_CODEC_FIRST

    cell, _ = _cell(FIX)
    first, second, fifth = cell.requests[0], cell.requests[1], cell.requests[4]
    payload = second.payload({})
    assert payload["task_type"] == ["Base"] and payload["x_vector_only_mode"] == [True] and "speaker" not in payload
    assert payload["voice_clone_prompt"] == [{"ref_spk_embedding": list(second.prompt.speaker_embedding)}]
    # one codec id per distinct vector, in the order the set first gives it; the fifth prompt repeats the first's
    assert [r.voice_codec for r in cell.requests[:5]] == [XVECTOR_CODEC_FIRST + k for k in (0, 1, 2, 3, 0)]
    assert fifth.voice_codec == first.voice_codec
    # the speaker's row (P - 3) holds the voice's codec id
    assert second.prompt_codec_ids.tolist()[6] == XVECTOR_CODEC_FIRST + 1


def test_the_builder_makes_the_speaker_row_from_the_payloads_vector():
    """Whichever request's payload the builder is handed, the speaker row is that payload's voice (as the release puts
    the given vector in the row); a Base payload without a vector is refused as the release refuses it."""
    cell, _ = _cell(FIX)
    first, second = cell.requests[:2]
    builder = cell.model._prompt_builder
    own, _t, _a, _b = builder.build_prompt_embeds(task_type="Base", info_dict=second.payload({}))
    assert own.equal(second.prompt_rows)
    other = {**second.payload({}), "voice_clone_prompt": first.payload({})["voice_clone_prompt"]}
    rows, _t, _a, _b = builder.build_prompt_embeds(task_type="Base", info_dict=other)
    text_ids, codec_ids = cell.space.identify(rows)
    assert codec_ids.tolist()[6] == first.voice_codec and text_ids.tolist() == second.prompt_text_ids.tolist()
    assert rows[:6].equal(second.prompt_rows[:6]) and rows[7:].equal(second.prompt_rows[7:])
    with pytest.raises(ValueError, match="Base requires `ref_audio`"):
        builder.build_prompt_embeds(task_type="Base", info_dict={**second.payload({}), "voice_clone_prompt": None})
    with pytest.raises(ValueError, match="knows no speaker embedding of 3 values"):
        builder.build_prompt_embeds(task_type="Base", info_dict={**second.payload({}), "voice_clone_prompt": [
            {"ref_spk_embedding": [1.0, 2.0, 3.0]}]})


def test_a_speaker_embedding_kept_across_requests_is_cross_request():
    """``VoiceOfFirstRequest`` keeps the first request's voice, here its speaker embedding: the second request's
    speaker row is the first's vector, one position of its prompt, cross-request and misaligned. The fix: none."""
    from test_cross_request import _two_requests  # two requests admitted in one step, then three decode steps

    for arm, cross, misaligned in ((VOICE_OF_FIRST, [0, 1], [0, 1, 0, 0, 0, 0, 0, 0]), (FIX, [0, 0], [0] * 8)):
        counts, calls = _two_requests(arm, prompt_set="qwen3_tts_base")
        assert (list(counts.values()), calls) == (cross, misaligned), arm


def test_another_requests_vector_is_foreign_and_an_unknown_one_is_nobodys():
    cell, _ = _cell(FIX)
    first, second = cell.requests[:2]
    codecs = np.array([first.voice_codec, second.voice_codec, 8400, 100])
    assert cell.contract.foreign_voice(second, codecs).tolist() == [True, False, False, False]
    assert cell.contract.foreign_voice(first, codecs).tolist() == [False, True, False, False]


def test_the_speech_request_of_a_base_prompt():
    from harness.families.qwen3_tts.serve import request_body

    prompts = load_prompts("qwen3_tts_base_cpu_smoke")
    body = request_body("m", prompts, prompts.prompts[1], None, "tag", True, False)
    assert body["task_type"] == "Base" and "voice" not in body
    assert body["speaker_embedding"] == list(prompts.prompts[1].speaker_embedding)  # type: ignore[arg-type]
    custom = load_prompts("qwen3_tts_cpu_smoke")
    body = request_body("m", custom, custom.prompts[1], None, "tag", True, False)
    assert (body["task_type"], body["voice"]) == ("CustomVoice", "Ryan") and "speaker_embedding" not in body


def _checkpoint(tmp_path: Path, kind: str, hidden: int = 64) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"tts_model_type": kind, "talker_config": {"hidden_size": hidden}}))
    return str(tmp_path)


def test_a_checkpoint_that_cannot_take_the_sets_voices_is_refused(tmp_path):
    from harness.families.qwen3_tts.serve import check_model_voices

    base, custom = load_prompts("qwen3_tts_base_cpu_smoke"), load_prompts("qwen3_tts_cpu_smoke")
    model = _checkpoint(tmp_path, "base")
    assert check_model_voices(model, base) is None
    assert check_model_voices(model, custom) == (
        f"{custom.path}: {model} is a Base checkpoint (config.json: tts_model_type base), which takes no CustomVoice "
        "speaker: give every prompt a speaker_embedding (e.g. --prompts qwen3_tts_base_cpu_smoke)")
    model = _checkpoint(tmp_path, "custom_voice")
    assert check_model_voices(model, custom) is None
    assert check_model_voices(model, base) == (
        f"{base.path}: prompts[0].speaker_embedding: {model} is a custom_voice checkpoint (config.json: "
        "tts_model_type), which takes no speaker embedding (serve a Base checkpoint, e.g. tiny-model --family "
        "qwen3-tts --variant base)")
    model = _checkpoint(tmp_path, "base", hidden=1024)
    assert check_model_voices(model, base) == (
        f"{base.path}: prompts[0].speaker_embedding: 64 values; {model}'s Talker takes 1024 (config.json: "
        "talker_config.hidden_size)")
    assert check_model_voices(str(tmp_path / "absent"), base) is None  # not a local checkpoint: its server says


def test_the_cli_refuses_a_base_set_on_a_custom_voice_checkpoint_before_any_server(tmp_path):
    model = _checkpoint(tmp_path, "custom_voice")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--backend", "vllm-omni", "--platform", "cpu",
                          "--model", model, "--family", "qwen3-tts", "--arm", "tts-fix", "--deploy",
                          "qwen3-tts-cpu-reference", "--prompts", "qwen3_tts_base_cpu_smoke", "--asr", "none",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "prompts[0].speaker_embedding" in lines[0] and "custom_voice checkpoint" in lines[0]
    assert not out.exists()


def test_tiny_model_refuses_a_variant_the_family_does_not_build(tmp_path):
    run = subprocess.run([sys.executable, "-m", "harness.cli", "tiny-model", str(tmp_path / "m"), "--family",
                          "qwen3-tts", "--variant", "voice_design"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip() == ("omni-stress: error: tiny-model --family qwen3-tts: --variant 'voice_design': "
                                  "unknown (variants: base)")
    assert not (tmp_path / "m").exists()


def test_the_base_checkpoints_config():
    from harness.families.qwen3_tts.tiny_model import config_dict

    base, custom = config_dict(base=True), config_dict()
    assert (base["tts_model_type"], custom["tts_model_type"]) == ("base", "custom_voice")
    assert base["talker_config"]["spk_id"] == {} and len(custom["talker_config"]["spk_id"]) == 9
    assert {k: v for k, v in base.items() if k not in ("tts_model_type", "talker_config")} == \
        {k: v for k, v in custom.items() if k not in ("tts_model_type", "talker_config")}
