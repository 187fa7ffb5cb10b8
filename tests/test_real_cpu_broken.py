"""Arms the gate must fail, bound into a real ``vllm serve --omni`` on CPU (issue 32): two server starts.
Its own module so that, under pytest-xdist, it may run beside the main real run (tests/test_real_cpu_e2e.py);
skipped without ``.venv-omni`` except under ``OMNI_STRESS_REQUIRE_REAL=1``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.families.qwen2_5_omni import speaking
from harness.config import load_prompts
from harness.records import read_requests

from conftest import REAL_PY, spans_by_cell

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "harness.cli"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


# ---------------------------------------------------------------------------- arms the gate must fail (issue 32)

# name -> (module:attr, the region whose rows it breaks). ShiftedPromptPr (overrides _thinker_to_talker_prefill) is
# caught the same way as SpeakerSwapPr, the worker's expected rows built from the release's helpers captured before
# the arm is bound: it is checked on the sim's model host (tests/test_worker_contract_release.py), not with a third
# server start here (CI time, issue 45's budget)
BROKEN_ARMS = {
    "swap": ("tests.fixtures.helper_override_arm:SpeakerSwapPr", "text"),  # overrides _get_embed_text_spk_token
    "droppad": ("tests.fixtures.helper_override_arm:DropPadPr", "end"),  # drops the persistent text-PAD rows
}


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """Arms of pr with one contract helper overridden, bound into the real server on cpu-reference."""
    out = tmp_path_factory.mktemp("broken")
    arms = [a for name, (spec, _) in BROKEN_ARMS.items() for a in ("--arm", f"{name}={spec}")]
    t0 = time.monotonic()
    run = subprocess.run(
        [*CLI, "run", "--backend", "vllm-omni", "--platform", "cpu", "--serve-python", str(REAL_PY),
         "--model", str(tiny_model), *arms, "--deploy", "cpu-reference", "--prompts", "cpu_smoke", "--asr", "none",
         "--out", str(out), "--run-id", "broken", "--quiet", "--health-timeout", "900", "--request-timeout", "900"],
        cwd=ROOT, capture_output=True, text=True, timeout=2700)  # cwd: the arms' module is importable from here
    sys.stderr.write(f"[real e2e] broken arms: {time.monotonic() - t0:.1f} s\n{run.stdout}\n")
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    return out / "broken"


def test_the_gate_fails_broken_arms_on_the_real_server(broken_run: Path) -> None:
    """Issue 32 items 1 and 3: the worker builds its expected rows from the release's helpers, captured
    before the arm is bound, so an arm overriding a helper is caught though what it says is right (the
    rows it moves are ones the speaking Talker does not read: docs/speaking-model.md); and the end region
    is scheduled, so an arm that drops the persistent PAD rows is counted there (one position per
    request) and heard (one SILENCE fewer)."""
    spans = spans_by_cell(broken_run)
    replies = {p.id: p.reply for p in load_prompts("cpu_smoke").prompts}
    for name, (_, region) in BROKEN_ARMS.items():
        cell = spans[(name, "cpu-reference")]
        assert cell and all(s.error is None and s.misaligned_text is not None for s in cell), name
        text, end = sum(s.misaligned_text for s in cell), sum(s.misaligned_end for s in cell)
        sys.stderr.write(f"[real e2e] {name}: misaligned text {text}, end {end}\n")
        assert (text > 0, end) == (True, 0) if region == "text" else (text, end) == (0, 4), (name, text, end)
    for r in read_requests(broken_run):
        assert r.error is None and r.oracle_wer == 0.0, (r.arm, r.prompt_id, r.error, r.oracle_transcript)
        said = speaking.encode_reply(replies[r.prompt_id], end=False)
        assert r.codec_tokens == (said + [speaking.SILENCE] if r.arm == "droppad" else said + [speaking.SILENCE] * 2)
    import yaml

    shipped = yaml.safe_load((ROOT / "deploy_configs" / "gates.yaml").read_text())
    # the shipped rules as they are, less those about deploys this run has not (stress, specdec): a run of
    # cpu-reference alone is gated, not refused; the candidates' contract rule applies to every deploy
    shipped["rules"] = [r for r in shipped["rules"] if r.get("deploy") in ("*", "*reference")]
    rules = broken_run.parent / "gates-reference.yaml"
    rules.write_text(yaml.safe_dump(shipped, sort_keys=False))
    gate = subprocess.run([*CLI, "gate", str(broken_run), "--rules", str(rules)], cwd=broken_run,
                          capture_output=True, text=True, timeout=600)
    sys.stderr.write(f"[real e2e] gate (broken arms):\n{gate.stdout}\n")
    assert gate.returncode == 1, (gate.stdout[-3000:], gate.stderr[-2000:])
    for name in BROKEN_ARMS:
        assert f"FAIL   candidate-contract: {name}/cpu-reference run 1 [candidate]" in gate.stdout, name
        assert f"PASS   candidate-reference-speaks: {name}/cpu-reference run 1 [candidate]" in gate.stdout, name
