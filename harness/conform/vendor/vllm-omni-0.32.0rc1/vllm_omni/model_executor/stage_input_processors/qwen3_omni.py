# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
# Copyright 2025 The Qwen team.
"""Stage input processor for Qwen3 Omni MoE: Thinker → Talker transition."""

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from vllm.inputs import TextPrompt

from vllm_omni.data_entry_keys import (
    CodesStruct,
    EmbeddingsStruct,
    HiddenStatesStruct,
    IdsStruct,
    MetaStruct,
    OmniPayload,
    OmniPayloadStruct,
    to_dict,
)
from vllm_omni.engine import OmniEngineCoreRequest
from vllm_omni.inputs.data import OmniTokensPrompt
from vllm_omni.model_executor.models.qwen3_omni.tool_speech import TOOL_CALL_START_TOKEN_ID
from vllm_omni.model_executor.stage_input_processors.chunk_size_utils import compute_ramp_emit, parse_chunk_ramp
from vllm_omni.model_executor.stage_input_processors.tts_utils import (
    extract_language_from_prompt,
    extract_language_from_request,
    extract_speaker_from_prompt,
    extract_speaker_from_request,
)

logger = logging.getLogger(__name__)

# Pooling output layer indices (semantic names for clarity)
# Actual layer indices are integers; these functions provide semantic access
# Per-model REPLACE-keys for the full-payload accumulator.  Keys in this
# set use REPLACE semantics (subsequent emissions discard prior chunks)
# instead of CONCAT.  qwen3-omni currently has none — model_outputs is
# not emitted by the thinker/talker forward.
_FULL_PAYLOAD_REPLACE_KEYS: frozenset[str] = frozenset()

_QWEN3_CODEC_CODEBOOK_SIZE = 2048
_QWEN3_CODEC_PAD_TOKEN_ID = 4196
_QWEN3_CODEC_BOS_TOKEN_ID = 4197
_QWEN3_CODEC_EOS_TOKEN_ID = 4198


def _layer_tensor(layers: dict[Any, Any], key: str) -> torch.Tensor | None:
    """Fetch layer tensor with tolerant key lookup (str/int/semantic)."""
    if not isinstance(layers, dict):
        return None
    # Try direct string key first (supports semantic keys like "embedding")
    val = layers.get(key)
    if val is None:
        # Try converting to int for backward compatibility with numeric string keys
        try:
            key_int = int(key)
            val = layers.get(key_int)
        except (ValueError, TypeError):
            pass
    return val if isinstance(val, torch.Tensor) else None


def _get_embedding_layer_index() -> int:
    """Return the layer index for word embeddings (always layer 0)."""
    return 0


def _get_accept_hidden_layer_index(transfer_manager: Any) -> int:
    """Read accept_hidden_layer index from model config."""
    if hasattr(transfer_manager, "_get_model_config"):
        mc = transfer_manager._get_model_config()
    else:
        mc = getattr(transfer_manager, "config", None)
    return int(mc.hf_config.talker_config.accept_hidden_layer)


# Set once chunk 0 carried the first generated token taken from the prefill
# sample: from then on each chunk carries the token its step sampled.
_SAMPLED_TEXT_STREAM = "_qwen3_omni_sampled_text_stream"
# Lives in ``request_payload``, which sender and MRv2 cleanup already drop.
# A later decode embed is a tool-call token and must not be spoken.
_TOOL_SPEECH_CUT = "_qwen3_tool_speech_cut"


def _is_final_token(request: Any) -> bool | None:
    """Whether the token sampled last ends the Thinker's turn (``None``: unknown)."""
    output_token_ids = _ensure_list(getattr(request, "output_token_ids", None) or [])
    count = getattr(request, "output_token_count", None)
    count = len(output_token_ids) if count is None else count
    token = getattr(request, "last_output_token_id", None)
    if token is None and output_token_ids:
        token = output_token_ids[-1]
    if token is None or count == 0:
        return None
    params = getattr(request, "sampling_params", None)
    stop_ids = getattr(params, "all_stop_token_ids", None) or getattr(params, "stop_token_ids", None) or ()
    max_tokens = getattr(params, "max_tokens", None)
    return token in stop_ids or (max_tokens is not None and count >= max_tokens)


def _tool_speech_is_cut(transfer_manager: Any, request_id: Any) -> bool:
    if not isinstance(request_id, str):
        return False
    state = transfer_manager.request_payload.get(request_id)
    return isinstance(state, dict) and state.get(_TOOL_SPEECH_CUT) is True


def _mark_tool_speech_cut(transfer_manager: Any, request_id: Any) -> None:
    if not isinstance(request_id, str):
        return
    state = transfer_manager.request_payload.get(request_id)
    if isinstance(state, dict) and "embed" not in state:
        state[_TOOL_SPEECH_CUT] = True
        return
    transfer_manager.request_payload[request_id] = {_TOOL_SPEECH_CUT: True}


def _clear_tool_speech_cut(transfer_manager: Any, request_id: Any) -> None:
    if not isinstance(request_id, str):
        return
    state = transfer_manager.request_payload.get(request_id)
    if not isinstance(state, dict):
        return
    state.pop(_TOOL_SPEECH_CUT, None)
    if not state:
        transfer_manager.request_payload.pop(request_id, None)


def _sampled_token_is_tool_call(request: Any) -> bool:
    """True when the token this step sampled is ``<tool_call>``."""
    last = getattr(request, "last_output_token_id", None)
    return type(last) is int and last == TOOL_CALL_START_TOKEN_ID


def _output_reaches_tool_call(request: Any) -> bool:
    """True once this step's Thinker sample is ``<tool_call>`` or after it."""
    output_token_ids = _ensure_list(getattr(request, "output_token_ids", None) or [])
    if TOOL_CALL_START_TOKEN_ID in output_token_ids:
        return True
    return _sampled_token_is_tool_call(request)


def _sampled_token_embed(thinker_embed: Mapping[str, Any], request: Any) -> torch.Tensor | None:
    """Embedding of the token this step sampled, when published and not final.

    The Talker is fed the embeddings of the Thinker's generated tokens except
    the final one (a stop token, or the last one ``max_tokens`` allows), which
    no forward ever processes. For any other token the published embedding is
    exactly what the next step's layer-0 capture holds, one step later.
    """
    sampled = thinker_embed.get("sampled")
    if not isinstance(sampled, torch.Tensor) or sampled.dim() != 2 or sampled.shape[0] != 1:
        return None
    if getattr(request, "resumable", False) or _is_final_token(request) is not False:
        return None
    return sampled.detach().cpu()


def _compute_talker_prompt_ids_length(info: OmniPayload, device: torch.device | str = "cuda") -> int:
    im_start_token_id = 151644
    system_token_id = 8948
    user_token_id = 872
    assistant_token_id = 77091

    ids = info.get("ids", {})
    thinker_sequences = torch.tensor(ids["all"], dtype=torch.long, device=device).unsqueeze(0)  # [1, T]

    input_ids = torch.tensor(ids["prompt"], dtype=torch.long, device=device).unsqueeze(0)  # [1, T]

    im_start_indexes = torch.cat(
        [
            torch.nonzero(input_ids[0] == im_start_token_id).squeeze(1),
            torch.tensor([thinker_sequences.shape[-1]], device=input_ids.device, dtype=input_ids.dtype),
        ],
        dim=0,
    )

    sum_user_len = 0
    assistant_len = 0
    for i in range(len(im_start_indexes) - 1):
        s = int(im_start_indexes[i].item())
        e = int(im_start_indexes[i + 1].item())
        role = int(input_ids[0, s + 1].item())
        if role == system_token_id:
            continue
        elif role == user_token_id:
            sum_user_len += e - s
        elif role == assistant_token_id and i == len(im_start_indexes) - 2:
            assistant_len += 9  # 3 + 4 + 1 + 1
        else:
            pass

    return sum_user_len + assistant_len


# =========================
# Common helpers
# =========================


def _ensure_list(x):
    """Convert ConstantList / tensor-like to Python list."""
    if hasattr(x, "_x"):
        return list(x._x)
    elif not isinstance(x, list):
        return x
    return list(x)


def _as_tensor_or_none(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return value[0].detach().cpu()
    return None


def _is_valid_qwen3_codec_token_id(token_id: Any) -> bool:
    try:
        token_id = int(token_id)
    except (TypeError, ValueError):
        return False
    return 0 <= token_id < _QWEN3_CODEC_CODEBOOK_SIZE


def _extract_qwen3_full_payload_codec_rows(
    code_predictor_codes: torch.Tensor,
    output_token_ids: list[int],
) -> tuple[torch.Tensor, dict[str, int]]:
    """Filter full-payload codec rows by the authoritative output ids."""
    if code_predictor_codes.ndim != 2 or code_predictor_codes.numel() == 0:
        return code_predictor_codes, {
            "raw_rows": int(code_predictor_codes.shape[0]) if code_predictor_codes.ndim > 0 else 0,
            "aligned_rows": 0,
            "valid_rows": 0,
            "trailing_placeholder_count": 0,
        }

    trailing_placeholder_count = 0
    while (
        trailing_placeholder_count < len(output_token_ids) and output_token_ids[-1 - trailing_placeholder_count] == -1
    ):
        trailing_placeholder_count += 1

    aligned_len = min(int(code_predictor_codes.shape[0]), len(output_token_ids))
    if aligned_len <= 0:
        return code_predictor_codes[:0], {
            "raw_rows": int(code_predictor_codes.shape[0]),
            "aligned_rows": 0,
            "valid_rows": 0,
            "trailing_placeholder_count": trailing_placeholder_count,
        }

    aligned_rows = code_predictor_codes[-aligned_len:]
    aligned_token_ids = output_token_ids[-aligned_len:]
    aligned_token_mask = torch.tensor(
        [_is_valid_qwen3_codec_token_id(token_id) for token_id in aligned_token_ids],
        dtype=torch.bool,
        device=aligned_rows.device,
    )
    row_valid_mask = (aligned_rows.max(dim=1).values < _QWEN3_CODEC_CODEBOOK_SIZE) & (
        aligned_rows.min(dim=1).values >= 0
    )
    filtered_rows = aligned_rows[aligned_token_mask & row_valid_mask]
    if filtered_rows.numel() == 0:
        filtered_rows = aligned_rows[:0]
    return filtered_rows, {
        "raw_rows": int(code_predictor_codes.shape[0]),
        "aligned_rows": aligned_len,
        "valid_rows": int(filtered_rows.shape[0]) if filtered_rows.ndim > 0 else 0,
        "trailing_placeholder_count": trailing_placeholder_count,
    }


# =========================
# Streaming input helpers
# =========================


def _construct_thinker2talker_streaming_input_async_chunk(
    is_finished: bool,
    request,
    thinker_emb,
    thinker_hid,
    transfer_manager,
) -> OmniPayloadStruct | None:
    """Build Thinker -> Talker payloads for realtime streaming input chunks.

    A resumable realtime request reuses the same logical request id across
    audio segments. The first streaming prefill chunk is cached and returns ``None`` so the
    connector does not emit an incomplete downstream chunk. The following
    decode chunk flushes that cached prefill together with the current Thinker
    output, keeping Talker ids and tensor rows aligned.
    """
    request_id = request.external_req_id
    output_token_ids = request.output_token_ids
    # Convert ConstantList to regular list for OmniSerializer serialization
    output_token_ids = _ensure_list(output_token_ids)
    speaker = extract_speaker_from_request(request)
    language = extract_language_from_request(request)
    finished = torch.tensor(is_finished, dtype=torch.bool)
    emb_cpu = thinker_emb.detach().cpu()
    hid_cpu = thinker_hid.detach().cpu()

    if output_token_ids:
        if thinker_emb.shape[0] > 1:
            # A new prompt segment is speech again. The model prefill still
            # drops a <tool_call> token inside that segment.
            _clear_tool_speech_cut(transfer_manager, request.external_req_id)
        else:
            # Captured mode: this row is the token processed on this step,
            # which is the one sampled on the previous step. The step that
            # samples <tool_call> still carries the last spoken token.
            external_req_id = request.external_req_id
            if _tool_speech_is_cut(transfer_manager, external_req_id):
                return None
            if _output_reaches_tool_call(request):
                _mark_tool_speech_cut(transfer_manager, external_req_id)
        if thinker_emb.shape[0] > 1:
            # if thinker_emb.shape[0] > 1, new streaming input segment is added
            # and will transfer prefill embeddings and hidden states to talker.
            new_prompt_len = thinker_emb.shape[0]
            payload = OmniPayloadStruct(
                meta=MetaStruct(finished=finished),
                embed=EmbeddingsStruct(prefill=emb_cpu),
                hidden_states=HiddenStatesStruct(output=hid_cpu),
                ids=IdsStruct(
                    all=_ensure_list(request.all_token_ids[-new_prompt_len - 1 :]),
                    prompt=_ensure_list(request.prompt_token_ids[-new_prompt_len:]),
                ),
                speaker=speaker,
                language=language,
            )
            transfer_manager._pending_streaming_prefills[request_id] = to_dict(payload)
            return None
        else:
            save_payload = transfer_manager._pending_streaming_prefills.pop(request_id, None)
            if save_payload is not None:
                saved_prefill = save_payload.get("embed", {}).get("prefill")
                saved_output = save_payload.get("hidden_states", {}).get("output")
                if isinstance(saved_prefill, torch.Tensor) and isinstance(saved_output, torch.Tensor):
                    return OmniPayloadStruct(
                        meta=MetaStruct(finished=finished),
                        embed=EmbeddingsStruct(prefill=torch.cat((saved_prefill, emb_cpu), dim=0)),
                        hidden_states=HiddenStatesStruct(output=torch.cat((saved_output, hid_cpu), dim=0)),
                        ids=IdsStruct(
                            all=save_payload.get("ids", {}).get("all"),
                            prompt=save_payload.get("ids", {}).get("prompt"),
                        ),
                        speaker=speaker,
                        language=language,
                    )
            return OmniPayloadStruct(
                meta=MetaStruct(
                    finished=finished,
                ),
                embed=EmbeddingsStruct(decode=emb_cpu),
                hidden_states=HiddenStatesStruct(output=hid_cpu),
                ids=IdsStruct(output=output_token_ids),
                speaker=speaker,
                language=language,
            )
    else:
        if not is_finished:
            # do not send async chunk mode placeholder token or embedding/hidden of the stop token
            return None
        return OmniPayloadStruct(
            meta=MetaStruct(finished=finished),
            embed=EmbeddingsStruct(decode=emb_cpu),
            hidden_states=HiddenStatesStruct(output=hid_cpu),
            speaker=speaker,
            language=language,
        )


@dataclass
class _Thinker2TalkerStreamingState:
    last_prompt_len: int = 0
    last_output_len: int = 0
    merged_sequences: list[int] = field(default_factory=list)


@dataclass
class _Qwen3OmniStreamingState:
    thinker2talker: _Thinker2TalkerStreamingState = field(default_factory=_Thinker2TalkerStreamingState)
    talker2code2wav_last_seq_len: int = 0


def _get_qwen3_streaming_state(
    request_id: str,
    streaming_context: Any | None,
) -> _Qwen3OmniStreamingState:
    bridge_states = getattr(streaming_context, "bridge_states", None)
    assert bridge_states is not None
    per_model_state = bridge_states.setdefault("qwen3_omni", {})
    state = per_model_state.get(request_id)
    if state is None:
        state = _Qwen3OmniStreamingState()
        per_model_state[request_id] = state
    return state


def _get_streaming_talker_tokens(
    request_id: str,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    new_prompt_len_snapshot: int | None = None,
    streaming_context: Any | None = None,
    *,
    clear_state: bool = False,
) -> tuple[list[int], list[int]]:
    """Return prompt/output token deltas for the current streaming segment.

    In non-async-chunk streaming, Thinker's prompt may already include the
    next input segment. Remove that new prompt tail before building the Talker
    delta for the previous segment.

    Returns:
        inc_prompt: prompt token delta for this segment.
        inc_output: output token delta for this segment.
    """
    state = _get_qwen3_streaming_state(request_id, streaming_context).thinker2talker
    if new_prompt_len_snapshot:
        prompt_token_ids = prompt_token_ids[:-new_prompt_len_snapshot]
    cur_prompt_len = len(prompt_token_ids)
    cur_output_len = len(output_token_ids)

    inc_prompt = prompt_token_ids[state.last_prompt_len :]
    inc_output = output_token_ids[state.last_output_len :]

    state.last_prompt_len = cur_prompt_len
    state.last_output_len = cur_output_len

    if clear_state:
        state.last_prompt_len = 0
        state.last_output_len = 0
        state.merged_sequences.clear()

    return inc_prompt, inc_output


def _get_streaming_codec_delta_len(
    cur_seq_len: int,
    request_id: str,
    talker_output: Any,
    streaming_context: Any | None = None,
) -> int:
    """Return newly added seq_len for talker->code2wav in streaming mode."""
    state = _get_qwen3_streaming_state(request_id, streaming_context)
    prev_seq_len = state.talker2code2wav_last_seq_len
    seq_len = cur_seq_len - prev_seq_len
    state.talker2code2wav_last_seq_len = cur_seq_len + 1
    if bool(getattr(talker_output, "finished", False)):
        # Final segment: clear history to avoid cross-session carry-over.
        state.talker2code2wav_last_seq_len = 0
    return seq_len


# =========================
# Thinker -> Talker
# =========================


def thinker2talker_async_chunk(
    transfer_manager: Any,
    multimodal_output: OmniPayload | dict[str, Any],
    request: OmniEngineCoreRequest,
    is_finished: bool = False,
) -> OmniPayloadStruct | None:
    """
    Process thinker outputs to create talker inputs.
    1. thinker's text generation outputs (token IDs + hidden states)
    2. Split hidden states into: prompt embeddings + generated embeddings
    3. Package for talker with additional information
    """

    request_id = request.external_req_id
    chunk_id = transfer_manager.put_req_chunk[request_id]
    if not isinstance(multimodal_output, Mapping):
        logger.debug("thinker2talker_async_chunk: skip non-dict multimodal_output for req=%s", request_id)
        return None

    thinker_hs = multimodal_output.get("hidden_states", {})
    thinker_layers = cast(Mapping[int | str, Any], thinker_hs.get("layers", {}) if isinstance(thinker_hs, dict) else {})
    thinker_embed_raw = multimodal_output.get("embed", {})
    thinker_embed = thinker_embed_raw if isinstance(thinker_embed_raw, dict) else {}

    embedding_idx = _get_embedding_layer_index()
    accept_hidden_idx = _get_accept_hidden_layer_index(transfer_manager)

    # Remap numeric layer indices to semantic keys; use explicit None checks
    # because multi-element tensors raise on boolean evaluation.
    emb_val = thinker_layers.get(embedding_idx)
    if emb_val is None:
        emb_val = thinker_layers.get(str(embedding_idx))
    hid_val = thinker_layers.get(accept_hidden_idx)
    if hid_val is None:
        hid_val = thinker_layers.get(str(accept_hidden_idx))
    semantic_layers = {
        "embedding": emb_val,
        "accept_hidden": hid_val,
    }
    thinker_emb = _layer_tensor(semantic_layers, "embedding")
    thinker_hid = _layer_tensor(semantic_layers, "accept_hidden")
    if thinker_emb is None or thinker_hid is None:
        logger.debug(
            "thinker2talker_async_chunk: missing thinker layers for req=%s "
            "(embedding_layer=%d:%s accept_hidden_layer=%d:%s)",
            request_id,
            embedding_idx,
            thinker_emb is not None,
            accept_hidden_idx,
            thinker_hid is not None,
        )
        return None
    speaker = extract_speaker_from_request(request)
    language = extract_language_from_request(request)

    def _maybe_cpu(t: Any) -> torch.Tensor | None:
        return t.detach().cpu() if isinstance(t, torch.Tensor) else None

    if chunk_id == 0:
        all_token_ids = _ensure_list(request.all_token_ids)
        prompt_token_ids = _ensure_list(request.prompt_token_ids)
        payload = OmniPayloadStruct(
            embed=EmbeddingsStruct(
                prefill=thinker_emb.detach().cpu(),
                tts_bos=_maybe_cpu(thinker_embed.get("tts_bos")),
                tts_eos=_maybe_cpu(thinker_embed.get("tts_eos")),
                tts_pad=_maybe_cpu(thinker_embed.get("tts_pad")),
            ),
            hidden_states=HiddenStatesStruct(output=thinker_hid.detach().cpu()),
            ids=IdsStruct(all=all_token_ids, prompt=prompt_token_ids),
            meta=MetaStruct(finished=torch.tensor(is_finished, dtype=torch.bool)),
            speaker=speaker,
            language=language,
        )
        assert payload.embed is not None and payload.embed.prefill is not None
        assert payload.hidden_states is not None and payload.hidden_states.output is not None
        save_payload = transfer_manager.request_payload.pop(request_id, None)
        if isinstance(save_payload, dict) and "embed" not in save_payload:
            # Handoff flags are not a withheld prefill. A new chunk 0 is a new
            # request generation; cleanup also drops this entry.
            save_payload = None
        if save_payload is not None:
            payload.embed.prefill = torch.cat(
                (save_payload.get("embed", {}).get("prefill"), payload.embed.prefill), dim=0
            )
            payload.hidden_states.output = torch.cat(
                (save_payload.get("hidden_states", {}).get("output"), payload.hidden_states.output), dim=0
            )
        if not is_finished and payload.embed.prefill.shape[0] == len(prompt_token_ids):
            # The Talker prompt ends with the first generated token's embedding,
            # which the next decode step would capture; take it from the
            # prefill step's sample instead when the producer published it.
            first_token_embed = _sampled_token_embed(thinker_embed, request)
            # The sample is this step's token. Append a spoken preface token;
            # a <tool_call> token is the end of speech, not the first word.
            if first_token_embed is not None and not _sampled_token_is_tool_call(request):
                payload.embed.prefill = torch.cat((payload.embed.prefill, first_token_embed), dim=0)
                transfer_manager.request_payload[request_id] = {_SAMPLED_TEXT_STREAM: True}
            elif _sampled_token_is_tool_call(request):
                _mark_tool_speech_cut(transfer_manager, request_id)
        # Captured mode can merge the held prompt with one spoken token before
        # the equality above runs. That sample may already be <tool_call>.
        # Mark the boundary and release the captured preface; do not append
        # the marker. After chunk 0 the data plane omits token history, so
        # the flag is the only thing that stops the marker and the JSON.
        if _sampled_token_is_tool_call(request):
            _mark_tool_speech_cut(transfer_manager, request_id)
        # A <tool_call> first token must still release the prompt prefill.
        # Holding it would keep chunk_id at 0 and append later tool tokens.
        if (
            not is_finished
            and payload.embed.prefill.shape[0] <= len(prompt_token_ids)
            and not _tool_speech_is_cut(transfer_manager, request_id)
        ):
            transfer_manager.request_payload[request_id] = to_dict(payload)
            return None
    else:
        if request.resumable:
            return _construct_thinker2talker_streaming_input_async_chunk(
                is_finished, request, thinker_emb, thinker_hid, transfer_manager
            )
        # Decode embeds have no token ids. A sampled stream's payload is the
        # token just sampled, so <tool_call> is dropped on this step. A
        # captured stream's payload is still the previous spoken token.
        already_cut = _tool_speech_is_cut(transfer_manager, request_id)
        reached_tool_call = _output_reaches_tool_call(request)
        stream = transfer_manager.request_payload.get(request_id)
        sampled_stream = isinstance(stream, dict) and stream.get(_SAMPLED_TEXT_STREAM)
        if sampled_stream:
            if already_cut or reached_tool_call:
                _mark_tool_speech_cut(transfer_manager, request_id)
                return None
        elif already_cut:
            return None
        elif reached_tool_call:
            _mark_tool_speech_cut(transfer_manager, request_id)
        if sampled_stream:
            # This step's capture was already sent as the previous step's sample.
            sampled = _sampled_token_embed(thinker_embed, request)
            if sampled is None:
                # A partial (including resumed) prefill has no accepted sample.
                # Its captures replay text already sent before preemption.
                raw_sample = thinker_embed.get("sampled")
                if isinstance(raw_sample, torch.Tensor) and raw_sample.numel() == 0:
                    return None
                if _is_final_token(request) is not True and not is_finished:
                    raise RuntimeError(f"Thinker sample embedding missing for request {request_id}")
                # The final token is never part of the text; a finish goes out
                # as the bare finish marker.
                return None
            thinker_emb = sampled
        if thinker_emb.shape[0] > 1:
            logger.warning(
                "Unexpected multiple embeddings in thinker2talker_async_chunk for chunk_id %d: "
                "request_id %s, num_computed_tokens%d %s. Expected shape [1, D].",
                chunk_id,
                request_id,
                request.num_computed_tokens,
                thinker_emb.shape,
            )
            return None
        meta = MetaStruct(finished=torch.tensor(is_finished, dtype=torch.bool))
        payload = OmniPayloadStruct(
            meta=meta,
            embed=EmbeddingsStruct(decode=thinker_emb.detach().cpu()),
            speaker=speaker,
            language=language,
        )
    return payload


def thinker2talker_full_payload(
    transfer_manager: Any,
    pooling_output: dict[str, Any],
    request: OmniEngineCoreRequest,
) -> OmniPayload | None:
    """Pack complete thinker output for the non-async connector path."""
    rid = getattr(request, "request_id", None)
    if not isinstance(pooling_output, Mapping):
        logger.warning(
            "thinker2talker_full_payload: pooling_output not a dict (type=%s) for req=%s; consumer wait gate may hang.",
            type(pooling_output).__name__,
            rid,
        )
        return None

    embedding_idx = _get_embedding_layer_index()
    accept_hidden_idx = _get_accept_hidden_layer_index(transfer_manager)

    # Use semantic keys instead of numeric indices
    layers = {
        "embedding": pooling_output.get(f"hidden_states.layer_{embedding_idx}"),
        "accept_hidden": pooling_output.get(f"hidden_states.layer_{accept_hidden_idx}"),
    }
    thinker_emb = _layer_tensor(layers, "embedding")
    thinker_hid = _layer_tensor(layers, "accept_hidden")
    if thinker_emb is None:
        hidden = pooling_output.get("hidden")
        thinker_emb = hidden if isinstance(hidden, torch.Tensor) else None
    if thinker_emb is None or thinker_hid is None:
        logger.warning(
            "thinker2talker_full_payload: missing thinker tensors for req=%s "
            "(embedding_layer=%d:%s accept_hidden_layer=%d:%s keys=%s); consumer wait gate may hang.",
            rid,
            embedding_idx,
            thinker_emb is not None,
            accept_hidden_idx,
            thinker_hid is not None,
            list(pooling_output.keys()),
        )
        return None

    prompt_token_ids = _ensure_list(getattr(request, "prompt_token_ids", []) or [])
    all_token_ids = _ensure_list(getattr(request, "all_token_ids", None) or [])
    if not all_token_ids:
        output_token_ids = _ensure_list(getattr(request, "output_token_ids", []) or [])
        all_token_ids = list(prompt_token_ids) + list(output_token_ids)

    # Drop the terminal stop-token row only when more than one row was
    # accumulated; trimming a single row would ship 0 conditioning tensors
    # while ids still has tokens and break talker prefill alignment.
    if isinstance(thinker_emb, torch.Tensor) and thinker_emb.shape[0] > 1:
        thinker_emb_prefill = thinker_emb[:-1]
    else:
        thinker_emb_prefill = thinker_emb
    if isinstance(thinker_hid, torch.Tensor) and thinker_hid.shape[0] > 1:
        thinker_hid_prefill = thinker_hid[:-1]
    else:
        thinker_hid_prefill = thinker_hid

    emb_rows = int(thinker_emb_prefill.shape[0]) if isinstance(thinker_emb_prefill, torch.Tensor) else 0
    hid_rows = int(thinker_hid_prefill.shape[0]) if isinstance(thinker_hid_prefill, torch.Tensor) else 0
    if len(all_token_ids) > 0 and (emb_rows == 0 or hid_rows == 0):
        logger.warning(
            "thinker2talker_full_payload: empty thinker conditioning for req=%s "
            "(ids_len=%s embed_rows=%s hidden_rows=%s); withholding payload.",
            rid,
            len(all_token_ids),
            emb_rows,
            hid_rows,
        )
        return None

    payload: OmniPayload = {
        "embed": {
            "prefill": thinker_emb_prefill.detach().cpu(),
            "tts_bos": _as_tensor_or_none(pooling_output.get("embed.tts_bos")),
            "tts_eos": _as_tensor_or_none(pooling_output.get("embed.tts_eos")),
            "tts_pad": _as_tensor_or_none(pooling_output.get("embed.tts_pad")),
        },
        "hidden_states": {"output": thinker_hid_prefill.detach().cpu()},
        "ids": {"all": list(all_token_ids), "prompt": list(prompt_token_ids)},
        "meta": {"finished": torch.tensor(True, dtype=torch.bool)},
    }
    speaker = extract_speaker_from_request(request)
    if speaker is not None:
        payload["speaker"] = speaker
    language = extract_language_from_request(request)
    if language is not None:
        payload["language"] = language
    return payload


def thinker2talker_token_only(
    source_outputs: list[Any],
    prompt: OmniTokensPrompt | TextPrompt | None = None,
    requires_multimodal_data: bool = False,
    streaming_context: Any | None = None,
) -> list[OmniTokensPrompt]:
    """Orchestrator-side placeholder builder for Stage-1 (Talker) when
    ``async_chunk=False``.

    After the communication-layer refactor, this function only allocates a
    placeholder ``prompt_token_ids`` of the correct length so the scheduler can
    reserve KV-cache slots. It does **not** forward bulk tensors.

    Bulk talker conditioning is sent through the connector. Speaker and
    language are also copied from the original prompt so they survive when
    Stage-0 request metadata is unavailable to the connector payload.

    ``prompt`` / ``requires_multimodal_data`` are kept for call-site signature
    compatibility with other orchestrator input processors; they are unused.
    """
    talker_inputs: list[OmniTokensPrompt] = []
    for i, thinker_output in enumerate(source_outputs):
        output = thinker_output.outputs[0]
        req_id = str(getattr(thinker_output, "request_id", f"idx-{i}"))
        prompt_token_ids = _ensure_list(thinker_output.prompt_token_ids)
        output_ids = _ensure_list(output.cumulative_token_ids)
        is_streaming_session = bool(getattr(streaming_context, "enabled", False))
        if is_streaming_session:
            prompt_token_ids, output_ids = _get_streaming_talker_tokens(
                req_id,
                prompt_token_ids,
                output_ids,
                getattr(streaming_context, "new_prompt_len_snapshot", None),
                streaming_context,
                clear_state=bool(getattr(thinker_output, "finished", False)),
            )
        thinker_sequences = prompt_token_ids + output_ids
        thinker_input_ids = prompt_token_ids
        info_for_len: OmniPayload = {"ids": {"all": thinker_sequences, "prompt": thinker_input_ids}}
        prompt_len = _compute_talker_prompt_ids_length(info_for_len, device="cpu")
        # Keep this fallback until the connector reliably preserves voice metadata.
        additional_information = to_dict(
            OmniPayloadStruct(
                speaker=extract_speaker_from_prompt(prompt, index=i),
                language=extract_language_from_prompt(prompt, index=i),
            )
        )
        talker_inputs.append(
            OmniTokensPrompt(
                prompt_token_ids=[0] * prompt_len,
                additional_information=additional_information or None,
                multi_modal_data=None,
                mm_processor_kwargs=None,
            )
        )
    return talker_inputs


# =========================
# Talker -> Code2Wav
# =========================


def _last_codec_row(codes: Any) -> torch.Tensor | None:
    """The last ``[1, Q]`` row of token-major codec codes, or None if there is none."""
    if not isinstance(codes, torch.Tensor) or codes.ndim != 2 or codes.shape[0] == 0:
        return None
    # Own the row: it outlives this step's (batch-wide) output tensor.
    return codes[-1:].to(torch.long).clone()


def talker2code2wav_async_chunk(
    transfer_manager: Any,
    multimodal_output: OmniPayload | dict[str, Any],
    request: OmniEngineCoreRequest,
    is_finished: bool = False,
) -> OmniPayloadStruct | None:
    """
    Multimodal output version.
    """
    request_id = request.external_req_id
    code_predictor_codes = None
    frame_valid = None
    first_audio = False
    if isinstance(multimodal_output, Mapping):
        talker_codes = multimodal_output.get("codes", {})
        if isinstance(talker_codes, dict):
            code_predictor_codes = talker_codes.get("audio")
        meta = multimodal_output.get("meta", {})
        if isinstance(meta, Mapping):
            frame_valid = meta.get("codec_frame_valid")
            flag = meta.get("first_audio", False)
            first_audio = (
                bool(flag.numel() and flag.reshape(-1)[-1].item()) if isinstance(flag, torch.Tensor) else bool(flag)
            )

    if isinstance(frame_valid, torch.Tensor) and frame_valid.numel() > 0:
        # Token-major codes with explicit per-row validity (MRv2 eager
        # frames): a step's frame, if any, is the last row of its span, and a
        # multi-row prefill span carries its first frame there.
        frame = _last_codec_row(code_predictor_codes)
        append_codes = frame is not None and bool(frame_valid.reshape(-1)[-1].item())
        code_predictor_codes = frame
    else:
        # One row per step (V1 and MRv2 deferred frames): all-zero rows are
        # prefill placeholders and a stop-token CB0 marks the post-EOS step.
        sampling_params = getattr(request, "sampling_params", None)
        stop_token_ids = set(getattr(sampling_params, "stop_token_ids", None) or [])
        stop_token_id = getattr(sampling_params, "stop_token_id", None)
        if stop_token_id is not None:
            stop_token_ids.add(stop_token_id)

        append_codes = (
            isinstance(code_predictor_codes, torch.Tensor)
            and code_predictor_codes.numel() > 0
            and bool(code_predictor_codes.any())
        )
        if append_codes:
            assert isinstance(code_predictor_codes, torch.Tensor)
            first_codebook = int(code_predictor_codes[0, 0].item())
            if first_codebook in stop_token_ids:
                logger.debug("skip stop-token codec frame: first_codebook=%s", first_codebook)
                append_codes = False
    if append_codes:
        transfer_manager.code_prompt_token_ids[request_id].append(code_predictor_codes)
    elif not is_finished:
        return None

    connector = getattr(transfer_manager, "connector", None)
    raw_cfg = getattr(connector, "config", {}) or {}
    cfg = raw_cfg.get("extra", raw_cfg) if isinstance(raw_cfg, dict) else {}
    chunk_size_config = int(cfg.get("codec_chunk_frames", 25))
    left_context_size_config = int(cfg.get("codec_left_context_frames", 25))
    configured_initial_chunk_size = int(cfg.get("initial_codec_chunk_frames") or 0)
    # The connector config is fixed for the adapter's lifetime: parse once.
    if not hasattr(transfer_manager, "_qwen3_omni_chunk_ramp"):
        transfer_manager._qwen3_omni_chunk_ramp = parse_chunk_ramp(cfg, steady=chunk_size_config)
    ramp = transfer_manager._qwen3_omni_chunk_ramp

    chunk_id = transfer_manager.put_req_chunk[request_id]
    length = len(transfer_manager.code_prompt_token_ids[request_id])
    if length <= 0:
        return None

    if ramp is not None:
        # Ramp (replaces initial_codec_chunk_frames): chunk i carries ramp[i]
        # new frames, then codec_chunk_frames. Code2Wav decodes statelessly, so
        # every chunk re-sends up to codec_left_context_frames earlier frames.
        # The counter restarts with each segment, like code_prompt_token_ids.
        chunk_index = transfer_manager.ramp_chunk_count.get(request_id, 0)
        emit, context_length = compute_ramp_emit(length, chunk_index, ramp, chunk_size_config, bool(is_finished))
        if not emit or context_length <= 0:
            # Finished on a chunk boundary: the transport sends the finish marker.
            return None
        left_context_size = min(length - context_length, left_context_size_config)
        end_index = left_context_size + context_length
        codes = (
            torch.cat(transfer_manager.code_prompt_token_ids[request_id][-end_index:], dim=0)
            .transpose(0, 1)
            .reshape(-1)
        )
        return OmniPayloadStruct(
            codes=CodesStruct(audio=codes),
            meta=MetaStruct(
                first_audio=torch.tensor(first_audio and chunk_id == 0),
                left_context_size=left_context_size,
                finished=torch.tensor(is_finished, dtype=torch.bool),
            ),
        )

    if configured_initial_chunk_size > 0:
        if chunk_id == 0:
            chunk_size_config = configured_initial_chunk_size
        else:
            length -= configured_initial_chunk_size

    chunk_length = length % chunk_size_config
    if chunk_length != 0 and not is_finished:
        return None

    if is_finished and not append_codes and chunk_length == 0:
        return None

    context_length = chunk_length if chunk_length != 0 else chunk_size_config
    # ensure left context does not exceed available length
    if configured_initial_chunk_size > 0 and chunk_id == 1:
        left_context_size = configured_initial_chunk_size
        end_index = length + configured_initial_chunk_size
    else:
        left_context_size = max(0, min(length - context_length, left_context_size_config))
        end_index = min(length, left_context_size + context_length)

    codes = (
        torch.cat(transfer_manager.code_prompt_token_ids[request_id][-end_index:], dim=0).transpose(0, 1).reshape(-1)
    )

    return OmniPayloadStruct(
        codes=CodesStruct(audio=codes),
        meta=MetaStruct(
            first_audio=torch.tensor(first_audio and chunk_id == 0),
            left_context_size=left_context_size,
            finished=torch.tensor(is_finished, dtype=torch.bool),
        ),
    )


def talker2code2wav_full_payload(
    transfer_manager: Any,
    pooling_output: dict[str, Any],
    request: OmniEngineCoreRequest,
) -> dict[str, Any] | None:
    """Pack complete talker codec output for the non-async connector path."""
    rid = getattr(request, "request_id", None)
    if not isinstance(pooling_output, Mapping):
        logger.warning(
            "talker2code2wav_full_payload: pooling_output not a dict "
            "(type=%s) for req=%s; consumer wait gate may hang.",
            type(pooling_output).__name__,
            rid,
        )
        return None
    code_predictor_codes = pooling_output.get("codes.audio")
    if code_predictor_codes is None:
        codes = pooling_output.get("codes")
        if isinstance(codes, dict):
            code_predictor_codes = codes.get("audio")
    if code_predictor_codes is None:
        logger.warning(
            "talker2code2wav_full_payload: missing codes.audio (keys=%s) for req=%s; consumer wait gate may hang.",
            list(pooling_output.keys()),
            rid,
        )
        return None
    if not isinstance(code_predictor_codes, torch.Tensor):
        code_predictor_codes = torch.as_tensor(code_predictor_codes)
    if code_predictor_codes.numel() == 0:
        logger.warning(
            "talker2code2wav_full_payload: empty codes.audio for req=%s; consumer wait gate may hang.",
            rid,
        )
        return None

    output_token_ids = _ensure_list(getattr(request, "output_token_ids", []) or [])
    raw_shape = tuple(code_predictor_codes.shape)
    code_predictor_codes, codec_stats = _extract_qwen3_full_payload_codec_rows(
        code_predictor_codes.to(torch.long),
        list(output_token_ids),
    )
    if code_predictor_codes.numel() == 0:
        logger.warning(
            "talker2code2wav_full_payload: no valid codec rows after filtering "
            "(raw_shape=%s output_ids_len=%d aligned_rows=%s valid_rows=%s) for req=%s; "
            "consumer wait gate may hang.",
            raw_shape,
            len(output_token_ids),
            codec_stats["aligned_rows"],
            codec_stats["valid_rows"],
            rid,
        )
        return None

    codec_codes = code_predictor_codes.transpose(0, 1).cpu().reshape(-1).tolist()
    logger.debug(
        "talker2code2wav_full_payload: raw_shape=%s output_ids_len=%s aligned_rows=%s "
        "valid_rows=%s placeholders=%s flattened_len=%s pad4196=%s bos4197=%s eos4198=%s",
        raw_shape,
        len(output_token_ids),
        codec_stats["aligned_rows"],
        codec_stats["valid_rows"],
        codec_stats["trailing_placeholder_count"],
        len(codec_codes),
        sum(1 for tid in output_token_ids if tid == _QWEN3_CODEC_PAD_TOKEN_ID),
        sum(1 for tid in output_token_ids if tid == _QWEN3_CODEC_BOS_TOKEN_ID),
        sum(1 for tid in output_token_ids if tid == _QWEN3_CODEC_EOS_TOKEN_ID),
    )
    return {
        "codes": {"audio": codec_codes},
        "meta": {"finished": torch.tensor(True, dtype=torch.bool)},
    }
