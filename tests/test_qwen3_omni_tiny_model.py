"""The random tiny Qwen3-Omni checkpoint (``harness.families.qwen3_omni.tiny_model``): its config's layout, its
tokenizer's ids and its weight names (pure: transformers' config and model classes on the meta device, no vLLM),
the CLI's choice of checkpoint, and, in the real environment, the build through the CLI (byte-identical on rebuild)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.families.qwen3_omni import FAMILY
from harness.families.qwen3_omni import tiny_model as tm

from conftest import REAL_PY, require_real_env

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "harness.cli"]


def test_the_config_fits_the_release_and_vllms_cpu_attention():
    cfg = tm.config_dict()
    thinker, talker, code2wav = cfg["thinker_config"], cfg["talker_config"], cfg["code2wav_config"]
    for text in (thinker["text_config"], talker["text_config"]):
        assert text["hidden_size"] == text["num_attention_heads"] * text["head_dim"] == 64
        assert text["head_dim"] == 32  # a head size vLLM's CPU attention takes
        assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] // 2
        assert text["num_experts"] >= text["num_experts_per_tok"] >= 1
        assert text["moe_intermediate_size"] % 32 == 0  # vLLM's CPU MoE pads the expert width to 32
    assert thinker["text_config"]["vocab_size"] == 152064
    # the Talker's "hidden" input is Thinker layer accept_hidden_layer's input: it must exist
    assert 0 <= talker["accept_hidden_layer"] < thinker["text_config"]["num_hidden_layers"]
    assert talker["thinker_hidden_size"] == thinker["text_config"]["hidden_size"]
    assert thinker["audio_config"]["output_dim"] == thinker["vision_config"]["out_hidden_size"] == 64
    vision = thinker["vision_config"]
    assert (vision["image_size"] // vision["patch_size"]) ** 2 == vision["num_position_embeddings"]
    assert all(i < vision["depth"] for i in vision["deepstack_visual_indexes"])
    # the release samples layer-0 codes below vocab - 1024 (the rest suppressed but codec EOS): the codebook;
    # every codec special and speaker sits above it, inside the vocabulary
    vocab = talker["text_config"]["vocab_size"]
    assert vocab - 1024 == tm.CODEBOOK == talker["code_predictor_config"]["vocab_size"] == code2wav["codebook_size"]
    for tid in [*tm.CODEC.values(), *talker["speaker_id"].values()]:
        assert tm.CODEBOOK <= tid < vocab
    # the release reshapes codec ids into 16 code groups (qwen3_omni.py: forward, code2wav)
    assert talker["num_code_groups"] == talker["code_predictor_config"]["num_code_groups"] == 16
    assert code2wav["num_quantizers"] == 16
    # Code2Wav gives the real 1,920 samples per frame (24 kHz at 12.5 Hz)
    samples = 1
    for r in [*code2wav["upsample_rates"], *code2wav["upsampling_ratios"]]:
        samples *= r
    assert samples == 1920


def test_the_transformers_config_keeps_qwens_token_ids():
    pytest.importorskip("transformers.models.qwen3_omni_moe")
    config = tm.tiny_config()
    assert (config.im_start_token_id, config.im_end_token_id) == (151644, 151645)
    assert (config.system_token_id, config.user_token_id, config.assistant_token_id) == (8948, 872, 77091)
    assert (config.tts_pad_token_id, config.tts_bos_token_id, config.tts_eos_token_id) == (151671, 151672, 151673)
    assert config.talker_config.text_config.shared_expert_intermediate_size == tm.MOE_INTERMEDIATE
    assert config.thinker_config.text_config.rope_parameters["mrope_section"] == [6, 5, 5]


def test_the_tokenizer_puts_bytes_roles_and_specials_on_qwens_ids():
    pytest.importorskip("tokenizers")
    tok = tm.build_tokenizer()
    want = tm.check_tokenizer(tok)  # raises if the chat template does not tokenize as Qwen3-Omni's ids
    assert want[:3] == [151644, 8948, 10]
    assert tok("Hi user")["input_ids"] == [*b"Hi ", 872]
    assert tok.convert_tokens_to_ids(["<tts_pad>", "<|audio_pad|>", "<|image_pad|>"]) == [151671, 151675, 151655]
    assert len(tok) == max(tm.SPECIAL_TOKENS.values()) + 1


def test_the_weights_are_named_per_expert_and_drawn_from_the_seed():
    pytest.importorskip("transformers.models.qwen3_omni_moe")
    import torch

    shapes = tm.weight_shapes(tm.tiny_config())
    assert not [n for n in shapes if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    for stack in ("thinker.model", "talker.model"):
        for e in range(tm.NUM_EXPERTS):
            assert shapes[f"{stack}.layers.0.mlp.experts.{e}.gate_proj.weight"] == (tm.MOE_INTERMEDIATE, 64)
            assert shapes[f"{stack}.layers.0.mlp.experts.{e}.down_proj.weight"] == (64, tm.MOE_INTERMEDIATE)
        assert shapes[f"{stack}.layers.0.mlp.gate.weight"] == (tm.NUM_EXPERTS, 64)
    assert shapes["talker.model.layers.0.mlp.shared_expert.gate_proj.weight"] == (tm.MOE_INTERMEDIATE, 64)
    assert shapes["thinker.lm_head.weight"] == (152064, 64)
    assert shapes["talker.codec_head.weight"] == (tm.TALKER_VOCAB, 64)
    assert len([n for n in shapes if n.startswith("talker.code_predictor.lm_head.")]) == 15
    assert any(n.startswith("code2wav.") for n in shapes)
    small = {k: v for k, v in shapes.items() if not k.startswith("thinker.")}
    a, b, c = tm.random_state(small, 0), tm.random_state(small, 0), tm.random_state(small, 1)
    assert all(torch.equal(a[k], b[k]) for k in small)
    assert not torch.equal(a["talker.codec_head.weight"], c["talker.codec_head.weight"])
    assert torch.equal(a["talker.model.norm.weight"], torch.ones(64))


def test_the_family_builds_the_speaking_checkpoint_by_default_and_the_random_one_on_request():
    argv = ["-m", "harness.families.qwen3_omni.tiny_model", "/tmp/x", "--seed", "3"]
    assert FAMILY.tiny_model_argv("/tmp/x", 3, None) == [*argv, "--speaking"]  # no flag: the family's default
    assert FAMILY.tiny_model_argv("/tmp/x", 3, True) == [*argv, "--speaking"]
    assert FAMILY.tiny_model_argv("/tmp/x", 3, False) == argv
    assert FAMILY.speaking_rules().CODEC_EOS == 2150
    assert tm.config_dict()["talker_config"]["text_config"]["attention_bias"] is False
    assert tm.config_dict(speaking=True)["talker_config"]["text_config"]["attention_bias"] is True


def test_the_checkpoint_is_built_offline_and_byte_identical_on_rebuild(tmp_path):
    require_real_env()
    out = tmp_path / "tiny"
    res = subprocess.run([*CLI, "tiny-model", str(out), "--family", "qwen3-omni", "--random", "--python", str(REAL_PY)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert (summary["family"], summary["hidden_size"], summary["num_experts"], summary["speaking"]) == (
        "qwen3-omni", 64, tm.NUM_EXPERTS, False)
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert {"config.json", "generation_config.json", "model.safetensors", "omni_stress_tiny_model.json",
            "processor_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert config["model_type"] == "qwen3_omni_moe"
    again = tmp_path / "again"
    res = subprocess.run([str(REAL_PY), "-m", "harness.families.qwen3_omni.tiny_model", str(again)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(str(p.relative_to(again)) for p in again.rglob("*") if p.is_file()) == names
    for name in names:
        if name != "omni_stress_tiny_model.json":  # holds the path
            assert (out / name).read_bytes() == (again / name).read_bytes(), name
