"""The model-family seam (issue 29): the registry, a run's family from its deploys or --family, the
checks that keep one family's arms, deploys and prompts together, and a second family driving the
sim's step loop through its own hook."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, invoke_cli
from harness.config import ArmSpec, ConfigError, load_arms, load_deploy, load_prompts
from harness.errors import UserError
from harness.family import DEFAULT_FAMILY, EXTRA_MODULES, choose_family, get_family

E2E_PROMPTS = REPO / "tests" / "data" / "prompts_e2e.yaml"


def test_qwen2_5_omni_is_the_default_family_and_names_its_parts():
    fam = get_family("qwen2.5-omni")
    assert DEFAULT_FAMILY == "qwen2.5-omni"
    assert fam.stages == ("thinker", "talker", "code2wav") and fam.stage == "talker"
    assert fam.hook == "talker_preprocess"
    assert fam.trace_target.endswith("qwen2_5_omni:Qwen2_5OmniForConditionalGeneration")
    assert fam.request_api == "/v1/chat/completions"
    assert (fam.default_arms, fam.default_deploys, fam.default_prompts) == (("main", "pr"), ("reference", "stress"),
                                                                           "default")
    assert fam.text_input is False and fam.gate_rules == "gates" and fam.serve_missing is None
    assert fam.serve().request_body.__module__ == "harness.families.qwen2_5_omni.serve"


def test_unknown_family_is_one_line_naming_where():
    with pytest.raises(UserError) as exc:
        get_family("qwen9", "deploy_configs/x.yaml: family")
    assert str(exc.value) == "deploy_configs/x.yaml: family: unknown model family 'qwen9' (known: qwen2.5-omni, qwen3-omni, qwen3-tts)"


def test_shipped_configs_belong_to_the_default_family():
    for name in ("reference", "stress", "specdec", "cpu-reference", "cpu-stress"):
        assert load_deploy(name).family == "qwen2.5-omni"
    assert load_prompts("default").family == "qwen2.5-omni"
    by_family = {a.name: a.family for a in load_arms().values()}
    assert by_family == {"main": "qwen2.5-omni", "pr": "qwen2.5-omni", "tts-0.30.0": "qwen3-tts",
                         "tts-0.32.0rc1": "qwen3-tts", "tts-fix": "qwen3-tts", "omni3-0.30.0": "qwen3-omni",
                         "omni3-0.32.0rc1": "qwen3-omni", "omni3-fix": "qwen3-omni"}
    for name in ("qwen3-tts-reference", "qwen3-tts-stress", "qwen3-tts-mrv2-reference", "qwen3-tts-mrv2-stress"):
        assert load_deploy(name).family == "qwen3-tts"
    assert load_prompts("qwen3_tts").family == "qwen3-tts"
    for name in ("qwen3-omni-reference", "qwen3-omni-stress", "qwen3-omni-full-reference", "qwen3-omni-full-stress",
                 "qwen3-omni-full-mrv2-reference", "qwen3-omni-full-mrv2-stress"):
        assert load_deploy(name).family == "qwen3-omni"
    assert load_prompts("qwen3_omni").family == "qwen3-omni"


def _deploy(tmp_path: Path, name: str, family: str | None):
    text = (REPO / "deploy_configs" / "stress.yaml").read_text().replace("name: stress", f"name: {name}")
    if family is not None:
        text += f"family: {family}\n"
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_a_deploys_family_field_is_checked_against_the_registry(tmp_path):
    path = _deploy(tmp_path, "odd", "qwen9")
    with pytest.raises(ConfigError) as exc:
        load_deploy(str(path))
    assert str(exc.value) == f"{path}: family: unknown model family 'qwen9' (known: qwen2.5-omni, qwen3-omni, qwen3-tts)"


@pytest.fixture
def toy(monkeypatch):
    """The test family ``toy`` (tests/fixtures/toy_family.py) registered for this test."""
    monkeypatch.setattr("harness.family.EXTRA_MODULES", [*EXTRA_MODULES, "tests.fixtures.toy_family"])
    from tests.fixtures import toy_family

    toy_family.CALLS.clear()
    return toy_family


def test_choose_family_takes_the_deploys_and_refuses_a_mix(tmp_path, toy):
    qwen, toy_d = load_deploy("stress"), load_deploy(str(_deploy(tmp_path, "toy-stress", "toy")))
    prompts = load_prompts(str(E2E_PROMPTS))
    assert choose_family(None, [qwen], prompts, []).name == "qwen2.5-omni"
    assert choose_family(None, [], None, []).name == "qwen2.5-omni"
    with pytest.raises(UserError) as exc:
        choose_family(None, [qwen, toy_d], prompts, [])
    assert str(exc.value) == (f"{toy_d.path}: family: 'toy', but {qwen.path} is 'qwen2.5-omni'; one run drives one "
                              "model family (give --family to choose)")
    with pytest.raises(UserError) as exc:
        choose_family("toy", [qwen], prompts, [])
    assert str(exc.value) == f"{qwen.path}: family: 'qwen2.5-omni', but the run's family is 'toy' (--family)"
    with pytest.raises(UserError) as exc:
        choose_family(None, [toy_d], prompts, [])
    assert str(exc.value) == (f"{E2E_PROMPTS}: family: 'qwen2.5-omni', but the run's family is 'toy' (its deploys'); "
                              "give a prompt set of toy (e.g. --prompts toy)")
    pr = load_arms()["pr"]
    toy_prompts = load_prompts(str(_toy_prompts(tmp_path)))
    with pytest.raises(UserError) as exc:
        choose_family(None, [toy_d], toy_prompts, [pr])
    assert str(exc.value) == (f"arm 'pr' ({pr.source}): family 'qwen2.5-omni', but the run's family is 'toy' "
                              "(its deploys')")
    plugin = ArmSpec(name="x", talker="harness.families.qwen2_5_omni.pr:FixedTalker", source="--arm")
    assert choose_family(None, [toy_d], toy_prompts, [plugin]).name == "toy"


def _toy_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "toy-prompts.yaml"
    path.write_text(E2E_PROMPTS.read_text() + "family: toy\n")
    return path


def test_a_second_family_drives_the_sim_through_its_own_hook(tmp_path, toy):
    """``run`` with the toy family's deploy and prompts: every cell is built by the toy family's
    ``sim_cell`` hook, the manifest names the family, and the plugin arm (which takes the run's
    family) runs as it does under Qwen2.5-Omni: the same records as the default family's run."""
    deploy = _deploy(tmp_path, "toy-stress", "toy")
    prompts = _toy_prompts(tmp_path)
    common = ("run", "--asr", "none", "--quiet", "--sim-workers", "0", "--arm-timeout", "0",
              "--arm", "fix=harness.families.qwen2_5_omni.pr:FixedTalker",
              "--out", str(tmp_path / "out"))
    res = invoke_cli(*common, "--run-id", "toy", "--deploy", str(deploy), "--prompts", str(prompts))
    assert res.exit_code == 0, res.stderr
    assert toy.CALLS == [("toy-stress", "words")]
    manifest = json.loads((tmp_path / "out" / "toy" / "manifest.json").read_text())
    assert manifest["family"] == "toy"
    res = invoke_cli(*common, "--run-id", "qwen", "--deploy", "stress", "--prompts", str(E2E_PROMPTS))
    assert res.exit_code == 0, res.stderr
    assert json.loads((tmp_path / "out" / "qwen" / "manifest.json").read_text())["family"] == "qwen2.5-omni"
    assert toy.CALLS == [("toy-stress", "words")]  # the default family's cell did not go through the toy hook

    def records(run: str) -> list[dict]:
        out = []
        for line in (tmp_path / "out" / run / "requests.jsonl").read_text().splitlines():
            rec = json.loads(line)
            out.append({k: v for k, v in rec.items() if k not in ("wall_s", "deploy")})
        return out

    assert records("toy") == records("qwen")


def test_family_option_picks_the_familys_defaults_and_checks_the_rest(tmp_path, toy):
    res = invoke_cli("run", "--family", "qwen2.5-omni", "--asr", "none", "--quiet", "--sim-workers", "0",
                     "--deploy", str(_deploy(tmp_path, "toy-stress", "toy")), "--out", str(tmp_path / "out"))
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        f"omni-stress: error: {tmp_path / 'toy-stress.yaml'}: family: 'toy', but the run's family is "
        "'qwen2.5-omni' (--family)"]
    assert not (tmp_path / "out").exists()


def test_resume_refuses_a_run_of_another_family(tmp_path):
    from harness.rundir import check_resume

    run = tmp_path / "run"
    run.mkdir()
    manifest = {"config_hashes": {}, "cells": [], "seed": 42, "backend": "sim", "sim_talker": "words"}
    (run / "manifest.json").write_text(json.dumps(manifest))  # written before families: Qwen2.5-Omni's
    check_resume(run, {**manifest, "family": "qwen2.5-omni"})
    with pytest.raises(UserError) as exc:
        check_resume(run, {**manifest, "family": "toy"})
    assert str(exc.value) == (f"--resume {run}: family differ from the manifest (was 'qwen2.5-omni', now 'toy'); "
                              "start a new run instead")


def test_list_prompts_names_the_voices_a_set_mixes():
    res = invoke_cli("list", "prompts")
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert ("  qwen3_tts_cpu_smoke 4 prompts; Talker prompt length P 9-9; reply tokens 15-17; voices Vivian, Ryan, "
            "Serena, Aiden") in lines
    assert "  default    16 prompts; Talker prompt length P 60-115; reply tokens 59-72" in lines  # no voices


def test_list_families_shows_each_familys_chain_hook_and_defaults():
    res = invoke_cli("list", "families")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.splitlines() == [
        "Model families (harness/families/; a deploy's family:, or --family):",
        "  qwen2.5-omni thinker -> talker -> code2wav; talker's talker_preprocess under test",
        "               real server: /v1/chat/completions, trace "
        "vllm_omni.model_executor.models.qwen2_5_omni.qwen2_5_omni:Qwen2_5OmniForConditionalGeneration; "
        "conform model qwen2.5-omni",
        "               defaults: --arm main --arm pr --deploy reference --deploy stress --prompts default; "
        "sim Talkers words, speaking",
        "  qwen3-omni   thinker -> talker -> code2wav; talker's talker_preprocess under test",
        "               real server: /v1/chat/completions, trace "
        "vllm_omni.model_executor.models.qwen3_omni.qwen3_omni:Qwen3OmniMoeForConditionalGeneration; "
        "conform model qwen3-omni",
        "               defaults: --arm omni3-0.30.0 --arm omni3-fix --deploy qwen3-omni-reference --deploy "
        "qwen3-omni-stress --deploy qwen3-omni-full-reference --deploy qwen3-omni-full-stress --prompts qwen3_omni; "
        "sim Talkers words, speaking",
        "  qwen3-tts    talker -> code2wav; talker's preprocess under test",
        "               real server: /v1/audio/speech, trace "
        "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker:Qwen3TTSTalkerForConditionalGeneration; "
        "conform model qwen3-tts",
        "               defaults: --arm tts-0.30.0 --arm tts-fix --deploy qwen3-tts-reference --deploy qwen3-tts-stress "
        "--deploy qwen3-tts-mrv2-reference --deploy qwen3-tts-mrv2-stress --prompts qwen3_tts; sim Talkers words, speaking",
    ]


def test_a_sim_talker_the_family_has_not_is_refused(tmp_path, toy, monkeypatch):
    monkeypatch.setattr(toy.FAMILY, "sim_talkers", ("words",))
    res = invoke_cli("run", "--asr", "none", "--quiet", "--sim-talker", "speaking", "--arm",
                     "fix=harness.families.qwen2_5_omni.pr:FixedTalker", "--deploy", str(_deploy(tmp_path, "toy-stress", "toy")),
                     "--prompts", str(_toy_prompts(tmp_path)), "--out", str(tmp_path / "out"))
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        "omni-stress: error: --sim-talker speaking: the toy family's sim has the Talkers words"]


def test_a_family_that_omits_a_member_is_refused_at_registration_naming_it(monkeypatch, tmp_path):
    """A copied family that forgets a member must not borrow Qwen2.5-Omni's silently."""
    (tmp_path / "half_family.py").write_text(
        "from harness.family import Family\n\n\n"
        "class Half(Family):\n"
        "    name = 'half'\n"
        "    stages = ('talker',)\n"
        "    stage_under_test = 0\n\n"
        "    def sim_cell(self, impl, deploy, prompts, seed, talker_mode):\n"
        "        return None\n\n\n"
        "FAMILY = Half()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("harness.family.EXTRA_MODULES", [*EXTRA_MODULES, "half_family"])
    with pytest.raises(UserError) as exc:
        get_family("qwen2.5-omni")
    assert str(exc.value) == (
        "half_family: family 'half' does not declare hook, trace_target, request_api, conform_model, default_arms, "
        "default_deploys, default_prompts, sim_talkers, text_input, speaking_blind_spots, gate_rules, serve_missing, "
        "check_prompts, talker_prompt_lens, load_arm, speaking_rules, serve, tiny_model_argv (every member of harness.family.Family is "
        "required)")


def test_families_are_found_without_a_list_and_a_taken_name_is_refused(monkeypatch, tmp_path):
    from harness.family import family_names

    assert family_names() == ("qwen2.5-omni", "qwen3-omni", "qwen3-tts")  # the packages under harness/families/, in order
    (tmp_path / "twin_family.py").write_text(
        "from harness.families.qwen3_tts import Qwen3TTS\n\nFAMILY = Qwen3TTS()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("harness.family.EXTRA_MODULES", [*EXTRA_MODULES, "twin_family"])
    with pytest.raises(UserError) as exc:
        family_names()
    assert str(exc.value) == "twin_family: family name 'qwen3-tts' is taken by another package"


def test_arms_naming_the_old_module_paths_still_load(tmp_path):
    """Qwen2.5-Omni's arms moved into its package; an older arms.yaml (or a recorded manifest's
    ``talker``) naming ``harness.talkers.main`` / ``harness.talkers.pr`` loads the same classes."""
    from harness.families.qwen2_5_omni.main import MainTalker
    from harness.families.qwen2_5_omni.pr import FixedTalker
    from harness.serve.arm_binding import _load as worker_load
    from harness.talkers import load_impl

    arms_file = tmp_path / "arms.yaml"
    arms_file.write_text("arms:\n  old-main:\n    talker: harness.talkers.main:MainTalker\n    role: baseline\n"
                         "  old-pr:\n    talker: harness.talkers.pr:FixedTalker\n")
    arms = load_arms(arms_file)
    assert load_impl(arms["old-main"]) is MainTalker
    assert load_impl(arms["old-pr"]) is FixedTalker
    assert worker_load("harness.talkers.pr:FixedTalker") is FixedTalker  # the Talker worker's own loader
