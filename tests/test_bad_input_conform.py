"""Bad input to ``omni-stress conform``: a plugin arm that hangs or raises KeyboardInterrupt, a ``--source``
that is not a release (docs/robustness.md). Each through the CLI as a user types it."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
from clikit import assert_one_line_error
from conftest import run_cli

CF = ["conform", "--deploy", "none", "--requests", "1", "--generated", "16"]

_PLUGIN = """\
from harness.families.qwen2_5_omni.pr import FixedTalker


class Loops(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        while True:
            pass


class Interrupts(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        raise KeyboardInterrupt
"""


def _plugin_env(tmp: Path) -> dict[str, str]:
    (tmp / "conform_misbehaving_arm.py").write_text(_PLUGIN)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.mark.parametrize("attr, error", [
    ("Loops", "ArmTimeout: talker_preprocess did not return within 1 s (the per-call limit, --arm-timeout)"),
    ("Interrupts", "KeyboardInterrupt: talker_preprocess raised KeyboardInterrupt (not a Ctrl-C)"),
])
def test_conform_plugin_arm_that_hangs_or_interrupts_is_a_raised_cell(tmp_path: Path, attr: str, error: str) -> None:
    """Issue 33, cases 2 and 3: a forever loop never ended (conform had no per-call limit); a KeyboardInterrupt
    the arm raised itself printed ``Aborted!``, exit 1, and no matrix."""
    model = f"qwen2.5-omni:conform_misbehaving_arm:{attr}"
    js = tmp_path / "m.json"
    res = run_cli(*CF, "--source", "vllm-omni:0.30.0", "--model", model, "--arm-timeout", "1", "--json", str(js),
                  env=_plugin_env(tmp_path))
    assert res.exit_code == 1, res.stderr
    assert "Aborted" not in res.stderr and "Traceback" not in res.stderr
    row = next(ln for ln in res.stdout.splitlines() if ln.startswith(model))
    assert row.split()[1:4] == ["raised"] * 3, row
    assert error in res.stdout
    data = json.loads(js.read_text())
    cells = data["matrices"][0]["models"][0]["cells"] if "matrices" in data else data["models"][0]["cells"]
    assert {c["status"] for c in cells.values()} == {"raised"}


def _zip(path: Path, member: str) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, "")
    return path


@pytest.mark.parametrize("make, reason", [
    (lambda t: t / "notes.txt", "notes.txt is not a Python file (.py), so it is not a vLLM-Omni release"),
    (lambda t: t / "random-1.0-py3-none-any.whl", "random-1.0-py3-none-any.whl is not a wheel (File is not a zip file)"),
    (lambda t: _zip(t / "other-1.0-py3-none-any.whl", "other/__init__.py"),
     "holds no vllm_omni package, so it is not a vLLM-Omni release"),
    (lambda t: t / "broken.py", "broken.py is not Python source (SyntaxError"),
], ids=["text-file", "not-a-zip", "other-package-wheel", "not-python"])
def test_conform_source_that_is_not_a_release_is_refused_first(tmp_path: Path, make, reason: str) -> None:
    """Issue 33, case 9: refused only after the calibration had run (its progress lines, then the line)."""
    path = make(tmp_path)
    if not path.exists():
        path.write_text("hello, not a release\n" if path.suffix != ".py" else "def broken(:\n")
    res = run_cli(*CF, "--source", f"vllm-omni:{path}")
    assert_one_line_error(res, f"--source vllm-omni:{path}: ", reason,
                          "give a vLLM-Omni checkout or site-packages folder, a vllm_omni wheel")
    assert res.stdout == ""
