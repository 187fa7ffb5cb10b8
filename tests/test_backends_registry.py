"""Backends as a registry (issue 29): each entry carries its hooks (make, prepare, dry run, preflight,
the Ray resources, timeout and payload of a cell) and flags; nothing outside the entries tests a
backend's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO, invoke_cli
from harness.backends import BACKENDS, get_backend, is_simulated
from harness.errors import UserError


def test_registry_names_and_flags():
    assert list(BACKENDS) == ["sim", "vllm-omni"]
    sim, real = get_backend("sim"), get_backend("vllm-omni")
    assert (sim.name, sim.simulated, sim.hashes_arm_code) == ("sim", True, True)
    assert (real.name, real.simulated, real.hashes_arm_code) == ("vllm-omni", False, False)
    assert [is_simulated(n) for n in ("sim", "vllm-omni", "gpu-cluster", None)] == [True, False, False, False]


def test_unknown_backend_is_one_line():
    with pytest.raises(UserError) as exc:
        get_backend("tpu")
    assert str(exc.value) == "--backend 'tpu': unknown backend (choose sim or vllm-omni)"


def test_ray_hooks_per_backend():
    from types import SimpleNamespace

    cpu = SimpleNamespace(serve=SimpleNamespace(platform="cpu", health_timeout_s=10.0, request_timeout_s=2.0))
    gpu = SimpleNamespace(serve=SimpleNamespace(platform="gpu"))
    job = SimpleNamespace(prompts=SimpleNamespace(prompts=[1, 2, 3]))
    assert get_backend("sim").ray_resources(cpu) == {"num_cpus": 1}
    assert get_backend("vllm-omni").ray_resources(cpu) == {"num_cpus": 1}
    assert get_backend("vllm-omni").ray_resources(gpu) == {"num_cpus": 1, "num_gpus": 2}
    assert get_backend("sim").ray_cell_timeout(job, cpu) == 3600.0
    assert get_backend("vllm-omni").ray_cell_timeout(job, cpu) == 10.0 + 2.0 * 3 + 600.0


def test_the_cli_offers_the_registry():
    res = invoke_cli("run", "--backend", "tpu")
    assert res.exit_code == 2
    assert "'tpu' is not one of 'sim', 'vllm-omni'" in res.stderr


# A comparison of a backend's or an executor's name: `x == "sim"`, `!= "vllm-omni"`, `"ray" ==` ...
_NAME_TEST = re.compile(r"""(==|!=)\s*["'](sim|vllm-omni|local|ray)["']|["'](sim|vllm-omni|local|ray)["']\s*(==|!=)""")


def test_executor_registry():
    from harness.executors import EXECUTORS, get_executor

    assert EXECUTORS == ("local", "ray")
    with pytest.raises(UserError) as exc:
        get_executor("k8s")
    assert str(exc.value) == "--executor 'k8s': unknown executor (choose local or ray)"
    with pytest.raises(UserError) as exc:
        get_executor("local").preflight("127.0.0.1:1")
    assert str(exc.value) == "--ray-address 127.0.0.1:1: applies to --executor ray"
    get_executor("local").preflight(None)
    get_executor("ray").preflight("127.0.0.1:1", dry_run=True)  # --dry-run: no cluster asked


def test_no_string_test_of_a_backend_or_executor_name_outside_the_registries():
    allowed = {Path("harness/backends.py"), Path("harness/sim/entry.py"), Path("harness/serve/entry.py"),
               Path("harness/executors/__init__.py"), Path("harness/executors/local.py"),
               Path("harness/executors/ray.py")}
    found = []
    for path in sorted((REPO / "harness").rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel in allowed or "vendor" in rel.parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if _NAME_TEST.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert found == []
