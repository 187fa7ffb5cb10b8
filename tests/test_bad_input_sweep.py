"""Bad input to ``omni-stress sweep`` (docs/robustness.md); the sweep's own checks are in tests/test_sweep.py."""

from __future__ import annotations

import os


from clikit import _CHDIR_PLUGIN, _cli_in, _prompts, _records


def test_6_a_plugin_that_changes_directory_does_not_move_a_sweep(tmp_path):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (tmp_path / "chdir_plugin_round4.py").write_text(_CHDIR_PLUGIN)
    prompts = _prompts(tmp_path, 1)
    sweep = work / "one.yaml"
    sweep.write_text("name: one\nbase: stress\nreference: reference\naxes:\n  load: [all]\n")
    res = _cli_in(work, "sweep", "one.yaml", "--asr", "none", "--quiet", "--no-plots", "--sim-workers", "0",
                  "--arm", "c=chdir_plugin_round4:ChangesDirectory", "--prompts", os.path.relpath(prompts, work),
                  "--out", "rel/out", "--run-id", "s", "--cache-dir", "rel/cache", env={"CHDIR_TO": str(elsewhere)})
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    run_dir = work / "rel" / "out" / "s"
    assert len(_records(run_dir)) == 2 and all(not r["error"] for r in _records(run_dir))  # reference + 1 point
    assert (run_dir / "manifest.json").is_file() and (run_dir / "sweep.md").is_file()
    assert list(elsewhere.iterdir()) == []  # nothing written where the plugin went
