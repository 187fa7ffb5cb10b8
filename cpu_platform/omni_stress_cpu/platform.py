"""``CpuOmniPlatform``: vLLM's ``CpuPlatform`` plus the vLLM-Omni interfaces a stage needs.

Mirrors how vLLM-Omni 0.30.0 builds its XPU platform (``vllm_omni/platforms/xpu/platform.py``:
``OmniPlatform`` over vLLM's device platform, workers that add ``OmniWorkerMixin``).
"""

from __future__ import annotations

import torch
from vllm.platforms.cpu import CpuPlatform

from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "omni_stress_cpu.worker.CPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return "omni_stress_cpu.worker.CPUGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"  # the pipelines' own deploy YAMLs, as on CUDA

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False  # the CPU deploy runs eager

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        import psutil

        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @classmethod
    def set_device_control_env_var(cls, devices: str | int | None) -> None:
        """Ignored: the deploy YAML's per-stage ``devices`` ("0", "1") are GPU ids; on CPU vLLM reads
        the same variable as NUMA memory nodes, and a one-node host has no node 1 (the Talker's
        worker would find no memory node). Every stage shares the host."""
        return None

    @classmethod
    def unset_device_control_env_var(cls) -> None:
        return None

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend: str | None, head_size: int,
                                       allow_trtllm_default: bool = False) -> str:
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()
