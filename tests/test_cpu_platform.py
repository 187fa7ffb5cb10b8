"""The CPU platform plugin (cpu_platform/), checked inside the real environment it is installed into."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import REAL_PY, require_real_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def findings() -> dict:
    require_real_env()
    proc = subprocess.run([str(REAL_PY), str(ROOT / "cpu_platform" / "tests" / "check_platform.py")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_guard_lets_cuda_builds_of_torchvision_and_torchaudio_import(findings: dict) -> None:
    assert findings["tv_meta_doc"] == "omni_stress_cpu.guard:"


def test_platform_is_activated_on_cpu(findings: dict) -> None:
    assert findings["register"] == "omni_stress_cpu.platform.CpuOmniPlatform"
    assert findings["platform"] == "CpuOmniPlatform"
    assert findings["ar_worker"] == "omni_stress_cpu.worker.CPUARWorker"
    assert findings["gen_worker"] == "omni_stress_cpu.worker.CPUGenerationWorker"


def test_runner_keeps_vllm_omnis_preprocess_and_cpu_device_methods(findings: dict) -> None:
    assert findings["omni_before_cpu"] is True
    assert findings["load_model_owner"] == "GPUARModelRunner"  # chains to CPUModelRunner.load_model via super()
    assert findings["preprocess_owner"] == "OmniGPUModelRunner"
    assert findings["sync_is_cpu"] is True and findings["gen_sync_is_cpu"] is True
    assert findings["mtp_buffers_owner"] == ["_TalkerMTPBuffersMixin", "_TalkerMTPBuffersMixin"]


def test_seeded_rewind_without_set_offset(findings: dict) -> None:
    assert findings["bookkeeping_sees"] == [1]  # the discarded request's generator is hidden from set_offset
    assert findings["generators_after"] == [0, 1]
    assert findings["discarded_replays_same_draw"] is True
    assert findings["kept_advances"] is True
