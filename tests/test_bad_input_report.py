"""Bad input to the commands that read finished runs: ``report``, ``compare``, ``gate``, ``fidelity``
(docs/robustness.md). Each through the CLI as a user types it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from clikit import assert_one_line_error
from conftest import invoke_cli


def _as_real(run: Path, where: Path) -> Path:
    """A copy of a sim run that says it came from the real backend (what fidelity's second run is)."""
    real = where / "real"
    shutil.copytree(run, real)
    for name in ("manifest.json", "requests.jsonl"):
        path = real / name
        path.write_text(path.read_text().replace('"backend": "sim"', '"backend": "vllm-omni"'))
    return real


# ----------------------------------------------------------------------------- fidelity of two runs of one backend


def test_fidelity_of_one_backend_twice_is_refused(small_run: Path, tmp_path: Path) -> None:
    """Issue 33, case 4: ``fidelity RUN RUN`` exited 0 with ratios of 1.00, as if the sim were exact."""
    assert_one_line_error(invoke_cli("fidelity", str(small_run), str(small_run)),
                          f"fidelity {small_run} {small_run}: the same run twice (backend sim); fidelity measures a "
                          "sim run against a real run (--backend vllm-omni) of the same work: give one of each, "
                          "or --same-backend for a self-check")
    other = tmp_path / "other"
    shutil.copytree(small_run, other)
    assert_one_line_error(invoke_cli("fidelity", str(small_run), str(other)), ": both sim runs (backend sim)")
    real = _as_real(small_run, tmp_path)
    assert_one_line_error(invoke_cli("fidelity", str(real), str(real)), ": the same run twice (backend vllm-omni)")
    assert_one_line_error(invoke_cli("fidelity", str(real), str(small_run)),
                          "the first run is the real one (backend vllm-omni) and the second the sim run: give the "
                          "sim run first")
    ok = invoke_cli("fidelity", str(small_run), str(real))  # one of each: measured, no label, no warning
    assert ok.exit_code == 0 and ok.stderr == "", ok.stderr
    assert ok.stdout.startswith("sim:  ")
    js = tmp_path / "f.json"
    labelled = invoke_cli("fidelity", str(small_run), str(other), "--same-backend", "--json", str(js))
    assert labelled.exit_code == 0, labelled.stderr
    assert labelled.stdout.startswith("self-check, not a fidelity measurement: both sim runs (backend sim, "
                                      "--same-backend)\n")
    assert json.loads(js.read_text())["self_check"].startswith("self-check, not a fidelity measurement")


# ----------------------------------------------------------------------------- fidelity of an incomplete run


def _killed(run: Path, where: Path, keep: int) -> Path:
    """``run`` as a kill leaves it: ``keep`` records, the manifest not finished."""
    dst = where / f"killed{keep}"
    shutil.copytree(run, dst)
    lines = (dst / "requests.jsonl").read_text().splitlines(keepends=True)
    (dst / "requests.jsonl").write_text("".join(lines[:keep]))
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["finished"] = None
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _torn(run: Path, where: Path) -> Path:
    dst = where / "torn"
    shutil.copytree(run, dst)
    raw = (dst / "requests.jsonl").read_bytes()
    last = raw.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    (dst / "requests.jsonl").write_bytes(raw[:len(raw) - len(last) - 1] + last[:40])  # the last line cut off
    return dst


@pytest.mark.parametrize("kind", ["killed", "torn"])
def test_fidelity_warns_on_an_incomplete_run_as_report_and_compare_do(small_run: Path, tmp_path: Path,
                                                                      kind: str) -> None:
    """Issue 33, case 5: ``fidelity`` of a killed run (9 of 15 records) or one with a torn last line exited 0 with
    nothing on stderr, where ``report`` and ``compare`` warn."""
    bad = _killed(small_run, tmp_path, keep=5) if kind == "killed" else _torn(small_run, tmp_path)
    real = _as_real(small_run, tmp_path)
    compared = invoke_cli("compare", str(small_run), str(bad))
    warning = [ln for ln in compared.stderr.splitlines() if ln.startswith("omni-stress: warning: ")]
    assert len(warning) == 1 and f"{bad}: incomplete run" in warning[0]
    res = invoke_cli("fidelity", str(bad), str(real))
    assert res.exit_code == 0, res.stderr
    assert res.stderr.splitlines() == warning  # the same check, the same line
    why = "the run did not finish" if kind == "killed" else "requests.jsonl: the last line is cut off"
    assert why in warning[0]
    strict = invoke_cli("fidelity", str(small_run), str(bad.parent / "real"), "--strict")
    assert strict.exit_code == 0, strict.stderr  # both complete
    assert_one_line_error(invoke_cli("fidelity", str(bad), str(real), "--strict"),
                          f"{bad}: incomplete run (", why, "; not compared (--strict)")
