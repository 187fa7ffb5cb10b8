"""``omni-stress sweep`` on a real ``vllm serve --omni`` on CPU with the speaking tiny Qwen2.5-Omni (issue 20):
two server starts. Its own module so that, under pytest-xdist, it may run beside the main real run
(tests/test_real_cpu_e2e.py); skipped without ``.venv-omni`` except under ``OMNI_STRESS_REQUIRE_REAL=1``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.records import read_requests
from harness.spanstore import read_spans

from conftest import REAL_PY

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "harness.cli"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]
SUBCLASS_ARM = "superpr=tests.fixtures.subclass_arm:SuperPr"


# ---------------------------------------------------------------------------- a real sweep (issue 20)


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> tuple[Path, str]:
    """``omni-stress sweep`` on the real server: cpu-stress with two requests in flight beside cpu-reference,
    the four cpu_smoke prompts: two server starts. The shipped ``cpu`` sweep's other point (load all) is the
    main run's pr/cpu-stress cell, so the test sweeps only ``c2`` (a YAML path: the ``cpu`` sweep's file less
    that point). The arm is ``SuperPr`` (tests/fixtures/subclass_arm.py), an ordinary subclass of pr that
    calls ``super()``: the same rows as pr, and the sweep's two servers are also the bound subclass's test
    (issue 24 case 21), which had a server start of its own before."""
    out = tmp_path_factory.mktemp("sweep")
    import yaml

    sweep_yaml = yaml.safe_load((ROOT / "deploy_configs" / "sweeps" / "cpu.yaml").read_text())
    sweep_yaml.update(name="cpu-c2", description="cpu-stress with two in flight", axes={"load": ["c2"]})
    (out / "cpu-c2.yaml").write_text(yaml.safe_dump(sweep_yaml, sort_keys=False))
    t0 = time.monotonic()
    run = subprocess.run(
        [*CLI, "sweep", str(out / "cpu-c2.yaml"), "--backend", "vllm-omni", "--platform", "cpu", "--serve-python", str(REAL_PY),
         "--model", str(tiny_model), "--arm", SUBCLASS_ARM, "--prompts", "cpu_smoke", "--out", str(out), "--run-id", "sweep",
         "--quiet", "--no-plots", "--health-timeout", "900", "--request-timeout", "900"],
        cwd=ROOT, capture_output=True, text=True, timeout=2700)  # cwd: the arm's module is importable from here
    sys.stderr.write(f"[real e2e] sweep: {time.monotonic() - t0:.1f} s\n{run.stdout}\n")
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    return out / "sweep", run.stdout


def test_a_real_sweep_prints_latency_and_duration_per_cell(real_sweep: tuple[Path, str]) -> None:
    """The map of a real-backend sweep: end-to-end latency, time to the first codec token (the API is
    not streamed: said in the note), real-time factor, the audio's seconds and truncation/overrun
    against the reference cell, per point. Structure and counts only: timings vary with the host."""
    run_dir, stdout = real_sweep
    lines = stdout.splitlines()
    head = next(line for line in lines if line.startswith("Arm "))
    for column in ("load", "E2E p50/p90/p99 (s)", "TTFA p50/p90/p99 (s)", "RTF p50/p90/p99", "Audio s (med)",
                   "Dur. ratio (med)", "Truncated", "Overrun", "Stressed", "Map gate"):
        assert column in head, (column, head)
    assert any(line.startswith("latency (real backend") and "TTFA is not streamed" in line for line in lines)
    rows = [line.split() for line in lines[lines.index(head) + 2:] if line.startswith("superpr ")]
    assert [r[1] for r in rows] == ["cpu-reference", "@load=c2"], rows

    sweep = json.loads((run_dir / "sweep.json").read_text())
    by_deploy = {r["deploy"]: r for r in sweep["rows"]}
    assert sorted(by_deploy) == ["cpu-reference", "cpu-stress@load=c2"]
    for deploy, row in by_deploy.items():
        lat = row["latency"]
        assert row["requests"] == 4 and row["errors"] == 0 and lat["unit"] == "s" and lat["measured"] == 4, deploy
        for metric in ("e2e", "ttfa", "rtf"):
            assert all(lat[metric][q] is not None and lat[metric][q] > 0 for q in ("50", "90", "99")), (deploy, metric)
        assert row["audio_seconds_median"] > 0, deploy
        if deploy != "cpu-reference":
            dur = row["duration"]
            assert dur["compared"] == 4 and 0 <= dur["truncated"] + dur["overrun"] <= 4, (deploy, dur)
            assert row["cells"] == 1 and row["stressed_cells"] in (0, 1), deploy

    records = read_requests(run_dir)
    assert len(records) == 8
    for r in records:
        assert r.error is None and r.backend == "vllm-omni", (r.deploy, r.prompt_id, r.error)
        assert r.ttfa_s is not None and 0 < r.ttfa_s <= r.wall_s, (r.deploy, r.prompt_id, r.ttfa_s, r.wall_s)
        assert abs(r.rtf - r.wall_s / r.audio_seconds) < 0.01, (r.deploy, r.prompt_id)  # wall_s is rounded to ms
        assert r.schedule is not None and r.num_codec_tokens > 0


def test_a_bound_subclass_arm_keeps_its_class_in_the_real_server(real_sweep: tuple[Path, str]) -> None:
    """Issue 24 case 21: an ordinary subclass of ``pr`` that calls ``super()`` (and reads a class attribute
    through a property) bound into the real Talker worker: the engine stays up, every request is answered,
    it delivers the contract's rows in both deploys (chunked prefill in the stress one) and says each reply."""
    run_dir, _ = real_sweep
    records = read_requests(run_dir)
    assert sorted(r.prompt_id for r in records if r.deploy == "cpu-reference") == [
        "c01-tea", "c02-plants", "c03-run", "c04-stars"]
    assert all(r.error is None and r.oracle_wer == 0.0 for r in records), [(r.prompt_id, r.error) for r in records]
    spans = read_spans(run_dir)
    assert spans and all(s.error is None and s.misaligned_text == 0 and s.misaligned_end == 0 for s in spans)
    assert any(s.nonzero_offset for s in spans if s.deploy != "cpu-reference")  # the stress point chunked
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for cell in manifest["cells"]:
        workers = cell["implementation"]["workers"]
        assert workers and all(w["arm"] == "tests.fixtures.subclass_arm:SuperPr" and "error" not in w
                               for w in workers), cell["deploy"]
