"""Checks of the CPU platform plugin, run inside the real environment (.venv-omni) by
tests/test_cpu_platform.py; prints one JSON object of findings."""

from __future__ import annotations

import json
import types

import numpy as np
import torch

out: dict = {}

import torchaudio  # noqa: E402,F401 - both through the guard
import torchvision  # noqa: E402

out["tv_meta_doc"] = (torchvision._meta_registrations.__doc__ or "")[:22]

import omni_stress_cpu  # noqa: E402

out["register"] = omni_stress_cpu.register()

from vllm_omni.platforms import current_omni_platform  # noqa: E402

out["platform"] = type(current_omni_platform).__name__
out["ar_worker"] = current_omni_platform.get_omni_ar_worker_cls()
out["gen_worker"] = current_omni_platform.get_omni_generation_worker_cls()

from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402

from omni_stress_cpu.worker import CPUARModelRunner, CPUGenerationModelRunner, _SeededRewindMixin  # noqa: E402
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner  # noqa: E402
from vllm_omni.worker.gpu_model_runner import OmniGPUModelRunner  # noqa: E402

out["load_model_owner"] = next(k.__name__ for k in CPUARModelRunner.__mro__ if "load_model" in vars(k))
out["sync_is_cpu"] = CPUARModelRunner._sync_device is CPUModelRunner.__dict__["_sync_device"]
out["gen_sync_is_cpu"] = CPUGenerationModelRunner._sync_device is CPUModelRunner.__dict__["_sync_device"]
# both runners size the talker-MTP buffers without a CUDA-graph capture size (Qwen3-Omni's Code2Wav stage too)
out["mtp_buffers_owner"] = [next(k.__name__ for k in cls.__mro__ if "_init_talker_mtp" in vars(k))
                            for cls in (CPUARModelRunner, CPUGenerationModelRunner)]
mro = [k.__name__ for k in CPUARModelRunner.__mro__]
out["omni_before_cpu"] = mro.index("GPUARModelRunner") < mro.index("CPUModelRunner") < mro.index("GPUModelRunner")
out["preprocess_owner"] = next(k.__name__ for k in CPUARModelRunner.__mro__ if "_preprocess" in vars(k))
assert issubclass(CPUARModelRunner, GPUARModelRunner) and issubclass(CPUARModelRunner, OmniGPUModelRunner)


class _Base:
    """Stands for GPUModelRunner: samples from each generator, then rewinds discarded ones by offset."""

    def _sample(self):
        return {i: torch.rand(4, generator=g).tolist() for i, g in self.input_batch.generators.items()}

    def _bookkeeping_sync(self):
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)  # what a CPU generator refuses
        return sorted(self.input_batch.generators)


class _Runner(_SeededRewindMixin, _Base):
    pass


r = _Runner()
gens = {0: torch.Generator().manual_seed(1), 1: torch.Generator().manual_seed(2)}
r.input_batch = types.SimpleNamespace(num_reqs=2, generators=gens)
r.discard_request_mask = types.SimpleNamespace(np=np.array([True, False]))
first = r._sample()
out["bookkeeping_sees"] = r._bookkeeping_sync()
out["generators_after"] = sorted(r.input_batch.generators)
second = r._sample()
out["discarded_replays_same_draw"] = first[0] == second[0]
out["kept_advances"] = first[1] != second[1]
print(json.dumps(out, sort_keys=True))
