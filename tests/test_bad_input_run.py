"""Bad input to ``omni-stress run`` while it runs: plugin arms that raise, exit, hang, print, change directory,
leave threads, exhaust memory or ignore every interruption, and the options that bound them (docs/robustness.md).
Each through the CLI as a user types it: that request's error record, the run goes on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from harness.records import read_requests

from clikit import (
    PLUGINS, SMALL, _CHDIR_PLUGIN, _cli_in, _one_prompt, _prompts, _records, _run_args, assert_one_line_error,
    errors_column,
)
from conftest import REPO, SMALL_PROMPTS, invoke_cli, run_cli


# ----------------------------------------------------------------------------- arms that raise


def test_raising_arms_fail_their_requests_and_the_run_goes_on(tmp_path, small_run):
    """A plugin raising on every call fails all of its requests, one raising on one prompt fails that
    request only; both are recorded with the exception text, the table counts them, and the other
    arm's records are exactly those of a run without the raising arms."""
    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path),
                     "--run-id", "r", "--deploy", "stress", "--arm", f"boom={PLUGINS}:raising_talker",
                     "--arm", f"half={PLUGINS}:RaisesOnPrompt", "--arm", "pr")
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    records = read_requests(tmp_path / "r")
    by_arm: dict[str, dict] = {}
    for r in records:
        by_arm.setdefault(r.arm, {})[r.prompt_id] = r
    ids = [p["id"] for p in SMALL["prompts"]]
    assert {a: sorted(v) for a, v in by_arm.items()} == {a: sorted(ids) for a in ("boom", "half", "pr")}
    assert all(r.error == "RuntimeError: plugin arm exploded on purpose" and r.finish_reason == "abort"
               and r.codec_tokens == [] for r in by_arm["boom"].values())
    assert by_arm["half"]["p03-sleep"].error == "ValueError: no rows for p03-sleep"
    assert [pid for pid, r in by_arm["half"].items() if r.error] == ["p03-sleep"]
    assert all(r.oracle_wer == 0.0 for pid, r in by_arm["half"].items() if pid != "p03-sleep")
    reference = {r.prompt_id: r for r in read_requests(small_run) if (r.arm, r.deploy) == ("pr", "stress")}
    assert all(by_arm["pr"][pid].codec_tokens == reference[pid].codec_tokens for pid in ids)
    assert all(r.error is None for r in by_arm["pr"].values())
    errors_col = errors_column(res.stdout)
    assert errors_col == {"boom": 4, "half": 1, "pr": 0}


MIS = "tests.fixtures.misbehaving"


BAD_PROMPT = "p03-sleep"


# ----------------------------------------------------------------------------- F4-F6: misbehaving arms


MISBEHAVING = {  # arm name -> (plugin attr, the error its p03-sleep record must carry)
    "width": ("WrongWidth", "ValueError: talker_preprocess returned rows of shape (", ", 32); expected (rows, 64)"),
    "flat": ("OneDim", "ValueError: talker_preprocess returned rows of shape (64,); expected (rows, 64)"),
    "exit0": ("ExitZero", "SystemExit: talker_preprocess called sys.exit(0)"),
    "exit3": ("ExitThree", "SystemExit: talker_preprocess called sys.exit(3)"),
    "hardexit": ("HardExit", "ArmExit: talker_preprocess called os._exit(0)"),
    "hang": ("NeverReturns", "ArmTimeout: talker_preprocess did not return within 1 s"),
}


def _check_misbehaving_records(run_dir: Path, arms: list[str]) -> None:
    by_arm: dict[str, dict] = {}
    for r in read_requests(run_dir):
        by_arm.setdefault(r.arm, {})[(r.deploy, r.prompt_id)] = r
    ids = [p["id"] for p in SMALL["prompts"]]
    for arm in arms:
        records = by_arm[arm]
        deploys = {d for d, _ in records}
        assert sorted(records) == sorted((d, pid) for d in deploys for pid in ids), arm  # every request recorded
        for (_deploy_name, pid), r in records.items():
            if pid == BAD_PROMPT:
                for part in MISBEHAVING[arm][1:]:
                    assert r.error is not None and part in r.error, (arm, r.error)
                assert r.finish_reason == "abort"
            else:  # the rest of the cell is untouched: correct rows, correct speech
                assert r.error is None and r.oracle_wer == 0.0, (arm, pid, r.error)


def test_F4_F5_F6_misbehaving_arms_fail_their_request_and_the_run_goes_on(tmp_path):
    """In the run's own process (the in-process CLI): wrong-width and 1-D rows, sys.exit(0/3),
    os._exit(0) and a call that never returns each fail p03-sleep's request only."""
    args = ["run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path),
            "--run-id", "r", "--deploy", "stress", "--sim-workers", "0", "--arm-timeout", "1"]
    for arm, (attr, *_rest) in MISBEHAVING.items():
        args += ["--arm", f"{arm}={MIS}:{attr}"]
    res = invoke_cli(*args)
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    _check_misbehaving_records(tmp_path / "r", list(MISBEHAVING))
    assert errors_column(res.stdout) == {arm: 1 for arm in MISBEHAVING}
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["finished"] is not None


def test_F5_F6_in_sim_workers_and_stdout_is_the_table_alone(tmp_path):
    """The installed CLI in a subprocess, cells in two forked sim workers: os._exit and a hang fail
    their request there too; a plugin that prints (at import and on every call) prints to stderr,
    and stdout is exactly the tables."""
    res = run_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path),
                  "--run-id", "r", "--deploy", "stress", "--sim-workers", "2", "--arm-timeout", "1",
                  "--arm", f"hardexit={MIS}:HardExit", "--arm", f"hang={MIS}:NeverReturns",
                  "--arm", f"noisy={MIS}:Prints", timeout=900)
    assert res.exit_code == 0, res.stderr[-3000:]
    _check_misbehaving_records(tmp_path / "r", ["hardexit", "hang"])
    assert all(r.error is None for r in read_requests(tmp_path / "r") if r.arm == "noisy")
    assert "plugin print" not in res.stdout and "plugin write" not in res.stdout and "misbehaving" not in res.stdout
    assert res.stdout.startswith("Run r: ")
    assert res.stdout.rstrip().endswith(f"results: {tmp_path / 'r'}")
    assert "plugin print: p01-weather" in res.stderr and "misbehaving plugin module imported" in res.stderr
    assert errors_column(res.stdout) == {"hardexit": 1, "hang": 1, "noisy": 0}


def test_plugin_print_stays_off_stdout_in_process(tmp_path):
    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path),
                     "--run-id", "r", "--deploy", "reference", "--arm", f"noisy={MIS}:Prints", "--sim-workers", "0")
    assert res.exit_code == 0, res.stderr
    assert "plugin print" not in res.stdout and "plugin write" not in res.stdout and res.stdout.startswith("Run r: ")
    assert "plugin print" in res.stderr


def test_arm_timeout_option_is_checked():
    res = invoke_cli("run", "--arm-timeout", "-1")
    assert_one_line_error(res, "'--arm-timeout'", "-1")


# ----------------------------------------------------------------------------- 9: --arm-timeout nan


@pytest.mark.parametrize("option,value", [("--arm-timeout", "nan"), ("--arm-timeout", "inf"), ("--arm-timeout", "-1"),
                                          ("--arm-timeout", "-inf"), ("--health-timeout", "nan"),
                                          ("--request-timeout", "inf"), ("--request-timeout", "-5")])
def test_9_timeouts_must_be_finite_numbers(tmp_path, option, value):
    res = invoke_cli(*_run_args(tmp_path, f"{option}={value}"))
    assert_one_line_error(res, f"Invalid value for '{option}'", "(see 'omni-stress run --help')")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 11: an arm raising KeyboardInterrupt

_KI_PLUGIN = """\
from harness.families.qwen2_5_omni.pr import FixedTalker


class RaisesKeyboardInterrupt(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        if info.get("request_id") == {bad!r}:
            raise KeyboardInterrupt
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_11_an_arm_raising_keyboard_interrupt_fails_its_request_only(tmp_path, monkeypatch, workers):
    bad = SMALL["prompts"][1]["id"]
    (tmp_path / "ki_plugin_round3.py").write_text(_KI_PLUGIN.format(bad=bad))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    res = invoke_cli("run", "--asr", "none", "--quiet", "--arm", "ki=ki_plugin_round3:RaisesKeyboardInterrupt",
                     "--arm", "pr", "--deploy", "reference", "--deploy", "stress", "--sim-workers", workers,
                     "--prompts", str(SMALL_PROMPTS), "--out", str(out), "--run-id", "r")
    assert res.exit_code == 0, (res.stderr, res.stdout[-2000:])
    assert "Aborted" not in res.stderr
    records = [json.loads(ln) for ln in (out / "r" / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * len(SMALL["prompts"])  # every request recorded
    failed = {(r["arm"], r["deploy"], r["prompt_id"]) for r in records if r["error"]}
    assert failed == {("ki", "reference", bad), ("ki", "stress", bad)}
    assert all(r["error"] == "KeyboardInterrupt: talker_preprocess raised KeyboardInterrupt (not a Ctrl-C)"
               for r in records if r["error"])


# ----------------------------------------------------------------------------- 7: an arm that leaves a thread running

_THREAD_PLUGIN = """\
import threading
import time

from harness.families.qwen2_5_omni.pr import FixedTalker

_started = []


class LeavesAThread(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        if not _started:  # a non-daemon thread that outlives the run by far
            _started.append(threading.Thread(target=time.sleep, args=(600,), name="plugin-forever"))
            _started[0].start()
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_7_an_arm_that_leaves_a_thread_running_does_not_keep_the_run_alive(tmp_path, workers):
    (tmp_path / "thread_plugin_round3.py").write_text(_THREAD_PLUGIN)
    out = tmp_path / "out"
    res = run_cli("run", "--asr", "none", "--quiet", "--arm", "t=thread_plugin_round3:LeavesAThread", "--deploy",
                  "reference", "--sim-workers", workers, "--prompts", _one_prompt(tmp_path), "--out", str(out),
                  "--run-id", "r", timeout=900, env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert res.exit_code == 0, res.stderr
    assert "omni-stress: warning: an arm left 1 thread running ('plugin-forever'); exiting without waiting for it" \
        in res.stderr
    assert "results: " in res.stdout
    assert len((out / "r" / "requests.jsonl").read_text().splitlines()) == 1


# ----------------------------------------------------------------------------- 8: an arm that defeats SIGALRM, then hangs

_SIGNAL_PLUGIN = """\
import signal
import time

from harness.families.qwen2_5_omni.pr import FixedTalker


class _Hangs(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        if info.get("request_id") == {bad!r}:
            self.defeat()
            while True:
                time.sleep(0.05)
        return super().talker_preprocess(input_ids, input_embeds, **info)


class IgnoresAlarm(_Hangs):
    def defeat(self):
        signal.signal(signal.SIGALRM, signal.SIG_IGN)


class ReplacesAlarm(_Hangs):
    def defeat(self):
        signal.signal(signal.SIGALRM, lambda *_: None)


class CancelsTimer(_Hangs):
    def defeat(self):
        signal.setitimer(signal.ITIMER_REAL, 0)

    def talker_preprocess(self, input_ids, input_embeds, **info):
        if info.get("request_id") == {bad!r}:
            self.defeat()
            time.sleep(600)  # one long sleep: nothing but a signal wakes it
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_8_an_arm_that_defeats_sigalrm_still_times_out(tmp_path, monkeypatch, workers):
    bad = SMALL["prompts"][1]["id"]
    module = f"signal_plugin_round3_w{workers}"
    (tmp_path / f"{module}.py").write_text(_SIGNAL_PLUGIN.format(bad=bad))
    monkeypatch.syspath_prepend(str(tmp_path))
    arms = ["IgnoresAlarm", "ReplacesAlarm", "CancelsTimer"]
    args = ["run", "--asr", "none", "--quiet", "--deploy", "reference", "--sim-workers", workers, "--arm-timeout", "1",
            "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path / "out"), "--run-id", "r"]
    for attr in arms:
        args += ["--arm", f"{attr.lower()}={module}:{attr}"]
    res = invoke_cli(*args)
    assert res.exit_code == 0, res.stderr
    records = [json.loads(ln) for ln in (tmp_path / "out" / "r" / "requests.jsonl").read_text().splitlines()]
    assert len(records) == len(arms) * len(SMALL["prompts"])
    failed = {(r["arm"], r["prompt_id"]): r["error"] for r in records if r["error"]}
    assert set(failed) == {(attr.lower(), bad) for attr in arms}
    assert all(e.startswith("ArmTimeout: talker_preprocess did not return within 1 s") for e in failed.values())


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


# ----------------------------------------------------------------------------- 10: an arm that exhausts memory

_MEMORY_PLUGIN = """\
from harness.families.qwen2_5_omni.pr import FixedTalker

BAD = {bad!r}
_hoard = []


class AsksForTooMuch(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        if info.get("request_id") == BAD:
            bytearray(64 << 30)  # 64 GiB: past any limit the test sets
        return super().talker_preprocess(input_ids, input_embeds, **info)


class KeepsAllMemory(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        if info.get("request_id") == BAD and not _hoard:  # takes all but a few MiB, keeps it, returns
            size = 256 << 20
            while size >= 1 << 20:
                try:
                    _hoard.append(bytearray(size))
                except MemoryError:
                    size //= 2
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


MEMORY_LIMIT = 4 << 30  # address space (ulimit -v): a sim run needs about 2.5 GiB of it


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.parametrize("workers", ["0", "2"])
def test_10_an_arm_that_asks_for_too_much_memory_fails_its_request_only(tmp_path, workers):
    bad = SMALL["prompts"][2]["id"]
    (tmp_path / "memory_plugin_round4.py").write_text(_MEMORY_PLUGIN.format(bad=bad))
    work = tmp_path / "work"
    work.mkdir()
    res = _cli_in(work, "run", "--asr", "none", "--quiet", "--arm", "m=memory_plugin_round4:AsksForTooMuch",
                  "--arm", "pr", "--deploy", "reference", "--sim-workers", workers, "--prompts", str(SMALL_PROMPTS),
                  "--out", str(tmp_path / "out"), "--run-id", "r", preexec_fn=_limit_memory)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    records = _records(tmp_path / "out" / "r")
    assert len(records) == 2 * len(SMALL["prompts"])
    assert {(r["arm"], r["prompt_id"]): r["error"] for r in records if r["error"]} == {
        ("m", bad): "MemoryError: talker_preprocess ran out of memory (the process's memory limit, e.g. ulimit -v)"}


def test_10_an_arm_that_keeps_all_memory_stops_the_run_with_one_line_and_resume_completes_it(tmp_path):
    bad = SMALL["prompts"][1]["id"]
    (tmp_path / "memory_plugin_round4.py").write_text(_MEMORY_PLUGIN.format(bad=bad))
    work = tmp_path / "work"
    work.mkdir()
    args = ["--asr", "none", "--quiet", "--arm", "m=memory_plugin_round4:KeepsAllMemory", "--deploy", "reference",
            "--sim-workers", "0", "--prompts", str(SMALL_PROMPTS)]
    run_dir = tmp_path / "out" / "r"
    res = _cli_in(work, "run", *args, "--out", str(tmp_path / "out"), "--run-id", "r", preexec_fn=_limit_memory)
    assert "Traceback" not in res.stderr, res.stderr
    if res.returncode != 0:  # the harness's own next allocation failed: one line, what is kept, what to do
        assert res.returncode == 2, res.stderr
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("omni-stress: error: out of memory in the run's process ("), lines
        assert f"kept in {run_dir}; an arm may be holding memory it allocated" in lines[0]
        assert lines[0].endswith(f"then --resume {run_dir} completes the run and writes its report")
        res = _cli_in(work, "run", *args, "--resume", str(run_dir))
        assert res.returncode == 0, res.stderr
    assert len(_records(run_dir)) == len(SMALL["prompts"])
    assert (run_dir / "summary.csv").is_file()


E2E_PROMPTS = REPO / "tests" / "data" / "prompts_e2e.yaml"
BAD_PROMPT = "p03-sleep"

# ----------------------------------------------------------------------------- an arm that ignores every interruption

_DEAF_PLUGIN = """\
import signal
import time

from harness.families.qwen2_5_omni.pr import FixedTalker


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
