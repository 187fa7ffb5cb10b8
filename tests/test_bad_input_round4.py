"""Issue 24, the cases still open after round 3, each through the CLI as a user types it.

Every case asserts the exit code and the one ``omni-stress: error:`` line (naming the file, prompt,
character or option), or, where the input is not an error, that the run completes with nothing
measured lost. The case numbers are the issue's; docs/robustness.md has the same table.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMALL_PROMPTS

SMALL = yaml.safe_load(SMALL_PROMPTS.read_text())


def _prompts(tmp: Path, count: int = 1) -> Path:
    """The small prompt set cut to its first ``count`` prompts."""
    data = copy.deepcopy(SMALL)
    data["prompts"] = data["prompts"][:count]
    path = tmp / f"prompts-{count}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _cli_in(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300,
            preexec_fn=None) -> subprocess.CompletedProcess:
    """``omni-stress ARGS`` in a subprocess started in ``cwd`` (relative paths are the user's)."""
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False, preexec_fn=preexec_fn,
                          env={**os.environ, "PYTHONPATH": f"{cwd.parent}{os.pathsep}{REPO}", **(env or {})})


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "requests.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- 6: a plugin that changes directory

_CHDIR_PLUGIN = """\
import os

from harness.talkers.pr import FixedTalker

os.chdir(os.environ["CHDIR_TO"])  # at import (the run's pre-flight imports it before any directory exists)


class ChangesDirectory(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        os.chdir(os.environ["CHDIR_TO"])  # and in every call, in the run's process or a sim worker
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_6_a_plugin_that_changes_directory_does_not_move_the_run(tmp_path, workers):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (tmp_path / "chdir_plugin_round4.py").write_text(_CHDIR_PLUGIN)
    prompts = _prompts(tmp_path, 2)
    env = {"CHDIR_TO": str(elsewhere), "OMNI_STRESS_CACHE_DIR": "cache"}  # a relative cache folder too
    args = ["--asr", "none", "--quiet", "--arm", "c=chdir_plugin_round4:ChangesDirectory", "--deploy", "reference",
            "--sim-workers", workers, "--prompts", os.path.relpath(prompts, work)]
    res = _cli_in(work, "run", *args, "--out", "rel/out", "--run-id", "r", "--cache-dir", "rel/cache", env=env)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    run_dir = work / "rel" / "out" / "r"
    assert res.stdout.rstrip().endswith(f"results: {run_dir}")  # the path the user meant, said in full
    assert len(_records(run_dir)) == 2 and all(not r["error"] for r in _records(run_dir))
    assert (run_dir / "summary.csv").is_file() and (run_dir / "manifest.json").is_file()
    assert list(elsewhere.iterdir()) == []  # nothing written where the plugin went

    # a relative --resume after the run lost its last record: found where the user means, completed
    lines = (run_dir / "requests.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "requests.jsonl").write_text(lines[0])
    res = _cli_in(work, "run", *args, "--resume", "rel/out/r", env=env)
    assert res.returncode == 0, res.stderr
    assert len(_records(run_dir)) == 2 and all(not r["error"] for r in _records(run_dir))
    assert list(elsewhere.iterdir()) == []
