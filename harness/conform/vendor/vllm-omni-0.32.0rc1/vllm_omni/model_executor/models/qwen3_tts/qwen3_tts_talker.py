# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from transformers import AutoFeatureExtractor
from transformers.activations import ACT2FN
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.models.qwen3 import Qwen3Model
from vllm.model_executor.models.utils import AutoWeightsLoader, PPMissingLayer, WeightsMapper, maybe_prefix
from vllm.multimodal.audio import AudioResampler
from vllm.sequence import IntermediateTensors

from vllm_omni.data_entry_keys import OmniPayload
from vllm_omni.model_executor.models.common.ecapa_tdnn import ECAPATimeDelayNet
from vllm_omni.model_executor.models.output_templates import OmniOutput, OwnedBatchTensor
from vllm_omni.utils.device_copy import DeviceStager, index_to_device, to_device_nonblocking
from vllm_omni.utils.speaker_cache import (
    get_speaker_cache,
    iter_custom_voice_profiles,
    load_validated_profile_tensors,
    validate_qwen3_tts_profile,
)
from vllm_omni.worker.sampling_utils import get_tts_local_seed

from .configuration_qwen3_tts import Qwen3TTSConfig, Qwen3TTSTalkerConfig
from .first_audio import talker_first_audio_enabled
from .prompt_embeds_builder import (
    PRECOMPUTED_TEXT_IDS_KEY,
    Qwen3TTSPromptEmbedsBuilder,
    resolve_x_vector_only,
)
from .qwen3_tts_code_predictor_vllm import Qwen3TTSTalkerCodePredictorForConditionalGenerationVLLM
from .stream_decode import stream_ref_context_frames, talker_stream_decode_enabled
from .tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
from .tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Encoder

logger = init_logger(__name__)

_TRAILING_TEXT_COMPACT_MIN_FRAMES = 64
_ASYNC_REF_CODES_PUBLISHED_KEY = "_qwen3_tts_ref_codes_published"


def _qwen3_tts_gpu_resident_buffer_keys(
    use_v2_model_runner: bool,
) -> set[tuple[str, str]]:
    keys = {
        ("codes", "audio"),
        ("hidden_states", "last"),
        ("hidden_states", "trailing_text"),
    }
    if use_v2_model_runner:
        keys.update(
            {
                ("codes", "ref"),
                ("embed", "prefill"),
                ("meta", "codec_frame_valid"),
            }
        )
    return keys


def _materialize_span_scalars(
    values: Sequence[int],
    span_lengths: Sequence[int],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """Expand a uniform scalar cohort with one GPU allocation."""
    if len(values) != len(span_lengths):
        raise ValueError(
            f"values and span_lengths must have the same length, got {len(values)} and {len(span_lengths)}"
        )
    total = sum(int(length) for length in span_lengths)
    if not values:
        return torch.empty((0,), dtype=dtype, device=device)
    first = int(values[0])
    if not all(int(value) == first for value in values[1:]):
        return None
    return torch.full((total,), first, dtype=dtype, device=device)


def _should_publish_async_ref_codes(info: dict[str, Any]) -> bool:
    """Publish ref codes exactly once, including after a KV-resumed prefill."""
    meta = info.get("meta")
    return not (isinstance(meta, dict) and bool(meta.get(_ASYNC_REF_CODES_PUBLISHED_KEY)))


def _mark_async_ref_codes_published(info: dict[str, Any]) -> None:
    meta = info.setdefault("meta", {})
    if not isinstance(meta, dict):
        raise TypeError("Qwen3-TTS payload meta must be a dict")
    meta[_ASYNC_REF_CODES_PUBLISHED_KEY] = True


def _ref_audio_artifact_cache_capacity(vllm_config: VllmConfig) -> int:
    model_cfg = getattr(vllm_config, "model_config", None)
    connector_cfg = getattr(model_cfg, "stage_connector_config", None)
    connector_extra = (
        connector_cfg.get("extra", connector_cfg)
        if isinstance(connector_cfg, dict)
        else getattr(connector_cfg, "extra", None)
    )
    if not isinstance(connector_extra, dict):
        connector_extra = {}
    raw_capacity = connector_extra.get("ref_audio_artifact_cache_max_entries", 1024)
    try:
        capacity = int(raw_capacity)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Invalid ref_audio_artifact_cache_max_entries={raw_capacity!r}") from exc
    if capacity < 0:
        raise ValueError(f"ref_audio_artifact_cache_max_entries must be non-negative, got {capacity}")
    return capacity


def _has_tts_text_conditioning(info_dict: dict[str, Any], hidden_states: Any | None = None) -> bool:
    text_list = info_dict.get("text")
    if isinstance(text_list, list) and bool(text_list) and bool(text_list[0]):
        return True
    if PRECOMPUTED_TEXT_IDS_KEY in info_dict:
        return True
    if isinstance(hidden_states, dict):
        tail = hidden_states.get("trailing_text")
        if isinstance(tail, torch.Tensor):
            return True
    return False


# ---------------------------------------------------------------------------
# Components ported from the HuggingFace Qwen3-TTS reference implementation.
# Only the classes actually needed by the vLLM AR Talker are kept here.
# ---------------------------------------------------------------------------


class Qwen3TTSTalkerResizeMLP(nn.Module):
    """Two-layer MLP that maps between hidden sizes with an activation in between."""

    def __init__(self, input_size: int, intermediate_size: int, output_size: int, act: str, bias=False):
        super().__init__()
        self.linear_fc1 = nn.Linear(input_size, intermediate_size, bias=bias)
        self.linear_fc2 = nn.Linear(intermediate_size, output_size, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, hidden_state):
        return self.linear_fc2(self.act_fn(self.linear_fc1(hidden_state)))


# ---------------------------------------------------------------------------
# Main AR Talker model
# ---------------------------------------------------------------------------


class Qwen3TTSTalkerForConditionalGeneration(nn.Module):
    """vLLM-AR talker with step-wise layer-0 codec decoding."""

    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={
            # Talker backbone (Qwen3 decoder-only).
            "talker.model.layers.": "model.layers.",
            "talker.model.norm.": "model.norm.",
            "talker.model.codec_embedding.": "model.embed_tokens.",
            # Heads / side modules.
            "talker.codec_head.": "lm_head.",
            "talker.model.text_embedding.": "text_embedding.",
            "talker.text_projection.": "text_projection.",
            "talker.code_predictor.": "code_predictor.",
            # Speaker encoder (Base only).
            "speaker_encoder.": "speaker_encoder.",
        }
    )

    # Set by the MRV2 model state once eager frames are enabled.
    eager_frames_active = False

    # Set when the MRv2 Talker sampler applies the codec mask in its kernel.

    # Set when a prefill stores ref codes the async-chunk output must publish.
    # Starts True so a buffer restored with unpublished ref codes is still found.
    _ref_codes_pending = True

    # Prefill preprocess returns freshly built tensors (or read-only constants)
    # that it never writes again, so the runner stores them without copying.
    preprocess_prefill_updates_owned = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.vllm_config = vllm_config
        self.model_path = vllm_config.model_config.model
        self.config: Qwen3TTSConfig = vllm_config.model_config.hf_config  # type: ignore[assignment]
        self.talker_config: Qwen3TTSTalkerConfig = self.config.talker_config

        # Codec ids: only [0, codebook_vocab_size) are real code indices (layer-0 is sampled from talker vocab).
        # codec_eos_token_id is a special stop token and must not be decoded by SpeechTokenizer.
        self._codebook_vocab_size = int(getattr(self.talker_config.code_predictor_config, "vocab_size", 0) or 0)
        if self._codebook_vocab_size <= 0:
            raise ValueError(
                f"Invalid talker_config.code_predictor_config.vocab_size={self._codebook_vocab_size}; "
                "cannot restrict codec logits safely."
            )
        self._codec_eos_token_id = int(getattr(self.talker_config, "codec_eos_token_id", -1))

        self.have_multimodal_outputs = True
        self.has_preprocess = True
        self.has_postprocess = True
        # Qwen3-TTS postprocess() only reads hidden_states[-1, :]. On a prefix-
        # cache hit, the last hidden state is in the newly computed tail, so
        # reconstructing the full cached_prefix + new_tail span is wasted work.
        # Opt out of the per-step GPU->CPU hidden-state cache write and merged-
        # tensor read; postprocess receives the tail-only slice instead, which
        # avoids ~18 ms merge + ~6 ms write per step (Sy0307 profile, #3665).
        self.requires_full_prefix_cached_hidden_states = False
        # Stage 1 (code2wav) consumes runtime audio codes, not hidden states,
        # so the inter-stage pooler payload never needs a CPU hidden-states
        # view. Opting out lets the runner skip the per-step blocking
        # ``hidden_states[:n].to("cpu")`` (measured at 24% of stage-0 on-CPU
        # samples at c=64 on H20).
        self.omni_pooler_payload_include_hidden = False
        # ``codes.audio`` is only needed for future prefix-hit reconstruction
        # after a request has produced codec rows. Keep per-step rows on GPU and
        # materialize the CPU OmniTensorPrefixCache entry once at completion.
        self.deferred_prefix_cache_mm_keys = {"codes.audio"}
        # Used by OmniGPUModelRunner for the GPU-side MTP fast-path.
        self.mtp_hidden_size = int(self.talker_config.hidden_size)
        # OmniGPUModelRunner will store talker_mtp output under this key in
        # per-request additional_information.
        self.talker_mtp_output_key = ("codes", "audio")
        self.talker_mtp_graph_safe = True
        # A frame's residual codebooks depend only on the Talker hidden and
        # CB0 of the step that sampled it, so MRV2 may complete the frame at
        # the end of that step instead of in the next step's preprocess.
        self.stream_decode = talker_stream_decode_enabled(vllm_config)
        predictor = Qwen3TTSTalkerCodePredictorForConditionalGenerationVLLM
        extra = predictor._stage_connector_extra_config(vllm_config)
        self.stream_first_audio = self.stream_decode and predictor._parse_bool_config(
            extra.get("talker_stream_first_audio")
        )
        # Model-local voice-clone priming boundary; each deployment selects
        # its reference context independently of the two-stage codec profile.
        self.stream_ref_context_frames = stream_ref_context_frames(vllm_config) if self.stream_decode else 0
        self.mtp_eager_frames = talker_first_audio_enabled(vllm_config) or self.stream_decode
        self.stream_decoder = None
        self.stream_graphs = None
        self.stream_prime_graphs = None
        # Power-of-two frame counts below the priming chunk: see prime_stream_decoder.
        self.stream_prime_pieces: dict[int, Any] = {}
        self.stream_sample_rate = 0
        self.stream_chunk_frames = 25
        # The runners bypass only the outer whole-MTP graph when explicit
        # generators are present, so seeded requests can still share one raw
        # batched MTP call with independent per-row streams.
        self.talker_mtp_accepts_per_row_generators = True
        self.mtp_sample_uniforms = True
        self.mtp_sample_steps = max(0, int(self.talker_config.num_code_groups) - 1)
        self.mtp_sample_vocab_size = self._codebook_vocab_size
        self.use_async_omni_output = True
        self.eager_omni_postprocess_before_async_output = True
        self.omni_pooler_payload_include_hidden = False
        self.model = Qwen3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))

        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                self.talker_config.vocab_size,
                self.talker_config.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )
        else:
            self.lm_head = PPMissingLayer()

        self.logits_processor = LogitsProcessor(self.talker_config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

        # Text embedding is a separate table in the official implementation.
        self.text_embedding = nn.Embedding(self.talker_config.text_vocab_size, self.talker_config.text_hidden_size)
        self.text_projection = Qwen3TTSTalkerResizeMLP(
            self.talker_config.text_hidden_size,
            self.talker_config.text_hidden_size,
            self.talker_config.hidden_size,
            self.talker_config.hidden_act,
            bias=True,
        )

        # Initialize speaker_encoder from config (random weights).
        # For load_format: dummy this is the final state; for normal loading,
        # load_weights() overwrites with real weights when the checkpoint
        # provides speaker_encoder.* tensors. Constructing eagerly here
        # (rather than lazily inside load_weights) ensures voice-cloning code
        # paths work under load_format: dummy, which bypasses load_weights
        # entirely (DummyModelLoader fills existing params in-place and never
        # iterates a checkpoint).
        self.speaker_encoder = ECAPATimeDelayNet(self.config.speaker_encoder_config)

        # Code predictor uses an isolated vLLM config so its KV cache doesn't
        # pollute the main engine's static_forward_context (shallow-copy shares
        # the dict by reference — must assign a fresh one).
        # Use copy.copy rather than dataclasses.replace: CompilationConfig /
        # VllmConfig are pydantic dataclasses, so `replace` re-runs
        # __init__→pydantic validators + __post_init__. If a backend has
        # already rebound compilation_config.backend to a non-stock value, the
        # piecewise-backend validator in vllm/config/compilation.py rejects it
        # and the clone raises. copy.copy goes through __reduce_ex__, skips
        # validation, and leaves the parent's already-initialized state intact.
        predictor_compilation = copy.copy(vllm_config.compilation_config)
        predictor_compilation.static_forward_context = {}
        self._code_predictor_vllm_config = copy.copy(vllm_config)
        self._code_predictor_vllm_config.compilation_config = predictor_compilation
        from vllm.config.vllm import set_current_vllm_config as _set_cfg

        with _set_cfg(self._code_predictor_vllm_config):
            self.code_predictor = Qwen3TTSTalkerCodePredictorForConditionalGenerationVLLM(
                vllm_config=self._code_predictor_vllm_config,
                config=self.talker_config.code_predictor_config,
                talker_config=self.talker_config,
                prefix="code_predictor",
            )

        # Constant logit mask: allow only codec ids [1, codebook_vocab_size) plus codec EOS.
        # Register the *disallowed* form so compute_logits doesn't recompute ~mask per step.
        vocab = int(self.talker_config.vocab_size)
        codec_mask = torch.zeros((vocab,), dtype=torch.bool)
        lo, hi = 1, min(self._codebook_vocab_size, vocab)
        if hi > lo:
            codec_mask[lo:hi] = True
        if 0 <= self._codec_eos_token_id < vocab:
            codec_mask[self._codec_eos_token_id] = True
        self.register_buffer("_codec_disallowed_mask", ~codec_mask, persistent=False)

        # Silence-region codec tokens (#4966). The talker has real probability mass on
        # these in the opening decode frames; how many it draws is a sampling outcome,
        # which is the source of both the leading silence and its seed-to-seed variance.
        # The vocabulary is checkpoint-specific, so it is derived at load time in
        # :meth:`_init_silence_mask`; this is only the placeholder.
        self._silence_ban_frames = max(0, int(getattr(vllm_config.model_config, "silence_ban_frames", 0) or 0))
        # vLLM only fills sampling_metadata.output_token_ids when penalties, bad
        # words, or a logits processor need history. compute_logits reads it for
        # the per-request decode step, so request it when the ban is on.
        self.logitsprocs_need_output_token_ids = self._silence_ban_frames > 0
        self.register_buffer("_silence_mask", torch.zeros((vocab,), dtype=torch.bool), persistent=False)

        # Per-request generation mode for the silence ban (#4966). The ban is a
        # Base voice-clone (x-vector-only) fix; ICL onsets are legitimate audio
        # and must not be masked. Mode is only knowable at prefill, so it is
        # recorded in preprocess_batch and read back at decode. The batch order
        # comes from set_batch_req_ids, which the runner calls each step with
        # the same req_id ordering that indexes sampling_metadata.
        self._req_x_vector_only: dict[str, bool | None] = {}
        self._batch_req_ids: list[str] = []
        self._mrv2_silence_ban_mask: torch.Tensor | None = None

        # Keys that should stay on GPU in model_intermediate_buffer to avoid
        # CPU-to-GPU round-trips on every decode step.
        self._use_v2_model_runner = bool(getattr(vllm_config.model_config, "use_v2_model_runner", False))
        self.gpu_resident_buffer_keys = _qwen3_tts_gpu_resident_buffer_keys(self._use_v2_model_runner)

        if self._use_v2_model_runner:
            # Align predictor warmup/capture buckets with the outer MRv2 MTP
            # graph buckets so the compile cache covers every reachable size.
            outer_max_bsz = int(vllm_config.scheduler_config.max_num_seqs)
            outer_buckets = {
                int(size)
                for size in vllm_config.compilation_config.cudagraph_capture_sizes
                if 0 < int(size) <= outer_max_bsz
            }
            outer_buckets.update({1, outer_max_bsz})  # eager fallback rows
            self.code_predictor.configure_mtp_execution_buckets(sorted(outer_buckets))

        # ``text_proj(text_emb(tts_pad_token_id))`` is request-independent —
        # it depends only on frozen ``text_embedding`` / ``text_projection``
        # weights, so we precompute it once in :meth:`_init_runtime_buffers`
        # (called from :meth:`load_weights`) and reuse the same buffer at
        # every prefill and decode step instead of round-tripping it through
        # the per-request ``info_dict``. Declared here as zeros so the
        # attribute exists under ``load_format: dummy`` (which bypasses
        # ``load_weights`` entirely and leaves the value uninitialized).
        model_dtype = getattr(vllm_config.model_config, "dtype", torch.bfloat16)
        self.register_buffer(
            "_tts_pad_embed",
            torch.zeros(1, int(self.talker_config.hidden_size), dtype=model_dtype),
            persistent=False,
        )
        self._embedding_dtype = torch.bfloat16

        tokenizer_config = Qwen3TTSTokenizerV2Config.from_pretrained(
            self.model_path,
            subfolder="speech_tokenizer",
        )
        self.encoder = Qwen3TTSTokenizerV2Encoder._from_config(
            tokenizer_config.encoder_config,
        )
        self.encoder.eval()
        self.encoder.to(dtype=torch.bfloat16)
        self._encoder_valid_num_quantizers = int(tokenizer_config.encoder_valid_num_quantizers)
        self._encoder_downsample_rate = int(tokenizer_config.encode_downsample_rate)

        self._encoder_feature_extractor = AutoFeatureExtractor.from_pretrained(
            self.model_path,
            subfolder="speech_tokenizer",
        )

        self._speaker_cache = get_speaker_cache()
        raw_subtalker_sampling = getattr(vllm_config.model_config, "subtalker_sampling_params", None)
        self._subtalker_sampling_params: dict[str, Any] = (
            dict(raw_subtalker_sampling) if isinstance(raw_subtalker_sampling, Mapping) else {}
        )
        self.mtp_sampling_params = self._subtalker_sampling_params

        self._stacked_codec_embed: torch.Tensor | None = None

        # Stand-alone wrapper around the embedding layers, encoders and
        # tokenizers required to assemble a talker prefill prompt. Owns the
        # text + speech tokenizers (loaded lazily on first use) and the
        # per-ref-audio / resampler caches, so they don't leak onto the
        # talker class. Other talker variants can construct their own builder
        # with the same set of dependencies and reuse ``build_prompt_embeds``
        # verbatim.
        self._prompt_builder = Qwen3TTSPromptEmbedsBuilder(
            config=self.config,
            talker_config=self.talker_config,
            model_path=self.model_path,
            text_embedding=self.text_embedding,
            text_projection=self.text_projection,
            codec_embed=self.embed_input_ids,
            residual_code_embeddings=lambda: self.code_predictor.get_input_embeddings(),
            speaker_encoder=self.speaker_encoder,
            tts_pad_embed=self._tts_pad_embed,
            encode_ref_audio_batch=self._encode_ref_audio_batch,
            speaker_cache=self._speaker_cache,
            ref_audio_artifact_cache_max_entries=_ref_audio_artifact_cache_capacity(vllm_config),
        )
        self._load_custom_voice_profiles()

    # -------------------- custom voice profiles --------------------

    def _load_custom_voice_profiles(self) -> None:
        """Preload offline Qwen3-TTS custom voice profiles into speaker cache."""
        custom_voice_dir = getattr(self.config, "custom_voice_dir", None)
        if not custom_voice_dir:
            return

        expected_dim = int(getattr(self.config.speaker_encoder_config, "enc_dim", 0) or 0)
        loaded = 0
        for profile in iter_custom_voice_profiles(custom_voice_dir, expected_model_type="qwen3_tts"):
            tensors = load_validated_profile_tensors(
                profile,
                expected_model_type="qwen3_tts",
                validate_profile=lambda profile, tensors: validate_qwen3_tts_profile(
                    profile,
                    tensors,
                    expected_embedding_dim=expected_dim,
                ),
            )
            if tensors is None:
                continue

            speaker_embedding = tensors["speaker_embedding"].reshape(-1).contiguous().cpu()
            mode = str(profile.get("mode") or "xvec").lower()
            ref_code = tensors.get("ref_code")
            artifacts: dict[str, Any] = {
                "ref_spk_embedding": speaker_embedding,
                "ref_code": ref_code.contiguous().cpu() if isinstance(ref_code, torch.Tensor) else None,
                "icl_mode": mode == "icl",
                "ref_text": profile.get("ref_text"),
            }
            key = self._speaker_cache.make_cache_key(
                profile["voice_name_lower"],
                model_type=f"qwen3_tts_{mode}",
                created_at=0,
            )
            self._speaker_cache.put(key, artifacts)
            loaded += 1

        if loaded:
            logger.info("Loaded %d precomputed Qwen3-TTS custom voice profile(s) from %s", loaded, custom_voice_dir)

    # -------------------- vLLM required hooks --------------------

    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(
        self, hidden_states: torch.Tensor | OmniOutput, sampling_metadata: Any = None
    ) -> torch.Tensor | None:
        if isinstance(hidden_states, OmniOutput):
            hidden_states = hidden_states.text_hidden_states
        if hidden_states is None:
            return None
        logits = self.logits_processor(self.lm_head, hidden_states)
        if logits is None:
            return None

        # Prompt logprobs share this entry point with sampling, so preserve
        # the codec vocabulary mask even when the fused sampler is installed.
        logits = logits.masked_fill(self._codec_disallowed_mask, float("-inf"))

        # Suppress silence-region tokens for the first N decode frames (#4966). The
        # per-request decode step is the length of its generated-token history.
        ban_n = self._silence_ban_frames
        if ban_n > 0 and sampling_metadata is None and self._mrv2_silence_ban_mask is not None:
            if self._mrv2_silence_ban_mask.shape[0] != logits.shape[0]:
                raise ValueError("MRV2 silence-ban batch must match the sampled logits rows")
            return logits.masked_fill(self._mrv2_silence_ban_mask & self._silence_mask, float("-inf"))
        if ban_n > 0 and sampling_metadata is not None:
            output_token_ids = getattr(sampling_metadata, "output_token_ids", None)
            if output_token_ids is None or len(output_token_ids) != logits.shape[0]:
                logger.warning_once(
                    "Silence ban is enabled but output_token_ids (%s) does not match the "
                    "logits batch (%d); the ban will not take effect.",
                    "None" if output_token_ids is None else len(output_token_ids),
                    logits.shape[0],
                )
            else:
                # Both gates are tiny [B] checks, so keep them on CPU: once no
                # request is both in scope and inside the window, skip the device
                # work rather than paying a host-to-device copy and a [B, vocab]
                # mask on every decode frame.
                #
                # Scope the ban to x-vector-only requests (#4966). A request whose
                # mode was never recorded is left alone: masking a request that
                # cannot be classified is the risk this gate exists to remove.
                batch_req_ids = self._batch_req_ids
                if len(batch_req_ids) == logits.shape[0]:
                    in_scope = [self._req_x_vector_only.get(rid) is True for rid in batch_req_ids]
                else:
                    logger.warning_once(
                        "Silence ban is enabled but the recorded batch req_ids (%d) do not match "
                        "the logits batch (%d); the ban will not take effect.",
                        len(batch_req_ids),
                        logits.shape[0],
                    )
                    in_scope = [False] * logits.shape[0]

                steps = [len(t) for t in output_token_ids]
                if any(scoped and step < ban_n for scoped, step in zip(in_scope, steps, strict=True)):
                    early = torch.tensor(
                        [scoped and step < ban_n for scoped, step in zip(in_scope, steps, strict=True)],
                        device=logits.device,
                        dtype=torch.bool,
                    ).unsqueeze(1)
                    logits = logits.masked_fill(early & self._silence_mask, float("-inf"))

        return logits

    # -------------------- Omni multimodal output plumbing --------------------

    @property
    def mm_outputs_fresh_per_step(self) -> bool:
        """Stream-decode outputs come from :meth:`_make_eager_omni_output`, allocated per step."""
        return self.stream_decoder is not None and self.eager_frames_active

    def make_omni_output(self, model_outputs: torch.Tensor | OmniOutput, **kwargs: Any) -> OmniOutput:
        if isinstance(model_outputs, OmniOutput):
            return model_outputs

        hidden = model_outputs
        info_dicts = kwargs.get("model_intermediate_buffer")
        if info_dicts is None:
            info_dicts = kwargs.get("runtime_additional_information") or []
        if "runtime_additional_information" in kwargs and "model_intermediate_buffer" not in kwargs:
            logger.warning_once("runtime_additional_information is deprecated, use model_intermediate_buffer")
        model_config = getattr(getattr(self, "vllm_config", None), "model_config", None)
        async_chunk = bool(getattr(model_config, "async_chunk", False))
        spans = kwargs.get("request_token_spans")
        if async_chunk and self.eager_frames_active and spans is not None:
            return self._make_eager_omni_output(hidden, info_dicts, spans)
        audio_codes_list: list[torch.Tensor] = []
        ref_code_len_segments: list[tuple[int | torch.Tensor, int, torch.device]] = []
        ref_code_list: list[torch.Tensor] = []
        has_ref_code = False
        codec_streaming_values: list[int] = []
        codec_streaming_span_lengths: list[int] = []
        codec_streaming_device: torch.device | None = None
        codec_frame_valid_device: torch.device | None = None
        codec_frame_valid_parts: list[torch.Tensor] = []
        for info in info_dicts:
            if not isinstance(info, dict):
                ref_code_list.append(torch.empty(0, dtype=torch.long))
                continue
            codes = info.get("codes", {})
            meta = info.get("meta", {})
            ac = codes.get("audio")
            if isinstance(ac, torch.Tensor):
                audio_codes_list.append(ac)
                frame_valid = meta.get("codec_frame_valid")
                if isinstance(frame_valid, bool):
                    codec_frame_valid_device = ac.device
                    codec_frame_valid_parts.append(
                        torch.full(
                            (int(ac.shape[0]),),
                            int(frame_valid),
                            dtype=torch.int8,
                            device=ac.device,
                        )
                    )
                elif isinstance(frame_valid, torch.Tensor):
                    if frame_valid.numel() != 1:
                        raise ValueError("codec_frame_valid must be scalar per request")
                    codec_frame_valid_device = ac.device
                    codec_frame_valid_parts.append(
                        frame_valid.to(device=ac.device, dtype=torch.int8, non_blocking=True)
                        .reshape(1)
                        .expand(int(ac.shape[0]))
                    )
                cs = meta.get("codec_streaming")
                if not async_chunk and isinstance(cs, bool):
                    codec_streaming_values.append(int(cs))
                    codec_streaming_span_lengths.append(int(ac.shape[0]))
                    codec_streaming_device = ac.device
            ref_code = codes.get("ref")
            publish_ref_code = not async_chunk or _should_publish_async_ref_codes(info)
            if publish_ref_code and isinstance(ref_code, torch.Tensor) and ref_code.numel() > 0:
                ref_code_list.append(ref_code)
                has_ref_code = True
                if async_chunk:
                    _mark_async_ref_codes_published(info)
            else:
                ref_code_list.append(torch.empty(0, dtype=torch.long))
            if async_chunk:
                # The streaming consumer uses codes.ref.shape[0] directly and
                # does not read ref_code_len or codec_streaming. Avoid creating
                # GPU control tensors that would only be snapshotted and copied
                # back to the CPU on every decode step.
                continue
            ref_len = meta.get("ref_code_len")
            if ref_len is None:
                continue
            if not isinstance(ac, torch.Tensor):
                continue
            span_len = int(ac.shape[0])
            if isinstance(ref_len, torch.Tensor):
                if ref_len.numel() == 0:
                    raise ValueError("ref_code_len is an empty tensor")
                ref_len_tail = ref_len.reshape(-1)[-1:].to(dtype=torch.int32, device=ac.device)
                ref_code_len_segments.append((ref_len_tail, span_len, ac.device))
                continue
            if isinstance(ref_len, list):
                if len(ref_len) != 1:
                    raise ValueError(f"ref_code_len must be scalar or 1-element list, got len={len(ref_len)}")
                ref_len_val = int(ref_len[0])
            else:
                ref_len_val = int(ref_len)
            ref_code_len_segments.append((ref_len_val, span_len, ac.device))

        if not audio_codes_list:
            return OmniOutput(text_hidden_states=hidden, multimodal_outputs={})

        audio_codes = torch.cat(audio_codes_list, dim=0)
        span_len = int(audio_codes.shape[0])
        mm: OmniPayload = {"codes": {"audio": audio_codes}}
        if ref_code_len_segments:
            if all(isinstance(value, int) for value, _length, _device in ref_code_len_segments):
                ref_code_len = _materialize_span_scalars(
                    [int(value) for value, _length, _device in ref_code_len_segments],
                    [length for _value, length, _device in ref_code_len_segments],
                    dtype=torch.int32,
                    device=ref_code_len_segments[0][2],
                )
                if ref_code_len is None:
                    ref_code_len = torch.cat(
                        [
                            torch.full((length,), int(value), dtype=torch.int32, device=device)
                            for value, length, device in ref_code_len_segments
                        ],
                        dim=0,
                    )
            else:
                ref_code_len_parts = [
                    value.expand(length)
                    if isinstance(value, torch.Tensor)
                    else torch.full((length,), value, dtype=torch.int32, device=device)
                    for value, length, device in ref_code_len_segments
                ]
                ref_code_len = torch.cat(ref_code_len_parts, dim=0)
            mm.setdefault("meta", {})["ref_code_len"] = ref_code_len[:span_len]
        if has_ref_code:
            # Batch-aligned, one entry per request: ``to_payload_element``
            # indexes ``element[idx]`` per request, and a shorter list would
            # silently broadcast one request's reference codes to the others.
            mm.setdefault("codes", {})["ref"] = ref_code_list
        if codec_streaming_values:
            assert codec_streaming_device is not None
            codec_streaming = _materialize_span_scalars(
                codec_streaming_values,
                codec_streaming_span_lengths,
                dtype=torch.int8,
                device=codec_streaming_device,
            )
            if codec_streaming is None:
                codec_streaming = torch.cat(
                    [
                        torch.full((length,), value, dtype=torch.int8, device=codec_streaming_device)
                        for value, length in zip(
                            codec_streaming_values,
                            codec_streaming_span_lengths,
                            strict=True,
                        )
                    ],
                    dim=0,
                )
            mm.setdefault("meta", {})["codec_streaming"] = codec_streaming[:span_len]
        if codec_frame_valid_parts:
            assert codec_frame_valid_device is not None
            codec_frame_valid = torch.cat(codec_frame_valid_parts, dim=0)
            mm.setdefault("meta", {})["codec_frame_valid"] = codec_frame_valid[:span_len]
        return OmniOutput(text_hidden_states=hidden, multimodal_outputs=mm)

    def _make_eager_omni_output(
        self,
        hidden: torch.Tensor,
        info_dicts: list[Any],
        spans: list[tuple[int, int]],
    ) -> OmniOutput:
        """Async-chunk output when the runner fills frames after sampling.

        Every row that sampled this step gets its codes and validity from the
        runner's eager MTP; the rest (non-final prefill chunks) carry no frame,
        so the per-request buffer rows need not be gathered here.
        """
        num_tokens = spans[-1][1] if spans else 0
        q = int(self.talker_config.num_code_groups)
        mm: OmniPayload = {
            "codes": {"audio": torch.zeros((num_tokens, q), dtype=torch.long, device=hidden.device)},
            "meta": {
                "codec_frame_valid": torch.zeros((num_tokens,), dtype=torch.int8, device=hidden.device),
                "first_audio": torch.zeros((num_tokens,), dtype=torch.int8, device=hidden.device),
            },
        }
        if self.stream_decoder is not None:
            # Filled per sampled row by the runner's eager MTP; token-major so
            # each request's slice is its frames of this step.
            spf = int(self.stream_decoder.spf)
            mm["model_outputs"] = torch.zeros((num_tokens, spf), dtype=torch.float32, device=hidden.device)
            sr = torch.tensor(self.stream_sample_rate, dtype=torch.int32)
            mm["sr"] = [sr] * len(info_dicts)
        # Ref codes are stored by a first prefill and published by the output
        # of that same step; without a pending one there is nothing to scan.
        ref_rows = (
            [
                index
                for index, info in enumerate(info_dicts)
                if isinstance(info, dict)
                and isinstance(ref := info.get("codes", {}).get("ref"), torch.Tensor)
                and ref.numel() > 0
                and _should_publish_async_ref_codes(info)
            ]
            if self._ref_codes_pending
            else []
        )
        self._ref_codes_pending = False
        if ref_rows:
            empty = torch.empty(0, dtype=torch.long)
            ref_code_list = [empty] * len(info_dicts)
            for index in ref_rows:
                ref_code_list[index] = info_dicts[index]["codes"]["ref"]
                _mark_async_ref_codes_published(info_dicts[index])
            mm["codes"]["ref"] = ref_code_list
        return OmniOutput(text_hidden_states=hidden, multimodal_outputs=mm)

    # -------------------- preprocess / postprocess --------------------

    def preprocess(
        self,
        input_ids: torch.Tensor,
        input_embeds: torch.Tensor | None,
        **info_dict: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        # Metadata may be passed flattened or under `additional_information`; normalize to flattened keys.
        additional_information = info_dict.get("additional_information")
        if isinstance(additional_information, dict):
            merged: dict[str, Any] = {k: v for k, v in info_dict.items() if k != "additional_information"}
            for k, v in additional_information.items():
                merged.setdefault(k, v)
            info_dict = merged

        payload: OmniPayload = info_dict
        embed = payload.get("embed", {})
        hs = payload.get("hidden_states", {})
        meta = payload.get("meta", {})

        span_len = int(input_ids.shape[0])
        if span_len <= 0:
            return input_ids, input_embeds if input_embeds is not None else self.embed_input_ids(input_ids), {}
        is_prefill_raw = info_dict.get("_omni_is_prefill")
        if isinstance(is_prefill_raw, bool):
            is_prefill = is_prefill_raw
        else:
            try:
                is_prefill = int(info_dict["_omni_num_computed_tokens"]) < int(info_dict["_omni_prompt_len"])
            except Exception:
                is_prefill = span_len > 1

        if not _has_tts_text_conditioning(info_dict, hs):
            raise ValueError("Missing Qwen3-TTS text conditioning: provide `text` or precomputed text token ids.")

        task_type = (info_dict.get("task_type") or ["CustomVoice"])[0]
        codec_streaming = self._codec_streaming_flag(meta, task_type)

        # ``tts_pad_embed`` is a request-independent constant — see
        # :meth:`_init_runtime_buffers`. Materialize once on the right
        # device/dtype and reuse for both the prefill placeholder padding
        # and the decode text-step fallback below.
        dtype = self._embedding_dtype
        tts_pad_embed = self._tts_pad_embed.to(device=input_ids.device, dtype=dtype).reshape(1, -1)

        if is_prefill:
            # Prefill (prompt embeddings)
            prompt_embeds_buffer = embed.get("prefill")
            # First prefill round: the retained prompt buffer is not populated.
            # Subsequent chunks slice the buffer stored by the first round.
            is_first_prefill = not isinstance(prompt_embeds_buffer, torch.Tensor) or prompt_embeds_buffer.ndim != 2
            if is_first_prefill:
                full_prompt_embeds, tailing_text_hidden, ref_code_len, ref_code = (
                    self._prompt_builder.build_prompt_embeds(task_type=task_type, info_dict=info_dict)
                )
                prompt_embeds_buffer = full_prompt_embeds.detach()
                if not bool(getattr(self, "_use_v2_model_runner", False)):
                    prompt_embeds_buffer = prompt_embeds_buffer.to("cpu")
                prompt_embeds_buffer = prompt_embeds_buffer.contiguous()
                info_update: OmniPayload = {
                    "embed": {"prefill": prompt_embeds_buffer},
                    "hidden_states": {"trailing_text": tailing_text_hidden.detach()},
                    "meta": {
                        "talker_text_offset": 0,
                        "codec_streaming": codec_streaming,
                        "codec_frame_valid": self._false_scalar(input_ids.device),
                    },
                }
                if isinstance(ref_code, torch.Tensor) and ref_code.numel() > 0:
                    ref_code_buffer = ref_code.detach()
                    if not bool(getattr(self, "_use_v2_model_runner", False)):
                        ref_code_buffer = ref_code_buffer.to("cpu")
                    info_update.setdefault("codes", {})["ref"] = ref_code_buffer.contiguous()
                    # The eager output scans for unpublished ref codes only while some are pending.
                    self._ref_codes_pending = True
                if ref_code_len is not None:
                    info_update["meta"]["ref_code_len"] = int(ref_code_len)
                # First prefill: source the slice offset from `_omni_num_computed_tokens`
                # so cache-recovery (prefill replay at a later offset) lands on the right
                # slice of the stored embeddings. Subsequent chunks below advance from
                # `talker_prefill_offset` written here.
                offset = max(0, int(info_dict.get("_omni_num_computed_tokens", 0) or 0))
            else:
                # Subsequent prefill chunk: slice from stored embeddings at running offset.
                offset = max(0, int(meta.get("talker_prefill_offset", 0) or 0))
                info_update = {
                    "meta": {
                        "codec_streaming": codec_streaming,
                        "codec_frame_valid": self._false_scalar(input_ids.device),
                    }
                }

            # Always return a span_len slice; if the scheduled placeholder is longer than what
            # the prompt actually fills, pad with tts_pad_embed (preserves placeholder/embedding alignment).
            s = max(0, min(offset, int(prompt_embeds_buffer.shape[0])))
            e = max(0, min(offset + span_len, int(prompt_embeds_buffer.shape[0])))
            take = prompt_embeds_buffer[s:e]
            if int(take.shape[0]) < span_len:
                pad_n = int(span_len - int(take.shape[0]))
                pad_rows = tts_pad_embed.to(device=take.device).reshape(1, -1).expand(pad_n, -1)
                take = torch.cat([take, pad_rows], dim=0)
            prompt_embeds = take.to(device=input_ids.device, dtype=dtype)
            info_update["meta"]["talker_prefill_offset"] = int(offset + span_len)

            # When inputs_embeds is set, token ids are ignored by the model but must stay in-vocab for vLLM bookkeeping.
            if getattr(self, "_use_v2_model_runner", False):
                # The MRv2 runner passes its own input-id rows: fill them in place, no copy back.
                input_ids_out = input_ids.fill_(int(self.talker_config.codec_pad_id))
            else:
                input_ids_out = torch.full_like(input_ids, int(self.talker_config.codec_pad_id))

            info_update.setdefault("codes", {})["audio"] = self._zero_codes(prompt_embeds.shape[0], input_ids.device)
            return input_ids_out, prompt_embeds, info_update

        if span_len > 1:
            inputs_embeds_out = (
                self.embed_input_ids(input_ids.reshape(-1, 1).to(torch.long))
                .to(device=input_ids.device, dtype=dtype)
                .reshape(span_len, -1)
            )
            return (
                input_ids,
                inputs_embeds_out,
                {
                    "meta": {
                        "codec_streaming": codec_streaming,
                        "codec_frame_valid": torch.zeros((), dtype=torch.bool, device=input_ids.device),
                    }
                },
            )

        # Decode: span_len == 1
        # Pop one text-step vector from tailing_text_hidden queue.
        # ``tts_pad_embed`` was materialized above from :attr:`_tts_pad_embed`
        # (request-independent buffer) — no per-request fetch needed.

        tail = hs.get("trailing_text")
        text_offset = max(0, int(meta.get("talker_text_offset", 0) or 0))
        trailing_text_update = None
        if isinstance(tail, torch.Tensor) and tail.ndim == 2:
            tail_len = int(tail.shape[0])
            if text_offset < tail_len:
                text_step = (
                    tail[text_offset : text_offset + 1]
                    .to(
                        device=input_ids.device,
                        dtype=dtype,
                    )
                    .reshape(1, -1)
                )
                next_text_offset = text_offset + 1
                should_compact_tail = next_text_offset >= tail_len or (
                    next_text_offset >= _TRAILING_TEXT_COMPACT_MIN_FRAMES and next_text_offset * 2 >= tail_len
                )
                if should_compact_tail:
                    if next_text_offset >= tail_len:
                        trailing_text_update = torch.empty((0, tail.shape[1]), device=tail.device, dtype=tail.dtype)
                    else:
                        trailing_text_update = tail[next_text_offset:].contiguous()
                    next_text_offset = 0
            else:
                text_step = tts_pad_embed
                next_text_offset = 0
                if tail.numel() > 0:
                    trailing_text_update = torch.empty((0, tail.shape[1]), device=tail.device, dtype=tail.dtype)
        else:
            text_step = tts_pad_embed
            next_text_offset = text_offset

        last_hidden = hs.get("last")
        if isinstance(last_hidden, torch.Tensor):
            past_hidden = last_hidden.to(device=input_ids.device, dtype=dtype).reshape(1, -1)
        else:
            # Defensive: EOS step row is zeroed by the invalid-layer-0 mask and filtered downstream.
            past_hidden = torch.zeros_like(text_step)

        # Use OmniGPUModelRunner talker_mtp fast-path for residual codebooks and per-step inputs_embeds update.
        last_id_hidden = self.embed_input_ids(input_ids.reshape(1, 1).to(torch.long)).to(
            device=input_ids.device, dtype=dtype
        )
        inputs_embeds_out = last_id_hidden.reshape(1, -1)

        info_update = {
            "mtp_inputs": (past_hidden, text_step),
            "meta": {
                "talker_text_offset": int(next_text_offset),
                "codec_streaming": codec_streaming,
                "codec_frame_valid": (
                    (input_ids.reshape(-1)[-1] >= 0) & (input_ids.reshape(-1)[-1] < self._codebook_vocab_size)
                ).reshape(()),
            },
        }
        if trailing_text_update is not None:
            info_update["hidden_states"] = {"trailing_text": trailing_text_update.detach()}
        return input_ids, inputs_embeds_out, info_update

    def preprocess_decode_batch(
        self,
        *,
        input_ids: torch.Tensor,
        req_infos: list[dict[str, Any]],
        input_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
        """Batch the decode-only preprocess path for Qwen3-TTS.

        This mirrors the scalar decode branch in ``preprocess()``, but performs
        the token embedding lookup once for the whole decode batch, unless
        the runner has already prepared embeddings for these input ids.
        """
        input_ids_flat = input_ids.reshape(-1)
        if int(input_ids_flat.numel()) != len(req_infos):
            raise ValueError(
                f"preprocess_decode_batch expected {len(req_infos)} input ids, got {int(input_ids_flat.numel())}"
            )

        eager = self.eager_frames_active
        codec_frame_valid_batch = (
            None if eager else (input_ids_flat >= 0) & (input_ids_flat < self._codebook_vocab_size)
        )
        device = input_ids_flat.device
        dtype = self._embedding_dtype
        # Request-independent constant (see :meth:`_init_runtime_buffers`) —
        # compute once for the batch instead of fetching it per request from
        # ``info_dict["embed"]["tts_pad"]``.
        tts_pad_embed = self._tts_pad_embed.to(device=device, dtype=dtype).reshape(1, -1)
        past_hidden_list: list[torch.Tensor] = []
        text_step_list: list[torch.Tensor] = []
        updates: list[dict[str, Any]] = []

        for info_dict in req_infos:
            additional_information = info_dict.get("additional_information")
            if isinstance(additional_information, dict):
                merged: dict[str, Any] = {k: v for k, v in info_dict.items() if k != "additional_information"}
                for k, v in additional_information.items():
                    merged.setdefault(k, v)
                info_dict = merged

            payload: OmniPayload = info_dict
            hs = payload.get("hidden_states", {})
            meta = payload.get("meta", {})

            if not _has_tts_text_conditioning(info_dict, hs):
                raise ValueError("Missing Qwen3-TTS text conditioning: provide `text` or precomputed text token ids.")

            task_type = (info_dict.get("task_type") or ["CustomVoice"])[0]
            codec_streaming_val = meta.get("codec_streaming")
            if isinstance(codec_streaming_val, list):
                codec_streaming_raw = codec_streaming_val[0] if codec_streaming_val else None
            else:
                codec_streaming_raw = codec_streaming_val
            if isinstance(codec_streaming_raw, bool):
                codec_streaming = codec_streaming_raw
            else:
                codec_streaming = task_type == "Base"

            tail = hs.get("trailing_text")
            text_offset = max(0, int(meta.get("talker_text_offset", 0) or 0))
            trailing_text_update = None
            if isinstance(tail, torch.Tensor) and tail.ndim == 2:
                tail_len = int(tail.shape[0])
                if text_offset < tail_len:
                    text_step = tail[text_offset : text_offset + 1].to(device=device, dtype=dtype).reshape(1, -1)
                    next_text_offset = text_offset + 1
                    should_compact_tail = next_text_offset >= tail_len or (
                        next_text_offset >= _TRAILING_TEXT_COMPACT_MIN_FRAMES and next_text_offset * 2 >= tail_len
                    )
                    if should_compact_tail:
                        if next_text_offset >= tail_len:
                            trailing_text_update = torch.empty((0, tail.shape[1]), device=tail.device, dtype=tail.dtype)
                        else:
                            trailing_text_update = tail[next_text_offset:].contiguous()
                        next_text_offset = 0
                else:
                    text_step = tts_pad_embed
                    next_text_offset = 0
                    if tail.numel() > 0:
                        trailing_text_update = torch.empty((0, tail.shape[1]), device=tail.device, dtype=tail.dtype)
            else:
                text_step = tts_pad_embed
                next_text_offset = text_offset

            text_step_list.append(text_step)
            info_update: dict[str, Any] = {
                "meta": {
                    "talker_text_offset": int(next_text_offset),
                    "codec_streaming": codec_streaming,
                },
            }
            if not eager:
                # Eager frames finished MTP last step: no hidden input or row validity needed.
                last_hidden = hs.get("last")
                if isinstance(last_hidden, torch.Tensor):
                    past_hidden = last_hidden.to(device=device, dtype=dtype).reshape(1, -1)
                else:
                    # Match scalar preprocess(): EOS / async-scheduling races can
                    # arrive before postprocess has written last; zeros are filtered
                    # downstream the same way as the single-request path.
                    logger.warning_once(
                        "Qwen3-TTS batched decode missing last hidden; zero-filling past_hidden "
                        "to match scalar preprocess()"
                    )
                    past_hidden = torch.zeros_like(text_step)
                past_hidden_list.append(past_hidden)
                info_update["meta"]["codec_frame_valid"] = codec_frame_valid_batch[len(updates)].reshape(())
            if trailing_text_update is not None:
                info_update["hidden_states"] = {"trailing_text": trailing_text_update.detach()}
            updates.append(info_update)

        if input_embeds is None:
            input_embeds = self.embed_input_ids(input_ids_flat.reshape(-1, 1).to(torch.long))
        inputs_embeds_out = input_embeds.to(device=device, dtype=dtype).reshape(len(req_infos), -1)
        text_steps = torch.cat(text_step_list, dim=0)
        return (
            input_ids_flat,
            inputs_embeds_out,
            text_steps if eager else torch.cat(past_hidden_list, dim=0),
            text_steps,
            updates,
        )

    def preprocess_decode_batch_mrv2(
        self,
        *,
        input_ids: torch.Tensor,
        input_embeds: torch.Tensor,
        req_infos: list[dict[str, Any]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
        """Expose the existing TTS decode batcher through the MRv2 contract."""
        return self.preprocess_decode_batch(input_ids=input_ids, req_infos=req_infos, input_embeds=input_embeds)

    def _false_scalar(self, device: torch.device) -> torch.Tensor:
        """A shared read-only ``False`` for prefill frame validity (stored, never written in place)."""
        cache = self.__dict__.setdefault("_false_scalars", {})
        value = cache.get(device)
        if value is None:
            value = cache[device] = torch.zeros((), dtype=torch.bool, device=device)
        return value

    def _zero_codes(self, rows: int, device: torch.device) -> torch.Tensor:
        """Shared read-only zero codec rows for prefill placeholders (stored, never written in place)."""
        cache = self.__dict__.setdefault("_zero_codes_cache", {})
        buf = cache.get(device)
        if buf is None or buf.shape[0] < rows:
            size = max(rows, 1024 if buf is None else 2 * buf.shape[0])
            # Earlier views keep the previous buffer alive.
            buf = cache[device] = torch.zeros(
                (size, int(self.talker_config.num_code_groups)), dtype=torch.long, device=device
            )
        return buf[:rows]

    def mrv2_custom_sampler(self, sampler: Any) -> tuple[Any, None] | None:
        """Sample the Talker's codec row in one kernel (see :mod:`talker_sampler`)."""
        from vllm_omni.model_executor.models.qwen3_tts.talker_sampler import Qwen3TTSTalkerSampler

        wrapped = Qwen3TTSTalkerSampler(sampler, self)
        return (wrapped, None) if wrapped.enabled else None

    def postprocess(self, hidden_states: torch.Tensor, **_: Any) -> dict[str, Any]:
        # Keep the last token hidden for the next decode step's code predictor.
        # Stays on GPU - gpu_resident_buffer_keys avoids the CPU round-trip.
        if hidden_states.numel() == 0:
            return {}
        last = hidden_states[-1, :].detach()
        return {"hidden_states": {"last": last}}

    def postprocess_batch_mrv2(
        self,
        *,
        hidden_states: torch.Tensor,
        last_token_indices: torch.Tensor,
    ) -> tuple[tuple[str, str], OwnedBatchTensor]:
        """Gather every request's Talker tail in one GPU operation.

        ``index_select`` freshly allocates the result, so the batch is marked
        as owned and the intermediate buffer stores row views without taking
        a second snapshot.
        """
        return (
            ("hidden_states", "last"),
            OwnedBatchTensor(hidden_states.index_select(0, last_token_indices)),
        )

    @torch.inference_mode()
    def preprocess_batch(
        self,
        *,
        req_ids: list[str],
        model_intermediate_buffer: dict[str, dict[str, Any]],
        device: torch.device,
    ) -> None:
        """Delegate batched preprocess to :class:`Qwen3TTSPromptEmbedsBuilder`."""
        if self._silence_ban_frames > 0:
            for req_id in req_ids:
                info_dict = model_intermediate_buffer.get(req_id)
                if isinstance(info_dict, dict):
                    self._req_x_vector_only[req_id] = resolve_x_vector_only(info_dict)
        self._prompt_builder.preprocess_batch(
            req_ids=req_ids,
            model_intermediate_buffer=model_intermediate_buffer,
            device=device,
        )

    @torch.inference_mode()
    def preprocess_batch_mrv2(
        self,
        *,
        req_infos: list[dict[str, Any]],
        device: torch.device,
    ) -> None:
        """Batch new MRv2 prefill slots without rebuilding a req-id map."""
        if self._silence_ban_frames > 0:
            for info in req_infos:
                self._req_x_vector_only[info["req_id"]] = resolve_x_vector_only(info)
        self._prompt_builder.preprocess_infos_batch(
            req_infos=req_infos,
            device=device,
        )

    def preprocess_prefill_rows_mrv2(
        self,
        *,
        entries: Sequence[tuple[int, int, dict[str, Any]]],
        input_ids: torch.Tensor,
        input_embeds: torch.Tensor,
    ) -> list[dict[str, Any] | None]:
        """:meth:`preprocess` for many prefill rows in one launch (MRv2).

        ``entries`` are ``(start, num_tokens, info)`` of prefill rows. A first
        chunk whose prompt is a cached CustomVoice prompt (see
        :meth:`Qwen3TTSPromptEmbedsBuilder.custom_voice_prompt_rows`) and any
        later chunk of a stored prompt is written straight into
        ``input_embeds`` / ``input_ids``; its buffer updates are returned, as
        :meth:`preprocess` would. Other rows get ``None`` and take
        :meth:`preprocess`.
        """
        from .prefill_rows import PrefillRows, launch_prefill_rows

        results: list[dict[str, Any] | None] = [None] * len(entries)
        builder = self._prompt_builder
        table = builder._projected_text_table
        dtype = self._embedding_dtype
        device = input_embeds.device
        if (
            table is None
            or table.device != device
            or table.dtype != dtype
            or input_embeds.dtype != dtype
            or input_embeds.stride(-1) != 1
            or not input_ids.is_contiguous()
        ):
            return results
        rows = PrefillRows()
        planned: list[tuple[int, int, int, dict[str, Any], int | None, int]] = []
        for k, (start, span, info) in enumerate(entries):
            if span <= 0 or isinstance(info.get("additional_information"), dict):
                continue
            if not _has_tts_text_conditioning(info, info.get("hidden_states")):
                continue
            stored = (info.get("embed") or {}).get("prefill")
            if isinstance(stored, torch.Tensor) and stored.ndim == 2:
                if stored.dtype == dtype and stored.device == device and stored.is_contiguous():
                    offset = max(0, int((info.get("meta") or {}).get("talker_prefill_offset", 0) or 0))
                    rows.add_stored_prompt(stored.data_ptr(), int(stored.shape[0]), offset, span, start)
                    planned.append((k, span, offset, info, None, 0))
                continue
            # A new speaker's prompt pieces extend the constant table, which is read after this loop.
            resolved = builder.custom_voice_prompt_rows(info)
            if resolved is None:
                continue
            offset = max(0, int(info.get("_omni_num_computed_tokens", 0) or 0))
            first, n = rows.add_new_prompt(resolved[0], resolved[1], offset, span, start)
            planned.append((k, span, offset, info, first, n))
        if not planned:
            return results
        packed = torch.empty(rows.num_packed, input_embeds.shape[-1], dtype=dtype, device=device)
        stager = self.__dict__.get("_prefill_rows_stager")
        if stager is None:
            stager = self._prefill_rows_stager = DeviceStager()
        launch_prefill_rows(
            rows,
            stager(rows.array(), device),
            builder.prompt_row_table(),
            table,
            packed,
            input_embeds,
            input_ids,
            int(self.talker_config.codec_pad_id),
        )
        false_scalar = self._false_scalar(device)
        trailing = None
        for k, span, offset, info, first, n in planned:
            meta = info.get("meta") or {}
            task_type = (info.get("task_type") or ["CustomVoice"])[0]
            update: dict[str, Any] = {
                "meta": {
                    "codec_streaming": self._codec_streaming_flag(meta, task_type),
                    "codec_frame_valid": false_scalar,
                    "talker_prefill_offset": offset + span,
                },
                "codes": {"audio": self._zero_codes(span, device)},
            }
            if first is not None:
                if trailing is None:
                    trailing = builder._pad_embed(device, dtype).squeeze(0)
                update["embed"] = {"prefill": packed[first : first + n]}
                update["hidden_states"] = {"trailing_text": trailing}
                update["meta"]["talker_text_offset"] = 0
            if self._silence_ban_frames > 0:
                # As preprocess_batch_mrv2 does for the prefill rows it is given.
                self._req_x_vector_only[info["req_id"]] = resolve_x_vector_only(info)
            results[k] = update
        return results

    @staticmethod
    def _codec_streaming_flag(meta: dict[str, Any], task_type: str) -> bool:
        value = meta.get("codec_streaming")
        if isinstance(value, list):
            value = value[0] if value else None
        return value if isinstance(value, bool) else task_type == "Base"

    @contextmanager
    def mrv2_sampling_context(self, *, req_ids: list[str], num_output_tokens: torch.Tensor) -> Iterator[None]:
        """Scope the silence gate to sampling, never prompt-logprob computation."""
        self.set_batch_req_ids(req_ids)
        self._mrv2_silence_ban_mask = None
        if self._silence_ban_frames > 0:
            in_scope = torch.tensor(
                [self._req_x_vector_only.get(req_id) is True for req_id in req_ids],
                device=num_output_tokens.device,
                dtype=torch.bool,
            )
            self._mrv2_silence_ban_mask = (in_scope & (num_output_tokens < self._silence_ban_frames)).unsqueeze(1)
        try:
            yield
        finally:
            self._mrv2_silence_ban_mask = None

    def set_batch_req_ids(self, req_ids: Sequence[str]) -> None:
        """Record the current batch's req_ids, in the order that indexes logits.

        Called by the runner after the forward and before ``compute_logits``,
        with the same ``input_batch`` ordering that ``sampling_metadata``
        uses. Doubles as the eviction point: any request no longer in the batch
        has finished or been aborted, so its recorded mode is dropped.
        """
        self._batch_req_ids = list(req_ids)
        if len(self._req_x_vector_only) > len(self._batch_req_ids):
            live = set(self._batch_req_ids)
            self._req_x_vector_only = {k: v for k, v in self._req_x_vector_only.items() if k in live}

    def _encode_ref_audio_batch(self, wavs: list[np.ndarray], sr: int, *, device: torch.device) -> list[torch.Tensor]:
        fe = self._encoder_feature_extractor
        target_sr = int(fe.sampling_rate)
        if int(sr) != target_sr:
            resampler = AudioResampler(target_sr=target_sr)
            wavs = [resampler.resample(w.astype(np.float32), orig_sr=int(sr)) for w in wavs]

        inputs = fe(
            raw_audio=wavs,
            sampling_rate=target_sr,
            return_tensors="pt",
        )
        input_values = inputs["input_values"].squeeze(1).to(device=device, dtype=torch.bfloat16)
        downsample = self._encoder_downsample_rate
        valid_code_lengths = [(int(wav.size) + downsample - 1) // downsample for wav in wavs]

        with torch.inference_mode():
            encoded = self.encoder.encode(
                input_values=input_values.unsqueeze(1),
                num_quantizers=self._encoder_valid_num_quantizers,
                return_dict=True,
            )

        audio_codes = encoded.audio_codes[:, : self._encoder_valid_num_quantizers]
        return [
            code[:, : int(valid_len)].transpose(0, 1).to(dtype=torch.long).contiguous()
            for code, valid_len in zip(audio_codes, valid_code_lengths, strict=True)
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self._prompt_builder._projected_token_cache.clear()
        # Consume talker weights, and conditionally consume speaker encoder
        # weights only if they are present in the checkpoint.
        speaker_weights: list[tuple[str, torch.Tensor]] = []

        def _talker_and_collect_speaker(ws: Iterable[tuple[str, torch.Tensor]]):
            for k, v in ws:
                if k.startswith("speaker_encoder."):
                    speaker_weights.append((k, v))
                    continue
                if k.startswith("talker."):
                    yield k, v

        loader = AutoWeightsLoader(self)
        loaded = loader.load_weights(_talker_and_collect_speaker(weights), mapper=self.hf_to_vllm_mapper)

        if speaker_weights:
            # speaker_encoder module is already constructed in __init__; here we
            # only copy checkpoint tensors into its existing parameters.
            loaded |= loader.load_weights(speaker_weights, mapper=self.hf_to_vllm_mapper)
        else:
            # Some checkpoints do not include speaker_encoder weights; keep the
            # eagerly initialized module and satisfy the strict loader check.
            loaded |= {name for name, _ in self.named_parameters() if name.startswith("speaker_encoder.")}
        # Load speech tokenizer encoder weights from speech_tokenizer/
        # subfolder.  Skip decoder weights — the Talker only uses the
        # encoder for ref_audio encoding.
        model_loader = DefaultModelLoader(self.vllm_config.load_config)
        source = DefaultModelLoader.Source(
            model_or_path=self.model_path,
            revision=self.vllm_config.model_config.revision,
            subfolder="speech_tokenizer",
        )
        subfolder_weights = model_loader._get_weights_iterator(source)
        enc_loaded = AutoWeightsLoader(self).load_weights(
            subfolder_weights, mapper=WeightsMapper(orig_to_new_prefix={"decoder.": None})
        )
        loaded |= enc_loaded

        # AutoWeightsLoader only loads parameters; the encoder's VQ
        # codebook state (embed, embed_sum, cluster_usage, initialized)
        # are registered as buffers. Load them from the checkpoint
        # directly so the quantizer produces correct codes.
        encoder_buffers = dict(self.encoder.named_buffers())
        source2 = DefaultModelLoader.Source(
            model_or_path=self.model_path,
            revision=self.vllm_config.model_config.revision,
            subfolder="speech_tokenizer",
        )
        for name, tensor in model_loader._get_weights_iterator(source2):
            if not name.startswith("encoder."):
                continue
            buf_name = name[len("encoder.") :]
            if buf_name in encoder_buffers:
                encoder_buffers[buf_name].copy_(tensor)
                loaded.add(name)

        device = self.vllm_config.device_config.device
        self.encoder.to(device=device, dtype=torch.bfloat16)

        self._init_runtime_buffers()
        self._init_silence_mask()

        logger.info("Loaded %d weights for Qwen3TTSTalkerForConditionalGeneration", len(loaded))
        self._build_stacked_codec_embed()
        # The table costs ~0.6 GB at 1.7B and is used by the fused MRv2 prefill path.
        if self._use_v2_model_runner and self.stream_decode:
            self._prompt_builder.build_projected_text_table()
        if talker_first_audio_enabled(self.vllm_config):
            from .first_frame_decoder import Qwen3TTSFirstFrameDecoder

            self.first_frame_decoder = Qwen3TTSFirstFrameDecoder(self.model_path)
            decoder_loaded = self.first_frame_decoder.load(self.vllm_config)
            loaded = set(loaded) | {f"first_frame_decoder.{name}" for name in decoder_loaded}
        elif self.stream_decode:
            # The in-stage decoder owns every frame. Optional first-audio
            # delivery uses its PCM; later chunks use regular step outputs.
            from .first_frame_decoder import Qwen3TTSFirstFrameDecoder
            from .tokenizer_12hz.streaming_decoder import StreamingCodecDecoder

            holder = Qwen3TTSFirstFrameDecoder(self.model_path)
            decoder_loaded = holder.load(self.vllm_config)
            loaded = set(loaded) | {f"stream_decoder.{name}" for name in decoder_loaded}
            slots = int(self.vllm_config.scheduler_config.max_num_seqs)
            self.stream_decoder = StreamingCodecDecoder(holder.decoder, num_slots=slots, dtype=torch.bfloat16)
            self.stream_sample_rate = int(holder.sample_rate)
            logger.info("Qwen3-TTS Talker stream decode enabled (%d slots)", slots)
        return loaded

    def capture_stream_decode_graphs(self, batch_sizes: list[int]) -> None:
        if self.stream_decoder is None or self.stream_graphs is not None:
            return
        from .tokenizer_12hz.streaming_decoder import StreamingDecodeGraphs

        with torch.inference_mode():
            self.stream_graphs = StreamingDecodeGraphs(self.stream_decoder, batch_sizes)
            frames = min(self.stream_ref_context_frames, self.stream_chunk_frames, self.stream_decoder.max_frames)
            if self.config.tts_model_type == "base" and frames > 1:
                # Bound the multi-frame graph workspace by the configured
                # token budget; larger priming groups keep the eager path.
                tokens = self.vllm_config.scheduler_config.max_num_batched_tokens

                def prime_sizes(f: int) -> list[int]:
                    return sorted({1, *(size for size in batch_sizes if size <= max(1, tokens // f))})

                self.stream_prime_graphs = StreamingDecodeGraphs(
                    self.stream_decoder, prime_sizes(frames), frames=frames
                )
                # A reference's last chunk (or a short reference) is decoded as
                # power-of-two pieces instead of one eager call of a few
                # hundred launches. The pieces replay one at a time on the
                # decode stream, so they share the priming graphs' pool.
                piece = 1 << ((frames - 1).bit_length() - 1)
                while piece > 1:
                    self.stream_prime_pieces[piece] = StreamingDecodeGraphs(
                        self.stream_decoder, prime_sizes(piece), frames=piece, pool=self.stream_prime_graphs.pool
                    )
                    piece //= 2
        logger.info("Captured Talker stream decode graphs for batch sizes %s", self.stream_graphs.sizes)
        if self.stream_prime_graphs is not None:
            logger.info(
                "Captured Talker reference priming graphs for %d frames and batch sizes %s (pieces of %s frames)",
                self.stream_prime_graphs.frames,
                self.stream_prime_graphs.sizes,
                sorted(self.stream_prime_pieces),
            )

    def get_stream_ref_context(self, info: OmniPayload) -> torch.Tensor | None:
        """Model-owned reference-code layout and context boundary for a PCM slot."""
        codes = info.get("codes")
        ref = codes.get("ref") if isinstance(codes, dict) else None
        if not isinstance(ref, torch.Tensor) or not ref.numel():
            return None
        return ref.reshape(-1, int(self.talker_config.num_code_groups))[-self.stream_ref_context_frames :]

    def prime_stream_decoder(self, primes: list[tuple[int, torch.Tensor]]) -> None:
        """Prime equal-length reference groups without padding or aliasing live slots."""
        if not primes:
            return
        stream = self.stream_decoder
        if stream is None:
            raise RuntimeError("Reference priming requires the single-stage PCM decoder")
        groups: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for req_idx, ref in primes:
            groups.setdefault(int(ref.shape[0]), []).append((req_idx, ref))
        for items in groups.values():
            codes = to_device_nonblocking(torch.stack([ref for _idx, ref in items]), stream.device).to(torch.int32)
            n = len(items)
            slots = index_to_device([idx for idx, _ref in items], stream.device, dtype=torch.int32)
            graphs = self.stream_prime_graphs
            pieces = self.stream_prime_pieces
            # Graph pieces only help when every piece size covers this group.
            if any(max(piece.sizes) < n for piece in pieces.values()):
                pieces = {}
            for t0 in range(0, int(codes.shape[1]), self.stream_chunk_frames):
                chunk = codes[:, t0 : t0 + self.stream_chunk_frames]
                if graphs is not None and chunk.shape[1] == graphs.frames:
                    splits = [(0, chunk.shape[1], graphs)]
                elif pieces:
                    # Largest power-of-two pieces first; single frames use the per-step graphs.
                    splits, done = [], 0
                    while done < chunk.shape[1]:
                        size = 1 << ((chunk.shape[1] - done).bit_length() - 1)
                        piece = pieces.get(size) or (self.stream_graphs if size == 1 else None)
                        splits.append((done, size, piece or stream))
                        done += size
                else:
                    splits = [(0, chunk.shape[1], stream)]
                for start, size, decode in splits:
                    pos = index_to_device([t0 + start] * n, stream.device, dtype=torch.int32)
                    decode(chunk[:, start : start + size].contiguous(), slots, pos)

    def _build_stacked_codec_embed(self) -> None:
        embeds = self.code_predictor.get_input_embeddings()
        if not embeds:
            return
        w = embeds[0].weight
        self._stacked_codec_embed = torch.stack([e.weight.detach() for e in embeds], dim=0).to(
            device=w.device, dtype=w.dtype
        )

    @torch.no_grad()
    def _init_silence_mask(self) -> None:
        """Derive the silence-region codec vocabulary from the checkpoint.

        Encodes silence at several durations and amplitudes and collects the
        codebook-0 ids the tokenizer emits. These are the tokens the talker draws
        when it produces leading silence (#4966). Derived rather than hardcoded
        because the codec vocabulary is checkpoint-specific.
        """
        if self._silence_ban_frames <= 0:
            return
        device = next(self.parameters()).device
        sr = 24000
        try:
            rng = np.random.RandomState(0)
            wavs = [
                (amp * rng.randn(int(dur * sr))).astype(np.float32)
                for amp in (0.0, 1e-5, 1e-4, 1e-3)
                for dur in (0.3, 0.5, 1.0)
            ]
            codes = self._encode_ref_audio_batch(wavs, sr, device=device)
            ids: set[int] = set()
            for code in codes:
                code = code.detach().cpu()
                cb0 = code[:, 0] if code.ndim == 2 else code
                ids.update(int(t) for t in cb0.tolist())
        except Exception as exc:
            logger.warning("Could not derive the silence codec vocabulary; disabling the ban: %s", exc)
            self._silence_ban_frames = 0
            return
        vocab = int(self.talker_config.vocab_size)
        in_range = sorted(t for t in ids if 0 <= t < vocab)
        num_out_of_range = len(ids) - len(in_range)
        if num_out_of_range:
            # Every derived id should be a codebook-0 index for this checkpoint.
            # Ids outside the talker vocabulary mean the encoder and the talker
            # disagree on vocabulary size, so the rest of the derivation is not
            # trustworthy either.
            logger.warning(
                "%d of %d derived silence codec tokens fall outside the talker vocabulary "
                "(size %d); disabling the ban.",
                num_out_of_range,
                len(ids),
                vocab,
            )
            self._silence_ban_frames = 0
            return
        if not in_range:
            # An empty derivation would leave an all-False mask: the ban would
            # suppress nothing while still paying the per-frame check.
            logger.warning("Derived no silence codec tokens; disabling the ban.")
            self._silence_ban_frames = 0
            return
        # The silence region is a small corner of codebook 0 (12 tokens on
        # Qwen3-TTS-12Hz-1.7B-Base). A derivation this large means the encode
        # returned speech-like codes, and masking that much of the vocabulary
        # would distort generation rather than trim the onset.
        max_silence_tokens = max(64, vocab // 20)
        if len(in_range) > max_silence_tokens:
            logger.warning(
                "Derived %d silence codec tokens, above the %d sanity limit for a vocabulary of %d; disabling the ban.",
                len(in_range),
                max_silence_tokens,
                vocab,
            )
            self._silence_ban_frames = 0
            return
        mask = torch.zeros((vocab,), dtype=torch.bool)
        for token in in_range:
            mask[token] = True
        self._silence_mask.copy_(mask.to(self._silence_mask.device))
        logger.info(
            "Derived %d silence codec tokens, suppressed for the first %d decode frames: %s",
            len(in_range),
            self._silence_ban_frames,
            in_range,
        )

    @torch.no_grad()
    def _init_runtime_buffers(self) -> None:
        """Populate request-independent runtime buffers from frozen weights.

        Currently this only computes :attr:`_tts_pad_embed`
        (``text_proj(text_emb(tts_pad_token_id))``), which the prefill
        prompt builder and every decode step mix into the input embedding
        in place of an actual text token. The value depends only on the
        ``text_embedding`` / ``text_projection`` weights and is therefore
        the same for every request — computing it once here avoids
        recomputing (and round-tripping through ``info_dict``) on each
        forward call.
        """
        device = next(self.parameters()).device
        pad_ids = torch.tensor([[int(self.config.tts_pad_token_id)]], device=device, dtype=torch.long)
        pad_proj = self.text_projection(self.text_embedding(pad_ids)).reshape(1, -1)
        self._tts_pad_embed.copy_(pad_proj.to(device=self._tts_pad_embed.device, dtype=self._tts_pad_embed.dtype))

    # -------------------- GPU-side MTP fast-path --------------------

    @torch.inference_mode()
    def talker_mtp(
        self,
        input_ids: torch.Tensor,
        input_embeds: torch.Tensor,
        last_talker_hidden: torch.Tensor,
        text_step: torch.Tensor,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        sample_uniforms: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """GPU fast-path used by OmniGPUModelRunner to predict residual codebooks (1..Q-1).
        Returns (inputs_embeds, audio_codes) for the current step."""
        bsz = int(input_ids.shape[0])
        q = int(self.talker_config.num_code_groups)
        dev = input_embeds.device
        dtype = self._embedding_dtype

        input_ids = input_ids.reshape(bsz, 1).to(dtype=torch.long, device=dev)
        last_id_hidden = input_embeds.reshape(bsz, 1, -1).to(dtype=dtype, device=dev)
        past_hidden = last_talker_hidden.reshape(bsz, 1, -1).to(dtype=dtype, device=dev)
        text_step = text_step.reshape(bsz, 1, -1).to(dtype=dtype, device=dev)

        # Residual predictor runs fixed-length steps via the vLLM-native code_predictor.
        max_steps = q - 1
        if max_steps <= 0:
            audio_codes = input_ids.reshape(bsz, 1)
            return (last_id_hidden + text_step).reshape(bsz, -1), audio_codes

        subtalker_params = self._subtalker_sampling_params
        if do_sample is None:
            do_sample = bool(subtalker_params.get("do_sample", True))
        if temperature is None:
            temperature = float(subtalker_params.get("temperature", 0.9))
        if top_k is None:
            top_k = int(subtalker_params.get("top_k", 50))
        if top_p is None:
            top_p = float(subtalker_params.get("top_p", 1.0))

        audio_codes = self.code_predictor(
            layer0_code=input_ids.reshape(bsz, 1),
            layer0_embed=last_id_hidden,
            last_talker_hidden=past_hidden,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            generators=generators,
            sample_uniforms=sample_uniforms,
        )  # [B, Q]

        # Map invalid layer-0 ids (e.g. EOS) to PAD=0 so SpeechTokenizer sees only real codes.
        layer0 = audio_codes[:, :1]
        invalid0 = (layer0 < 0) | (layer0 >= int(self._codebook_vocab_size))
        audio_codes = torch.where(invalid0.expand_as(audio_codes), torch.zeros_like(audio_codes), audio_codes)

        # Single gather over stacked [Q-1, V, H] replaces Q-1 serial embedding kernels.
        residual_ids_t = audio_codes[:, 1:]
        if self._stacked_codec_embed is None:
            self._build_stacked_codec_embed()
        embed_weight = self._stacked_codec_embed.to(device=dev)
        row_idx = torch.arange(max_steps, device=dev).unsqueeze(0).expand(bsz, -1)
        gathered = embed_weight[row_idx, residual_ids_t]
        summed = (last_id_hidden.squeeze(1) + gathered.sum(dim=1)).unsqueeze(1)
        inputs_embeds_out = (summed + text_step).reshape(bsz, -1)
        return inputs_embeds_out, audio_codes.to(dtype=torch.long)

    # MRV2 capability names read the V1 canonical values so platform patches
    # such as the NPU 310P graph-safety override apply to both runners.
    mtp = talker_mtp
    get_mtp_seed = staticmethod(get_tts_local_seed)

    # Postprocess only stores the last hidden for the deferred decode MTP.
    eager_frames_need_postprocess = False

    def eager_decode_settled(self, info: dict[str, Any]) -> bool:
        """Decode preprocess is a no-op for this row: its trailing text is spent.

        From then on every decode step feeds the frame embedding plus the pad
        text step and changes no per-request state (the non-streaming
        CustomVoice/VoiceDesign case after the first decode).
        """
        hs = info.get("hidden_states")
        tail = hs.get("trailing_text") if isinstance(hs, dict) else None
        meta = info.get("meta")
        offset = meta.get("talker_text_offset", 0) if isinstance(meta, dict) else 0
        return isinstance(tail, torch.Tensor) and tail.numel() == 0 and not offset

    def eager_settled_text_step(self) -> torch.Tensor:
        return self._tts_pad_embed.reshape(1, -1)

    def capture_first_frame_graphs(self) -> None:
        # Set by load_weights when talker_first_audio_enabled accepts the connector option.
        decoder = getattr(self, "first_frame_decoder", None)
        if decoder is not None:
            decoder.capture()

    def mtp_frame_valid(self, layer0: torch.Tensor) -> torch.Tensor:
        """Rows whose CB0 is a codec id rather than EOS/special; matches decode preprocess."""
        return (layer0 >= 0) & (layer0 < self._codebook_vocab_size)

    @property
    def mtp_output_key(self) -> tuple[str, str]:
        return self.talker_mtp_output_key

    @property
    def mtp_graph_safe(self) -> bool:
        return self.talker_mtp_graph_safe

    @property
    def mtp_accepts_per_row_generators(self) -> bool:
        return self.talker_mtp_accepts_per_row_generators
