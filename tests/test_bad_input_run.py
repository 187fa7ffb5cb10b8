"""Bad input to ``omni-stress run``: plugin arms that misbehave, and what the run does about them
(docs/robustness.md). Each through the CLI as a user types it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import REPO, run_cli

E2E_PROMPTS = REPO / "tests" / "data" / "prompts_e2e.yaml"
BAD_PROMPT = "p03-sleep"

# ----------------------------------------------------------------------------- an arm that ignores every interruption

_DEAF_PLUGIN = """\
import signal
import time

from harness.talkers.pr import FixedTalker


class Deaf(FixedTalker):
    \"\"\"Ignores SIGINT and SIGALRM, swallows every exception and never returns (on one prompt).\"\"\"

    def talker_preprocess(self, input_ids, input_embeds, **info):
        if info.get("request_id") == {bad!r}:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            while True:
                try:
                    time.sleep(0.05)
                except BaseException:
                    pass
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


@pytest.mark.parametrize("workers, deploys, arms", [("1", ["reference"], ["x"]),
                                                    ("2", ["reference", "stress"], ["x", "y"])],
                         ids=["one-cell-sim-workers-1", "four-cells-two-workers"])
def test_arm_that_ignores_every_interruption_fails_its_request(tmp_path: Path, workers: str, deploys: list[str],
                                                                arms: list[str]) -> None:
    """Issue 33, case 1: the run did not end (the cell was given up only after 3600 s). Now the call is ended by
    ending the sim worker it runs in; the worker is replaced and the cell simulated again with that call failed,
    so the run goes on and every other record is the one a working timeout gives."""
    (tmp_path / "deaf_plugin.py").write_text(_DEAF_PLUGIN.format(bad=BAD_PROMPT))
    args = ["run", "--asr", "none", "--quiet", "--prompts", str(E2E_PROMPTS), "--sim-workers", workers,
            "--arm-timeout", "2", "--out", str(tmp_path / "out"), "--run-id", "r"]
    for arm in arms:
        # y: the same hang, interruptible (its sleep loop lets the timeout through): the records a working timeout gives
        args += ["--arm", "x=deaf_plugin:Deaf" if arm == "x" else "y=tests.fixtures.misbehaving:NeverReturns"]
    for deploy in deploys:
        args += ["--deploy", deploy]
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)}
    res = run_cli(*args, env=env)
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stderr
    records = [json.loads(ln) for ln in (tmp_path / "out" / "r" / "requests.jsonl").read_text().splitlines()]
    assert len(records) == len(arms) * len(deploys) * 3
    failed = {(r["arm"], r["deploy"], r["prompt_id"]): r for r in records if r["error"]}
    assert set(failed) == {(a, d, BAD_PROMPT) for a in arms for d in deploys}, (
        {k: r["error"] for k, r in failed.items()}, res.stderr[-3000:])
    for rec in failed.values():
        if rec["arm"] == "y":
            assert rec["error"] == "ArmTimeout: talker_preprocess did not return within 2 s (the per-call limit, --arm-timeout)"
            continue
        assert rec["error"] == ("ArmTimeout: talker_preprocess did not return within 2 s (the per-call limit, "
                                "--arm-timeout) and ignored the interruption; its sim worker was replaced")
        assert rec["finish_reason"] == "abort"
    # every record of x, the failed ones included, is y's (but for the error's text and the wall time)
    by = {(r["arm"], r["deploy"], r["prompt_id"]): r for r in records}
    for (arm, deploy, prompt), rec in by.items():
        if arm == "x" and ("y", deploy, prompt) in by:
            ours = {k: v for k, v in rec.items() if k not in ("arm", "wall_s", "error")}
            theirs = {k: v for k, v in by[("y", deploy, prompt)].items() if k not in ("arm", "wall_s", "error")}
            assert ours == theirs
