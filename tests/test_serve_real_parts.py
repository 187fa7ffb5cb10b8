"""Pure parts of the real backend on CPU, in the sim's environment: the cpu platform profile of the
deploy translation, what an arm binding sets on the model class, and the worker's contract check
(run here on the sim's model host, which carries the same helper methods as vLLM-Omni's model)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from harness.config import load_deploy, load_prompts
from harness.errors import UserError
from harness.serve import arm_binding
from harness.serve.deploy_args import translate_deploy
from harness.serve.worker_contract import count_misaligned
from harness.families.qwen2_5_omni.model import bind_arm
from harness.sim.rows import RowSpace
from harness.families.qwen2_5_omni.thinker import run_thinker, token_id_table
from harness.families.qwen2_5_omni.main import MainTalker
from harness.families.qwen2_5_omni.pr import FixedTalker


def test_cpu_profile_of_the_stress_deploy() -> None:
    t = translate_deploy(load_deploy("stress"), "cpu")
    assert t.stage_overrides == {
        "0": {"block_size": 32, "devices": "0", "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 1},
        "1": {"block_size": 32, "devices": "1", "enable_chunked_prefill": True, "enable_prefix_caching": False,
              "kv_cache_memory_bytes": 256 << 20, "max_model_len": 1984, "max_num_batched_tokens": 32,
              "max_num_seqs": 4, "num_gpu_blocks_override": 64},  # 128 blocks of 16 = 64 blocks of 32
        "2": {"block_size": 32, "devices": "2", "dtype": "float32", "kv_cache_memory_bytes": 64 << 20,
              "max_num_seqs": 1},
    }
    assert dict(t.env) == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert t.platform == "cpu"


def test_gpu_profile_is_unchanged() -> None:
    t = translate_deploy(load_deploy("stress"))
    assert json.loads(t.cli_args[1]) == {
        "0": {"max_num_seqs": 1},
        "1": {"block_size": 16, "enable_chunked_prefill": True, "enable_prefix_caching": False,
              "max_model_len": 1984, "max_num_batched_tokens": 32, "max_num_seqs": 4, "num_gpu_blocks_override": 128},
        "2": {"max_num_seqs": 1},
    }
    assert t.env == () and t.platform == "gpu"


def test_unknown_platform_is_refused() -> None:
    with pytest.raises(UserError, match="--platform 'tpu'"):
        translate_deploy(load_deploy("reference"), "tpu")


def test_binding_takes_the_arms_own_methods_not_the_helper_port() -> None:
    assert sorted(arm_binding.methods_of(MainTalker)) == [
        "talker_preprocess", "thinker_to_talker_decode_one_step", "thinker_to_talker_process"]
    assert sorted(arm_binding.methods_of(FixedTalker)) == ["talker_preprocess"]

    class Model:
        def talker_preprocess(self, input_ids, input_embeds, **info):  # noqa: ANN001, ANN202
            return "upstream"

    info = arm_binding.bind(Model, "harness.families.qwen2_5_omni.pr:FixedTalker")
    assert Model.talker_preprocess is FixedTalker.talker_preprocess
    assert Model._omni_stress_upstream_talker_preprocess(None, None, None) == "upstream"
    assert info["bound_methods"] == ["talker_preprocess"] and info["arm"] == "harness.families.qwen2_5_omni.pr:FixedTalker"
    assert info["arm_file"].endswith("harness/families/qwen2_5_omni/pr.py") and len(info["arm_sha256"]) == 64


def test_binding_a_missing_arm_raises() -> None:
    with pytest.raises(AttributeError):
        arm_binding.bind(type("M", (), {}), "harness.families.qwen2_5_omni.pr:NoSuchArm")


def _call(impl: type, c: int, n: int) -> tuple[dict, object]:
    space = RowSpace(0)
    model = bind_arm(impl, space)
    model.profile_run(64)
    out = run_thinker(load_prompts("default"), space, 1.0)[0]
    ids_all = list(out.talker_prompt_ids) + [7, 8, 9, 10, 11, 12] * 40  # prompt, then codec tokens
    ids = torch.tensor(ids_all[c:c + n], dtype=torch.int64)
    embeds = model.talker.embed_input_ids(ids)
    info = {**out.payload(token_id_table([out])), "_omni_prompt_len": out.P, "_omni_num_computed_tokens": c,
            "_omni_is_prefill": c < out.P, "request_id": out.request_id}
    before = ids.clone()
    result = model.talker_preprocess(input_ids=ids, input_embeds=embeds, **info)
    return count_misaligned(model, info, before, result, embeds), out


@pytest.mark.parametrize("c,n", [(0, 32), (32, 32), (50, 32), (90, 30)])
def test_contract_check_counts_nothing_for_pr(c: int, n: int) -> None:
    got, out = _call(FixedTalker, c, n)
    assert got == {"misaligned_text": 0, "misaligned_end": 0, "text_len": 58}, (got, out.P)


def test_contract_check_counts_mains_chunk_rows() -> None:
    got, out = _call(MainTalker, 16, 32)  # main copies prompt rows 0..31 into positions 16..47
    assert out.P > 48
    assert got == {"misaligned_text": 32, "misaligned_end": 0, "first_misaligned": 16, "text_len": 58}


def test_contract_check_splits_regions_past_text_eos() -> None:
    # codec rows without their text-PAD component past text-EOS (0.30.0's empty queue) count as end
    got, out = _call(FixedTalker, 0, 8)
    assert got == {"misaligned_text": 0, "misaligned_end": 0, "text_len": 58}
    space = RowSpace(0)
    model = bind_arm(FixedTalker, space)
    K = out.output_rows.shape[0]
    c = out.P + K + 3  # past text-EOS
    ids = torch.tensor([5, 6], dtype=torch.int64)
    info = {**out.payload(token_id_table([out])), "_omni_prompt_len": out.P, "_omni_num_computed_tokens": c}
    wrong = (ids, model.talker.embed_input_ids(ids), {})  # codec rows without the text-PAD component
    assert count_misaligned(model, info, ids, wrong, None) == {"misaligned_text": 0, "misaligned_end": 2,
                                                               "first_misaligned": c, "text_len": K - 1}
    assert K - 1 == 58  # the reply's rows up to text-EOS past the prompt: positions P .. P + 58


def test_contract_check_reports_a_payload_it_cannot_use() -> None:
    space = RowSpace(0)
    model = bind_arm(FixedTalker, space)
    ids = torch.tensor([1, 2])
    got = count_misaligned(model, {"_omni_prompt_len": 10, "_omni_num_computed_tokens": 0}, ids,
                           (ids, torch.zeros(2, 64), {}), None)
    assert got == {"contract_error": "ValueError: no Thinker output rows (hidden_states.output)"}


def test_dry_run_shows_the_cpu_profile_and_the_bound_arm(tmp_path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "--backend", "vllm-omni", "--dry-run", "--platform", "cpu",
         "--serve-python", sys.executable, "--model", "/models/tiny", "--arm", "pr", "--deploy", "stress",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "platform cpu, arm harness.families.qwen2_5_omni.pr:FixedTalker bound onto the installed model" in text
    assert "OMNI_STRESS_ARM=harness.families.qwen2_5_omni.pr:FixedTalker" in text
    assert "VLLM_CPU_OMP_THREADS_BIND=nobind" in text and "OMP_NUM_THREADS=1" in text
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in text
    assert '"num_gpu_blocks_override": 64' in text and '"dtype": "float32"' in text
    assert f"{sys.executable} -m vllm.entrypoints.cli.main serve /models/tiny --omni" in text
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_an_arm_without_serve_and_no_real_environment_is_one_line(tmp_path, monkeypatch) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "OMNI_STRESS_SERVE_PYTHON"}
    out = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "--backend", "vllm-omni", "--platform", "cpu",
         "--serve-python", str(tmp_path / "no-such-python"), "--arm", "pr", "--deploy", "reference",
         "--asr", "none", "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-python" in lines[0] and "arm 'pr'" in lines[0], out.stderr


def test_contract_check_tolerates_bfloat16_rounding_not_wrong_rows() -> None:
    """vLLM runs the tiny model's Talker in bfloat16 on CPU: correct rows rounded to bf16 are aligned,
    rows from the wrong positions still are not."""
    space = RowSpace(0)
    out = run_thinker(load_prompts("default"), space, 1.0)[0]
    K = out.output_rows.shape[0]
    for impl, c, n, want in ((FixedTalker, 16, 32, {"misaligned_text": 0, "misaligned_end": 0, "text_len": 58}),
                             (FixedTalker, out.P + K - 3, 6,
                              {"misaligned_text": 0, "misaligned_end": 0, "text_len": 58}),
                             (MainTalker, 16, 32, {"misaligned_text": 32, "misaligned_end": 0,
                                                   "first_misaligned": 16, "text_len": 58})):
        model = bind_arm(impl, space)
        model.profile_run(64)
        ids_all = list(out.talker_prompt_ids) + [7, 8, 9, 10, 11, 12] * 40
        ids = torch.tensor(ids_all[c:c + n], dtype=torch.int64)
        info = {**out.payload(token_id_table([out])), "_omni_prompt_len": out.P, "_omni_num_computed_tokens": c}
        embeds = model.talker.embed_input_ids(ids)
        r_ids, r_embeds, upd = model.talker_preprocess(input_ids=ids, input_embeds=embeds, **info)
        rounded = (r_ids, r_embeds.to(torch.bfloat16), upd)
        assert count_misaligned(model, info, ids.clone(), rounded, embeds) == want, (impl.__name__, c, n)


def test_a_bound_subclass_arm_keeps_super_class_attributes_and_properties(monkeypatch) -> None:
    """Issue 24 case 21: the model vLLM builds is an instance of the arm's class, so ``super()`` works."""
    import types

    from tests.fixtures.subclass_arm import SuperPr

    module = types.ModuleType("fake_upstream_model")
    module.__file__ = __file__  # describe() hashes the model class's source file

    class Model:
        def talker_preprocess(self, input_ids, input_embeds, **info):  # noqa: ANN001, ANN202
            return "upstream"

    Model.__module__ = module.__name__
    module.Model = Model
    monkeypatch.setitem(sys.modules, module.__name__, module)
    calls: list[str] = []
    monkeypatch.setattr(FixedTalker, "talker_preprocess",
                        lambda self, ids, embeds, **info: calls.append(type(self).__name__) or "fixed")
    info = arm_binding.bind(Model, "tests.fixtures.subclass_arm:SuperPr")
    assert info["bound_methods"] == ["LABEL", "calls", "label", "talker_preprocess"]
    built = module.Model  # what vLLM's registry resolves by name
    assert built is not Model and built.__name__ == "Model" and issubclass(built, (Model, SuperPr))
    model = built()
    assert model.talker_preprocess(None, None) == "fixed" and calls == ["Model"]
    assert model.label == "super-pr" and built.calls == 1
    assert arm_binding.bind(built, "tests.fixtures.subclass_arm:SuperPr")["arm"].endswith(":SuperPr")
