"""Bad input from the machine around a command: the interpreter it is told to use, a Ray cluster that does not
answer, cache folders it cannot write (docs/robustness.md). Each through the CLI as a user types it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from clikit import assert_one_line_error
from conftest import run_cli


# ----------------------------------------------------------------------------- tiny-model --python: not an interpreter


@pytest.mark.parametrize("kind", ["not-executable", "no-shebang"])
def test_tiny_model_python_that_is_not_an_interpreter(tmp_path: Path, kind: str) -> None:
    """Issue 33, case 6: a 33-line traceback (Exec format error, PermissionError) before."""
    fake = tmp_path / "python"
    fake.write_text("just text, not a program\n")
    if kind == "no-shebang":
        os.chmod(fake, 0o755)
    res = run_cli("tiny-model", str(tmp_path / "model"), "--python", str(fake))
    reason = "Permission denied" if kind == "not-executable" else "Exec format error"
    assert_one_line_error(res, f"tiny-model: --python {fake}: cannot run it ({reason})")
    assert not (tmp_path / "model").exists()
