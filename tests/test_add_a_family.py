""""Adding a family" (docs/adding-a-family.md), followed as a newcomer would (issue 46 item 5): a toy
text-to-speech family, ``toy-tts``, is one new package ``harness/families/toy_tts/`` (a subclass of the
Qwen3-TTS family under its own name, with its own default deploys and prompt set) plus its YAML: two
deploys, a prompt set, a gate rules file and its arms appended to ``deploy_configs/arms.yaml``. Nothing
else is edited (the file trees before and after are compared by hash), and the copy's CLI lists the
family, runs it end to end on the sim (its records are the parent family's for the same work, field by
field, under the toy's names) and gates the run with its own rules; a family that leaves out a member
is refused at registration with the missing members named, as the recipe says.

The checkout is copied to a temporary folder, the recipe's files written there, and the copy's CLI run
from it (``python -m harness.cli`` imports the copy first), as tests/test_add_a_metric.py does."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

pytestmark = pytest.mark.slow

COPIED = ("harness", "deploy_configs", "prompts", "pyproject.toml")

# Step 1 of the recipe: the package. Its __init__.py defines FAMILY, an instance of a Family subclass that
# declares every member; here the Qwen3-TTS class supplies the methods and the toy overrides its name and
# its own defaults.
PACKAGE = '''"""toy-tts: Qwen3-TTS's rows, runner path and Talker under another name (docs/adding-a-family.md)."""

from __future__ import annotations

from harness.families.qwen3_tts import Qwen3TTS


class ToyTTS(Qwen3TTS):
    name = "toy-tts"
    default_arms = ("toy-release", "toy-fix")
    default_deploys = ("toy-tts-reference", "toy-tts-stress")
    default_prompts = "toy_tts"
    gate_rules = "gates-toy-tts"


FAMILY = ToyTTS()
'''

# Step 3: the arms, appended to deploy_configs/arms.yaml (indented under its ``arms:``).
ARMS = '''  # toy-tts (family toy-tts): the Qwen3-TTS release's preprocess and the fix, under the toy family
  toy-release:
    description: "vLLM-Omni 0.30.0's Qwen3-TTS preprocess, driven as the toy family"
    talker: vllm-omni:0.30.0
    role: baseline
    family: toy-tts
  toy-fix:
    description: "The Qwen3-TTS fix, driven as the toy family"
    talker: harness.families.qwen3_tts.fix:Qwen3TTSFixedTalker
    role: candidate
    family: toy-tts
'''

N_PROMPTS = 4


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256), caches left out."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def _retag(text: str, changes: dict[str, str]) -> str:
    """``text`` (a shipped YAML file) with the top-level keys in ``changes`` given new values, line by line,
    so the comments and every other line stay as shipped."""
    lines = text.splitlines(keepends=True)
    for key, value in changes.items():
        hits = [i for i, line in enumerate(lines) if line.startswith(f"{key}:")]
        assert len(hits) == 1, key
        lines[hits[0]] = f"{key}: {value}\n"
    return "".join(lines)


def _follow_the_recipe(root: Path) -> None:
    package = root / "harness" / "families" / "toy_tts"
    package.mkdir()
    (package / "__init__.py").write_text(PACKAGE)

    # Step 2: deploys with family:, role: and pair:, copied from the Qwen3-TTS ones.
    configs = root / "deploy_configs"
    (configs / "toy-tts-reference.yaml").write_text(_retag(
        (configs / "qwen3-tts-reference.yaml").read_text(),
        {"name": "toy-tts-reference", "family": "toy-tts", "role": "reference"}))
    (configs / "toy-tts-stress.yaml").write_text(_retag(
        (configs / "qwen3-tts-stress.yaml").read_text(),
        {"name": "toy-tts-stress", "family": "toy-tts", "role": "stress", "pair": "toy-tts-reference"}))

    # A prompt set with family:, fewer prompts than Qwen3-TTS's 16 so the run stays short.
    shipped = yaml.safe_load((root / "prompts" / "qwen3_tts.yaml").read_text())
    prompt_set = {"name": "toy_tts", "description": "the first texts of prompts/qwen3_tts.yaml, for toy-tts",
                  "family": "toy-tts", "prompts": shipped["prompts"][:N_PROMPTS]}
    (root / "prompts" / "toy_tts.yaml").write_text(yaml.safe_dump(prompt_set, sort_keys=False, width=200))

    with open(configs / "arms.yaml", "a") as fh:
        fh.write(ARMS)

    # Step 4: its own gate rules (the Qwen3-TTS rules, for this family).
    (configs / "gates-toy-tts.yaml").write_text(_retag((configs / "gates-qwen3-tts.yaml").read_text(),
                                                       {"family": "toy-tts"}))


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=root, capture_output=True, text=True,
                          timeout=900, check=False)


def test_a_new_family_is_one_package_and_its_yaml(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    root.mkdir()
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, root / name)
    before = _tree(root)
    _follow_the_recipe(root)

    # Nothing but the new package, its YAML and arms.yaml changed.
    after = _tree(root)
    added = sorted(set(after) - set(before))
    assert added == ["deploy_configs/gates-toy-tts.yaml", "deploy_configs/toy-tts-reference.yaml",
                     "deploy_configs/toy-tts-stress.yaml", "harness/families/toy_tts/__init__.py",
                     "prompts/toy_tts.yaml"]
    assert set(before) <= set(after)
    assert [p for p in before if before[p] != after[p]] == ["deploy_configs/arms.yaml"]

    # The registry finds the package by itself.
    listed = _cli(root, "list", "families")
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert "  toy-tts      talker -> code2wav; talker's preprocess under test\n" in listed.stdout, listed.stdout
    assert ("defaults: --arm toy-release --arm toy-fix --deploy toy-tts-reference --deploy toy-tts-stress "
            "--prompts toy_tts; sim Talkers words, speaking") in listed.stdout

    # A run of the family: its defaults, the words sim Talker, the oracle transcript.
    out = tmp_path / "results"
    run = _cli(root, "run", "--family", "toy-tts", "--asr", "none", "--no-cache", "--quiet", "--out", str(out),
               "--run-id", "toy")
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = out / "toy"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["family"] == "toy-tts"
    assert manifest["arms"] == [
        {"name": "toy-release", "role": "baseline", "talker": "vllm-omni:0.30.0"},
        {"name": "toy-fix", "role": "candidate", "talker": "harness.families.qwen3_tts.fix:Qwen3TTSFixedTalker"}]
    assert manifest["deploys"] == ["toy-tts-reference", "toy-tts-stress"]
    assert manifest["deploy_roles"] == {"toy-tts-reference": {"pair": None, "role": "reference"},
                                        "toy-tts-stress": {"pair": "toy-tts-reference", "role": "stress"}}
    assert (manifest["prompts"], manifest["sim_talker"]) == ("toy_tts", "words")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["complete"] is True and summary["problems"] == []
    assert summary["roles"] == {"toy-release": "baseline", "toy-fix": "candidate"}
    assert summary["reference_deploy"] == "toy-tts-reference"
    cells = {(c["arm"], c["deploy"]): c for c in summary["cells"]}
    assert sorted(cells) == sorted((a, d) for a in ("toy-release", "toy-fix")
                                   for d in ("toy-tts-reference", "toy-tts-stress"))
    # Qwen3-TTS's bug under the toy's stress deploy, and the fix's rows exact everywhere.
    assert cells[("toy-release", "toy-tts-stress")]["misaligned_text_positions"] > 0
    assert all(cells[("toy-fix", d)]["misaligned_positions"] == 0 for d in ("toy-tts-reference", "toy-tts-stress"))
    assert cells[("toy-fix", "toy-tts-stress")]["nonzero_offset_chunks"] > 0

    # The records are Qwen3-TTS's, field by field, for the same work under the Qwen3-TTS names: the family's
    # methods are the parent's, so only the names (and the wall times) differ.
    prompts = yaml.safe_load((root / "prompts" / "toy_tts.yaml").read_text())
    tts_prompts = tmp_path / "qwen3_tts_small.yaml"
    tts_prompts.write_text(yaml.safe_dump({**prompts, "name": "qwen3_tts_small", "family": "qwen3-tts"}))
    parent = _cli(root, "run", "--family", "qwen3-tts", "--arm", "tts-0.30.0", "--arm", "tts-fix", "--deploy",
                  "qwen3-tts-reference", "--deploy", "qwen3-tts-stress", "--prompts", str(tts_prompts), "--asr", "none",
                  "--no-cache", "--quiet", "--out", str(out), "--run-id", "parent")
    assert parent.returncode == 0, parent.stderr[-3000:]
    names = {"toy-release": "tts-0.30.0", "toy-fix": "tts-fix", "toy-tts-reference": "qwen3-tts-reference",
             "toy-tts-stress": "qwen3-tts-stress"}

    def records(run_dir: Path, rename: dict[str, str]) -> dict[tuple, dict]:
        out = {}
        for line in (run_dir / "requests.jsonl").read_text().splitlines():
            r = json.loads(line)
            r.pop("wall_s")
            r["arm"], r["deploy"] = rename.get(r["arm"], r["arm"]), rename.get(r["deploy"], r["deploy"])
            out[(r["arm"], r["deploy"], r["repeat"], r["prompt_id"])] = r
        return out

    toy = records(run_dir, names)
    assert len(toy) == 4 * N_PROMPTS
    assert {k[3] for k in toy} == {p["id"] for p in prompts["prompts"]}
    assert toy == records(out / "parent", {})
    first = toy[("tts-fix", "qwen3-tts-stress", 1, prompts["prompts"][0]["id"])]
    assert (first["reference_text"], first["error"], first["finish_reason"]) == (prompts["prompts"][0]["text"], None,
                                                                                  "stop")

    # Its gate rules are found by the family's name and pass the run: the fix keeps the contract, the
    # release (a baseline) still shows the bug.
    gate = _cli(root, "gate", str(run_dir))
    assert gate.returncode == 0, gate.stdout[-3000:] + gate.stderr[-3000:]
    assert ("PASS   baseline-stress-shows-bug (expected failure): toy-release/toy-tts-stress run 1 [baseline]"
            in gate.stdout)
    assert "gate: 9 passed, 0 failed, 3 skipped, 0 could not be evaluated -> pass (exit 0)" in gate.stdout

    # The recipe's warning: a family that leaves out a member is refused at registration, by name.
    broken = root / "harness" / "families" / "broken_tts"
    broken.mkdir()
    (broken / "__init__.py").write_text('from harness.family import Family\n\n\nclass Broken(Family):\n'
                                        '    name = "broken"\n\n\nFAMILY = Broken()\n')
    refused = _cli(root, "list", "families")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert ("harness.families.broken_tts: family 'broken' does not declare stages, stage_under_test, hook, "
            "trace_target, request_api, conform_model, default_arms, default_deploys, default_prompts, sim_talkers, "
            "text_input, speaking_blind_spots, gate_rules, serve_missing, sim_cell, check_prompts, talker_prompt_lens, load_arm, "
            "speaking_rules, serve, tiny_model_argv (every member of harness.family.Family is required)"
            ) in refused.stderr
