"""CPU workers and model runners for vLLM-Omni's AR (Thinker, Talker) and generation (Code2Wav) stages.

Composition, as vLLM-Omni 0.30.0 does for XPU (``vllm_omni/platforms/xpu/worker/``): the worker is
``OmniWorkerMixin`` over vLLM's ``CPUWorker``; the runner puts vLLM-Omni's runner first in the MRO
and vLLM's ``CPUModelRunner`` before ``GPUModelRunner``, so vLLM-Omni's ``_preprocess`` (the code
under test: it calls ``talker_preprocess`` per request and copies ``req_embeds[:min(n, rows)]``)
runs unchanged, while device-specific methods resolve to the CPU runner's.

Corrections, each needed on CPU and harmless to what is measured:

* ``load_model``: vLLM-Omni's ``load_model`` calls ``super().load_model()`` and then its post-load
  hooks (``_init_talker_mtp`` sets ``has_talker_mtp``, ...). With this MRO, ``super()`` reaches
  ``CPUModelRunner.load_model`` (which does not call its own ``super()``), so the hooks run after
  the CPU load, not instead of it.
* Device methods vLLM-Omni's runners override for CUDA (``_init_device_properties``,
  ``_sync_device``, ...) are pinned to ``CPUModelRunner``'s (``_CPU_METHODS``).
* The first forward: Qwen2.5-Omni's Talker sets ``self.voice_type`` only inside its first forward
  (``qwen2_5_omni.py:346-348``) and ``talker_preprocess`` reads it; vLLM's CPU worker skips the
  profile run in eager mode, so ``compile_or_warm_up_model`` runs one dummy forward here.
* The talker-MTP buffers (Qwen3-TTS, issue 31): vLLM-Omni's ``_init_talker_mtp`` sizes the buffers it
  hands the model's ``talker_mtp`` (the code predictor's per-step inputs: ids, codec rows, last hidden
  states, text steps) as ``max(max_num_reqs, compilation_config.max_cudagraph_capture_size)``; on CPU
  there are no CUDA graphs and the capture size is ``None``, so that ``max`` raises TypeError at load.
  ``_TalkerMTPBuffersMixin`` runs the release's ``_init_talker_mtp`` unchanged with the capture size
  read as 0 for the call (buffers of ``max_num_reqs`` rows, all a CPU step can use). The generation runner
  (Code2Wav) gets it too: Qwen3-Omni's one model class exposes ``talker_mtp`` in every stage, so the
  release's ``load_model`` sizes those buffers in its Code2Wav stage as well (issue 44). It replaces
  nothing of ``preprocess``, ``preprocess_decode_batch`` or ``_preprocess`` (the code under test), nor of
  ``talker_mtp`` itself; the code predictor runs eager on CPU by the release's own rule
  (``supports_torch_inductor`` is False, ``platform.py``).
* Seeded sampling: vLLM rewinds a seeded request's generator after a partial prefill chunk with
  ``generator.set_offset`` (``gpu_model_runner.py``), which CPU generators do not support ("CPU
  Generator does not use offset"); the CPU runner keeps the generator's state instead
  (``get_state``/``set_state``), which is the same rewind.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

logger = init_logger(__name__)

_CPU_METHODS = ("_init_device_properties", "_sync_device", "_zero_block_ids", "_to_list", "warming_up_model",
                "_postprocess_tensors", "_postprocess_triton", "get_model")


def _pin_cpu_methods(cls: type) -> type:
    for name in _CPU_METHODS:
        if name in CPUModelRunner.__dict__:
            setattr(cls, name, CPUModelRunner.__dict__[name])
    return cls


class _SeededRewindMixin:
    """vLLM samples a token for a partial prefill chunk and discards it; for a seeded request it
    then rewinds the request's generator with ``set_offset(get_offset() - 4)``
    (``GPUModelRunner._bookkeeping_sync``), which a CPU generator refuses. Same rewind on CPU:
    keep the state of those generators before ``_sample`` and put it back after; hide them from
    ``_bookkeeping_sync`` so it does not try the offset call."""

    def _discarded_generators(self) -> dict[int, Any]:
        import numpy as np

        num_reqs = self.input_batch.num_reqs
        idx = np.nonzero(self.discard_request_mask.np[:num_reqs])[0]
        gens = self.input_batch.generators
        return {int(i): gens[int(i)] for i in idx if int(i) in gens}

    def _sample(self, *args: Any, **kwargs: Any) -> Any:
        saved = {i: g.get_state() for i, g in self._discarded_generators().items()}
        out = super()._sample(*args, **kwargs)
        for i, state in saved.items():
            self.input_batch.generators[i].set_state(state)
        return out

    def _bookkeeping_sync(self, *args: Any, **kwargs: Any) -> Any:
        hidden = self._discarded_generators()
        for i in hidden:
            del self.input_batch.generators[i]
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            self.input_batch.generators.update(hidden)


class _TalkerMTPBuffersMixin:
    """The release's ``_init_talker_mtp`` with no CUDA-graph capture size (None on CPU) read as 0."""

    def _init_talker_mtp(self) -> None:
        config = self.compilation_config
        saved = getattr(config, "max_cudagraph_capture_size", 0)
        if saved is not None:
            return super()._init_talker_mtp()
        object.__setattr__(config, "max_cudagraph_capture_size", 0)
        try:
            return super()._init_talker_mtp()
        finally:
            object.__setattr__(config, "max_cudagraph_capture_size", saved)


@_pin_cpu_methods
class CPUARModelRunner(_TalkerMTPBuffersMixin, _SeededRewindMixin, GPUARModelRunner, CPUModelRunner):
    pass


@_pin_cpu_methods
class CPUGenerationModelRunner(_TalkerMTPBuffersMixin, _SeededRewindMixin, GPUGenerationModelRunner, CPUModelRunner):
    pass


class _CPUOmniWorker(OmniWorkerMixin, CPUWorker):
    model_runner_cls: type = CPUARModelRunner

    def init_device(self) -> None:
        super().init_device()  # builds vLLM's CPUModelRunner; replaced by the omni runner below
        self.model_runner = self.model_runner_cls(self.vllm_config, self.device)

    def compile_or_warm_up_model(self) -> Any:
        result = super().compile_or_warm_up_model()
        runner = self.model_runner
        model = getattr(runner, "model", None)
        if model is not None and getattr(model, "has_preprocess", False) and not hasattr(model, "voice_type"):
            try:
                runner.profile_run()  # the first forward sets model state (voice_type) upstream relies on
            except Exception:  # noqa: BLE001 - a stage that cannot profile still serves
                logger.warning("omni_stress_cpu: warm-up forward failed", exc_info=True)
        return result


class CPUARWorker(_CPUOmniWorker):
    model_runner_cls = CPUARModelRunner


class CPUGenerationWorker(_CPUOmniWorker):
    model_runner_cls = CPUGenerationModelRunner
