"""Commands import heavy libraries only when they use them (issue 23).

Each check runs the CLI entry (``harness.cli:main``) in a fresh interpreter, as the
``omni-stress`` script does, and then reads that interpreter's ``sys.modules``: ``--help``,
``list``, ``report``, ``gate`` and ``compare`` must never import torch, vLLM, faster-whisper,
CTranslate2 or Whisper, and only ``report`` (writing its plots) may import matplotlib.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import harness.commands
from harness.cli import _read_command, main
from tests.conftest import REPO

HEAVY = {"torch", "vllm", "faster_whisper", "ctranslate2", "whisper"}

# The child: ``python -c PROBE OUT_JSON ARGS...`` runs ``omni-stress ARGS`` and writes its exit code
# and the names of every module it imported (each top-level package name too) to OUT_JSON.
PROBE = """
import json, sys
out, args = sys.argv[1], sys.argv[2:]
sys.argv = ["omni-stress", *args]
code = 0
try:
    from harness.cli import main
    main()
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
finally:
    with open(out, "w") as f:
        json.dump({"code": code, "modules": sorted({*sys.modules, *(m.split(".")[0] for m in sys.modules)})}, f)
sys.exit(code)
"""


EAGER_HELP = """
import sys
import click
from harness.cli import main
ctx = click.Context(main)
for name in main.list_commands(ctx):
    assert main.get_command(ctx, name) is not None, name
sys.argv = ["omni-stress", "--help"]
main()
"""


def _probe(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, set[str], str, str]:
    out = tmp_path / f"modules-{len(list(tmp_path.glob('modules-*')))}.json"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "COLUMNS": "80", **(env or {})}, check=False)
    data = json.loads(out.read_text())
    assert data["code"] == proc.returncode, proc.stderr
    return data["code"], set(data["modules"]), proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def two_runs(small_run: Path, tmp_path_factory) -> tuple[Path, Path]:
    """The shared small sim run (main, pr x reference, stress, --asr none) and a copy of it."""
    copy = tmp_path_factory.mktemp("lazy-compare") / "copy"
    shutil.copytree(small_run, copy)
    return small_run, copy


def test_help_lists_every_command_without_importing_any(tmp_path):
    code, modules, out, err = _probe(tmp_path, "--help")
    assert (code, err) == (0, "")
    assert modules & (HEAVY | {"matplotlib", "pandas", "numpy", "yaml"}) == set()
    assert not any(m.startswith("harness.commands.") for m in modules)
    listed = [line.split()[0] for line in out.split("Commands:\n", 1)[1].splitlines() if line.strip()]
    assert listed == sorted(main.listed())
    assert {"compare", "gate", "list", "report", "run", "transcribe"} <= set(listed)


def test_help_is_what_the_imported_commands_would_print(tmp_path):
    """What cli.py reads from the source is current: --help in a fresh process equals --help with
    every command imported first (their own docstrings), byte for byte."""
    _, _, lazy, _ = _probe(tmp_path, "--help")
    eager = subprocess.run([sys.executable, "-c", EAGER_HELP], cwd=REPO, capture_output=True, text=True, timeout=900,
                           env={**os.environ, "COLUMNS": "80"}, check=False)
    assert (eager.returncode, eager.stderr) == (0, "")
    assert eager.stdout == lazy


def test_every_command_module_is_listed_by_its_name_and_help():
    """What cli.py reads from the source is what the imported command says."""
    listed = main.listed()
    modules = {m.name for m in pkgutil.iter_modules(harness.commands.__path__)}
    assert {entry.module for entry in listed.values()} == modules
    for name, entry in listed.items():
        command = importlib.import_module(f"harness.commands.{entry.module}").command
        assert (command.name, inspect.cleandoc(command.help), command.short_help, command.hidden) == \
            (name, inspect.cleandoc(entry.help), entry.short_help, entry.hidden)


def test_a_command_whose_source_is_unclear_is_imported_to_ask(tmp_path):
    unclear = tmp_path / "unclear.py"
    unclear.write_text("import click\n\nNAME = 'x'\n\n@click.command(NAME)\ndef command():\n    \"\"\"Doc.\"\"\"\n")
    assert _read_command(unclear) is None
    plain = tmp_path / "plain.py"
    plain.write_text("import click\n\n@click.command('x-y', short_help='Short.')\ndef command():\n    \"\"\"Doc.\n\n    More.\"\"\"\n")
    name, entry = _read_command(plain)
    assert (name, entry.module, entry.short_help, entry.help.split("\n")[0]) == ("x-y", "plain", "Short.", "Doc.")


@pytest.mark.parametrize("args", [["list"], ["list", "deploys"], ["gate", "--help"], ["report", "--help"],
                                  ["compare", "--help"]])
def test_light_commands_import_nothing_heavy(tmp_path, args):
    code, modules, out, err = _probe(tmp_path, *args)
    assert code == 0, err
    assert out
    assert modules & (HEAVY | {"matplotlib"}) == set()


def test_list_still_resolves_deploys(tmp_path):
    _, _, out, _ = _probe(tmp_path, "list", "deploys")
    assert "sim runs: max_num_seqs=" in out


def test_report_imports_pandas_and_matplotlib_only(two_runs, tmp_path):
    _, run_dir = two_runs
    (run_dir / "plots" / ".render-key.json").unlink()  # plots/*.png must be drawn (harness.report.plotcache)
    code, modules, out, err = _probe(tmp_path, "report", str(run_dir))
    assert code == 0, err
    # it draws plots/*.png, in a forked child (matplotlib is imported there) beside the tables; with one CPU
    # (harness.proc.fork_call does not fork) in this process
    assert "pandas" in modules and (run_dir / "plots" / ".render-key.json").is_file()
    assert ("matplotlib" in modules) == ((os.cpu_count() or 1) < 2)
    assert modules & HEAVY == set()
    (run_dir / "plots" / ".render-key.json").unlink()
    code, modules, out, err = _probe(tmp_path, "report", str(run_dir), env={"OMNI_STRESS_NO_FORK": "1"})
    assert code == 0, err
    assert "pandas" in modules and "matplotlib" in modules  # no fork: drawn in this process
    assert modules & HEAVY == set()
    assert "wrote report.html" in err or "report.html" in err
    code, modules, out, err = _probe(tmp_path, "report", str(run_dir))  # nothing changed: the PNGs are reused
    assert code == 0, err
    assert "pandas" in modules and "matplotlib" not in modules
    assert "report.html" in err


def test_report_without_writing_imports_no_matplotlib(two_runs, tmp_path):
    run_dir, _ = two_runs
    code, modules, out, err = _probe(tmp_path, "report", str(run_dir), "--no-write", "--format", "json")
    assert code == 0, err
    assert json.loads(out)
    assert "pandas" in modules
    assert modules & (HEAVY | {"matplotlib"}) == set()


def test_gate_imports_nothing_heavy(two_runs, tmp_path):
    run_dir, _ = two_runs
    code, modules, out, err = _probe(tmp_path, "gate", str(run_dir))
    # Evaluated (0 pass or 1 a rule failed: the 4-prompt run has too few replays for one rule), never 2.
    assert code in (0, 1), out + err
    assert out.splitlines()[-1].endswith(f"(exit {code})")
    assert modules & (HEAVY | {"matplotlib", "pandas"}) == set()


def test_gate_with_junit_imports_nothing_heavy(two_runs, tmp_path):
    run_dir, _ = two_runs
    junit = tmp_path / "gate.xml"
    code, modules, out, err = _probe(tmp_path, "gate", str(run_dir), "--junit", str(junit))
    assert code in (0, 1), out + err
    assert err == f"wrote JUnit: {junit}\n"
    assert junit.read_text().startswith("<?xml")
    assert modules & (HEAVY | {"matplotlib", "pandas"}) == set()


@pytest.mark.parametrize("fmt", ["terminal", "json"])
def test_compare_imports_nothing_heavy(two_runs, tmp_path, fmt):
    run_a, run_b = two_runs
    code, modules, out, err = _probe(tmp_path, "compare", str(run_a), str(run_b), "--format", fmt)
    assert (code, err) == (0, "")
    assert out
    assert modules & (HEAVY | {"matplotlib"}) == set()


def test_unknown_command_is_one_line_exit_2_and_imports_nothing(tmp_path):
    code, modules, out, err = _probe(tmp_path, "nosuch")
    assert (code, out) == (2, "")
    assert err == "omni-stress: error: No such command 'nosuch'. (see 'omni-stress --help')\n"
    assert not any(m.startswith("harness.commands.") for m in modules)
    assert modules & HEAVY == set()
