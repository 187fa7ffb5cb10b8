"""Shared test helpers: the repository root, the small prompt set, and the CLI run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REAL_PY = REPO / ".venv-omni" / "bin" / "python"  # the real backend's CPU environment (scripts/install-real-cpu.sh)


def require_real_env() -> Path:
    """The real environment's interpreter; a test without it is skipped, except under
    ``OMNI_STRESS_REQUIRE_REAL=1`` (``.ci/run`` sets it), where its absence fails."""
    if not REAL_PY.exists():
        if os.environ.get("OMNI_STRESS_REQUIRE_REAL") == "1":
            pytest.fail(f"OMNI_STRESS_REQUIRE_REAL=1 but {REAL_PY} is missing (scripts/install-real-cpu.sh)")
        pytest.skip("no real CPU environment (.venv-omni): run scripts/install-real-cpu.sh")
    return REAL_PY
FIXTURES = REPO / "tests" / "fixtures"
SMALL_PROMPTS = FIXTURES / "prompts_small.yaml"

# Plugin arms of the tests are named ``tests.fixtures.plugins:ATTR``; the repository root must be
# importable for that, in this process and in the CLI subprocesses (which run from REPO).
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ---------------------------------------------------------------------------- parallel runs (pytest-xdist)
# The README's test command runs ``pytest -n 2 --dist loadgroup``: whole groups go to one worker, so a module
# fixture (a real server run, a Ray cluster) is made once. A module is one group, except that a test using one of
# the real-server run fixtures below joins that fixture's own group (each is minutes of server starts, and
# splitting them lets the two workers share the load). Groups run longest first, so that no worker waits
# alone on a long group at the end; the order is fixed, so every worker collects the same list.
RUN_FIXTURES = ("real_run", "real_sweep", "broken_run")
SAME_GROUP = {"test_ray_executor": "ray", "test_asr_ray": "ray"}  # one Ray cluster at a time
LONGEST_FIRST = ("test_real_cpu_e2e::real_run", "test_real_cpu_tts_e2e::real_run", "test_real_cpu_e2e::broken_run",
                 "test_real_cpu_e2e::real_sweep", "test_real_cpu_e2e")


def xdist_group_of(module: str, fixturenames: list[str]) -> str:
    """The group a test runs in: its module's, or its real-server run fixture's."""
    for name in RUN_FIXTURES:
        if name in fixturenames:
            return f"{module}::{name}"
    return SAME_GROUP.get(module, module)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the mark into the test's id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {}
    for item in items:
        group = xdist_group_of(Path(item.path).stem, list(getattr(item, "fixturenames", ())))
        item.add_marker(pytest.mark.xdist_group(group))
        groups[item.nodeid] = group
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(groups[item.nodeid], len(rank)))  # stable: collection order otherwise


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


def run_cli(*args: str, timeout: float = 900.0, env: dict[str, str] | None = None) -> CliResult:
    """``omni-stress ARGS`` in a subprocess (``python -m harness.cli``), from the repository root."""
    proc = subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, check=False)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def invoke_cli(*args: str) -> CliResult:
    """``omni-stress ARGS`` in this process (click's CliRunner): the same code path, no interpreter start-up."""
    from click.testing import CliRunner

    from harness.cli import main

    result = CliRunner().invoke(main, list(args), catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback the user would see: let the test show it
    return CliResult(result.exit_code, result.stdout, result.stderr)


@pytest.fixture
def cli():
    return invoke_cli


@pytest.fixture(scope="session")
def small_run(tmp_path_factory) -> Path:
    """One uninterrupted sim run of the small prompt set (main, pr x reference, stress), shared."""
    out = tmp_path_factory.mktemp("small-run")
    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(out),
                     "--run-id", "full")
    assert res.exit_code == 0, res.stderr
    return out / "full"


@pytest.fixture(scope="module")
def one_run(tmp_path_factory) -> Path:
    """A finished sim run of one cell (main x reference, one prompt), copied by the tests that spoil it."""
    from clikit import _one_prompt

    tmp = tmp_path_factory.mktemp("one-run")
    res = invoke_cli("run", "--asr", "none", "--quiet", "--arm", "main", "--deploy", "reference", "--sim-workers", "0",
                     "--prompts", _one_prompt(tmp), "--out", str(tmp / "out"), "--run-id", "one")
    assert res.exit_code == 0, res.stderr
    return tmp / "out" / "one"
