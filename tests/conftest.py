"""Shared test helpers: the repository root, the small prompt set, and the CLI run as a user runs it."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
REAL_PY = REPO / ".venv-omni" / "bin" / "python"  # the real backend's CPU environment (scripts/install-real-cpu.sh)


def require_real_env(python: Path = REAL_PY) -> Path:
    """A real environment's interpreter (default: 0.30.0's ``.venv-omni``); a test without it is skipped, except
    under ``OMNI_STRESS_REQUIRE_REAL=1`` (``.ci/run`` sets it), where its absence fails."""
    if not python.exists():
        if os.environ.get("OMNI_STRESS_REQUIRE_REAL") == "1":
            pytest.fail(f"OMNI_STRESS_REQUIRE_REAL=1 but {python} is missing (scripts/install-real-cpu.sh)")
        pytest.skip(f"no real CPU environment ({python.parent.parent.name}): run scripts/install-real-cpu.sh")
    return python
FIXTURES = REPO / "tests" / "fixtures"
SMALL_PROMPTS = FIXTURES / "prompts_small.yaml"

# Plugin arms of the tests are named ``tests.fixtures.plugins:ATTR``; the repository root must be
# importable for that, in this process and in the CLI subprocesses (which run from REPO).
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ---------------------------------------------------------------------------- parallel runs (pytest-xdist)
# The README's test command runs ``pytest -n 2 --dist loadscope --no-loadscope-reorder``: each module goes whole
# to one worker, so a module fixture (a real server run, a Ray cluster) is made once; the real-server runs are
# modules of their own (test_real_cpu_*.py) so the two workers can share them. Modules run longest first, so
# that no worker waits alone on a long one at the end; the order is fixed, so every worker collects the same
# list. (Not ``--dist loadgroup``: pytest-xdist 3.8 marks a group in ``item._nodeid``, which pytest 9 no
# longer reads, so every test became a group of its own.)
# Measured on 2 cores (issue 48): four, four, three, two and one server starts; Ray's executor tests 4 minutes.
LONGEST_FIRST = ("test_real_cpu_e2e", "test_real_cpu_tts_e2e", "test_real_cpu_omni3_e2e", "test_ray_executor", "test_real_cpu_broken",
                 "test_real_cpu_release", "test_bad_input_run", "test_asr_ray", "test_real_cpu_sweep", "test_qwen3_tts")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).stem, len(rank)))  # stable: collection order otherwise


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


# ---------------------------------------------------------------------------- the real CPU server modules


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The speaking tiny Qwen2.5-Omni checkpoint (``omni-stress tiny-model``), built once for the whole test
    session and shared by every module that asks, whichever xdist worker runs it (a lock in the session's
    common temporary folder: the first module builds, the others wait for it and read the same files)."""
    require_real_env()
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp is a folder of the session's
        root = root.parent
    home = root / "shared-tiny-qwen2.5-omni"
    model = home / "tiny"
    with open(root / "shared-tiny-qwen2.5-omni.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (a failed build too)
        if not (home / "built").exists():
            shutil.rmtree(home, ignore_errors=True)  # a build that failed half-way
            home.mkdir()
            t0 = time.monotonic()
            built = subprocess.run([sys.executable, "-m", "harness.cli", "tiny-model", str(model), "--python",
                                    str(REAL_PY)], cwd=home, capture_output=True, text=True, timeout=900)
            assert built.returncode == 0, built.stderr[-2000:]
            summary = json.loads(built.stdout.strip().splitlines()[-1])
            assert summary["vocab_size"] == 152064 and summary["hidden_size"] == 64 and summary["speaking"] is True
            (home / "built").write_text(json.dumps(summary))
            sys.stderr.write(f"[real e2e] tiny model: {time.monotonic() - t0:.1f} s\n")
    return model


def build_tiny(tmp: Path, family: str, label: str, variant: str | None = None) -> Path:
    """``omni-stress tiny-model`` for ``family`` (``variant``: its ``--variant``) in the real environment, under
    ``tmp``; the time on stderr."""
    model = tmp / f"tiny-{family}{f'-{variant}' if variant else ''}"
    t0 = time.monotonic()
    built = subprocess.run([sys.executable, "-m", "harness.cli", "tiny-model", str(model), "--family", family,
                            "--python", str(REAL_PY), *(["--variant", variant] if variant else [])],
                           cwd=tmp, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-2000:]
    sys.stderr.write(f"[{label}] tiny model: {time.monotonic() - t0:.1f} s\n")
    return model


def run_real(tmp: Path, model: Path, family: str, run_id: str, *args: str, label: str, cwd: Path | None = None,
             timeout: float = 2700) -> Path:
    """``omni-stress run --backend vllm-omni --stream --asr none`` of ``model`` on CPU, the run in ``tmp/run_id``
    (``args``: arms, deploys, prompts); the time and the run's table on stderr."""
    t0 = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "--backend", "vllm-omni", "--platform", "cpu", "--serve-python",
         str(REAL_PY), "--model", str(model), "--family", family, *args, "--stream", "--asr", "none", "--out",
         str(tmp), "--run-id", run_id, "--quiet", "--health-timeout", "900", "--request-timeout", "900"],
        cwd=cwd or tmp, capture_output=True, text=True, timeout=timeout)
    sys.stderr.write(f"[{label}] run {run_id}: {time.monotonic() - t0:.1f} s\n{run.stdout}\n")
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    return tmp / run_id


def records_by_cell(run_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """A run's request records by (arm, deploy), then by prompt id."""
    from harness.records import read_requests

    cells: dict[tuple[str, str], dict[str, Any]] = defaultdict(dict)
    for r in read_requests(run_dir):
        cells[(r.arm, r.deploy)][r.prompt_id] = r
    return cells


def spans_by_cell(run_dir: Path) -> dict[tuple[str, str], list]:
    """A run's spans by (arm, deploy)."""
    from harness.spanstore import read_spans

    cells: dict[tuple[str, str], list] = defaultdict(list)
    for s in read_spans(run_dir):
        cells[(s.arm, s.deploy)].append(s)
    return cells
