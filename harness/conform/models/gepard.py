"""Gepard-1.0's native-AR talker (stage 0), from the real upstream code (the upstream #6179 class).

Hook: ``GepardTalkerForConditionalGeneration.preprocess`` in ``vllm_omni/model_executor/models/gepard/gepard_talker.py``
(0.30.0 and 0.32.0rc1: l.335, the file is unchanged), with ``_ReqInfo.from_hook_kwargs`` (l.55: the runner's
``_omni_is_prefill`` / ``_omni_prompt_len`` / ``_omni_num_computed_tokens``), ``_get_or_create_state`` and
``_is_last_output_token`` it reaches. A prefill span (by the runner's metadata) embeds its ids and injects the speaker
prefix at the placeholder slots, and **resets the request's frame state** (l.354-395: ``frames.clear()``,
``frame_count = 0``; upstream's own comment: "this is a preemption recompute ... Generation restarts from frame 0").
A decode span returns one row, ``curr_embed_for_next``: the embedding of the 32 codes ``forward`` sampled at the
previous position.

Prompts: ``build_gepard_prompt_ids`` from ``gepard/prompt.py`` (the same release, compiled unchanged): speaker slots,
``SOT text EOT``, ``SOS``. Generated ids are head0 codes.

``forward`` is model output, not under test; ``Adapter.preprocess`` here does what its commit does (l.460-467) for
each span that samples a frame (``samples_frame``): append the frame, ``frame_count += 1``, store its embedding in
``curr_embed_for_next``. The frames are teacher-forced: a fixed frame per position, so every schedule sees the same
frames and the rows differ only by the preprocess. ``generated_count`` reads ``frame_count`` back, which the restart
check compares with the frames the schedule has generated.

Stand-in (``GepardStandIn``): ``model.embed_input_ids``, ``null_prefix`` (the zero-shot speaker rows), the config ids
(``speaker_token_base``, ``num_speaker_prefix``, hidden size), ``_max_model_len`` and the per-request state dicts. Not
``SupportsMultiModal``: under V1 a span starts from the runner's stale buffer rows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from harness.conform.adapter import (
    Adapter,
    ConformRequest,
    PreprocessResult,
    UNRESOLVED,
    Provenance,
    _file_info,
    fixed_tokens,
    read_model_source,
    tagged,
)
from harness.conform.reach import ModelDeploys

HIDDEN = 64
TOKENISER = 3000  # text ids below this; the speaker slots start here (config.speaker_token_base = tokeniser_length)
N_SPEAKER = 8  # config.num_speaker_prefix (the checkpoint's num_queries default)
SOT, EOT, SOS = 2990, 2991, 2992
HEAD0_VOCAB = 8  # audio_head_levels[0]: head0 is the vLLM-facing token
TABLE = TOKENISER + N_SPEAKER + 16
PROMPT_MEMBER = "vllm_omni/model_executor/models/gepard/prompt.py"


class _Backbone:
    def __init__(self) -> None:
        self.weight = tagged(TABLE, HIDDEN, "gepard", "embed_tokens")

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids.long().clamp(0, TABLE - 1)].clone()


class _Config:
    speaker_token_base = TOKENISER
    num_speaker_prefix = N_SPEAKER
    start_of_text, end_of_text, start_of_speech = SOT, EOT, SOS
    text_repetition_enabled = False  # one copy of the text: the layout's repetition is a checkpoint setting
    text_repetition_apply_below = 0
    text_repetition_target_tokens = 0
    text_repetition_max_repeats = 1

    def get_text_config(self) -> Any:
        return SimpleNamespace(hidden_size=HIDDEN, vocab_size=TABLE)


class GepardStandIn:
    """What ``GepardTalkerForConditionalGeneration.preprocess`` touches."""

    _shared: dict[str, Any] = {}

    def __init__(self) -> None:
        if not self._shared:
            GepardStandIn._shared.update(model=_Backbone(), null=tagged(N_SPEAKER, HIDDEN, "gepard", "null_prefix"))
        self.model = self._shared["model"]
        self.null_prefix = self._shared["null"]
        self.config = _Config()
        self._max_model_len = 4096
        self._active_states: dict[str, Any] = {}
        self._deferred_cleanup_ids: set[str] = set()
        self._pending_requests: list[Any] = []
        self._results_queue: list[Any] = []

    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)


class GepardAdapter(Adapter):
    name = "gepard"
    title = "Gepard-1.0 native-AR talker"
    # stage 0: 4 sequences, budget 4096, max_model_len 4096, a KV cache sized by gpu_memory_utilization 0.3
    deploys = ModelDeploys(("gepard*.yaml",), stage=0, max_model_len=4096)
    member = "vllm_omni/model_executor/models/gepard/gepard_talker.py"
    class_name = "GepardTalkerForConditionalGeneration"
    module_name = "vllm_omni.model_executor.models.gepard.gepard_talker"
    entries = ("preprocess",)
    stale_rows = True
    codec_vocab = HEAD0_VOCAB
    hidden = HIDDEN
    notes = ("stand-in: embed_input_ids, null_prefix, config ids; prompts from the real build_gepard_prompt_ids; "
             "forward's frame commit (teacher-forced frame per position) after each span that samples one")

    def __init__(self) -> None:
        self._prompt_fn: Any = None
        self._frames: dict[str, torch.Tensor] = {}

    def stand_in_class(self) -> type:
        return GepardStandIn

    def make_model(self, impl: Any) -> Any:
        # the hook's own warning on every recompute ("was preempted after N frame(s) ...", l.381) is what the
        # restart cell reports; kept off stderr, where the matrix's progress goes
        logging.getLogger(self.module_name).setLevel(logging.ERROR)
        return super().make_model(impl)

    def extra_sources(self, spec: str, base_dir: Path | None, wheel_dir: Path | None, prov: Provenance) -> None:
        from harness.talkers.upstream import build_functions

        src = read_model_source(spec, PROMPT_MEMBER, base_dir, wheel_dir)
        fns = build_functions(src, ("build_gepard_prompt_ids",),
                              module_name="vllm_omni.model_executor.models.gepard.prompt")
        self._prompt_fn = fns["build_gepard_prompt_ids"]
        prov.files.append(_file_info(src, ("build_gepard_prompt_ids",), fns["__stubbed__"]))

    def embed(self, model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model.embed_input_ids(ids).float()

    def preprocess(self, model: Any, ids: torch.Tensor, embeds: torch.Tensor, info: dict[str, Any],
                   is_prefill: bool, runner: str = "v1", decode_hook: Any = UNRESOLVED) -> PreprocessResult:
        out = super().preprocess(model, ids, embeds, info, is_prefill, runner, decode_hook)
        self._commit(model, int(info["_omni_num_computed_tokens"]) + int(ids.shape[0]) - 1)
        return out

    def _commit(self, model: Any, last: int) -> None:
        """``forward``'s commit (gepard_talker.py l.440-467) for the span the hook just queued, with the frame
        fixed for the span's last position: stop never fires (the schedule's length is fixed)."""
        for req_id, _span, samples_frame, _is_last in model._pending_requests:
            if not samples_frame:
                continue
            state = model._get_or_create_state(req_id)
            frames = self._frames[req_id]
            row = frames[min(max(last - self._P[req_id] + 1, 0), frames.shape[0] - 1)]
            state.frames.append(row)
            state.frame_count += 1
            state.curr_embed_for_next = row
            state.past_first_step = True
        model._pending_requests.clear()

    def generated_count(self, model: Any, request_id: str) -> int | None:
        state = model._active_states.get(request_id)
        return None if state is None else int(state.frame_count)

    def requests(self, count: int, generated: int) -> list[ConformRequest]:
        if self._prompt_fn is None:
            raise RuntimeError("load() first: the prompts come from the upstream build_gepard_prompt_ids")
        from harness.config import load_prompts
        from harness.tokenizer import tokenize

        vocab: dict[str, int] = {}
        out = []
        self._P: dict[str, int] = {}
        for prompt in load_prompts("default").prompts[:count]:
            text = [vocab.setdefault(w, 100 + len(vocab)) for w in tokenize(prompt.reply)]
            prompt_ids = list(self._prompt_fn(text, config=_Config()))
            # the frame forward samples at P-1+k (its 32 codes' embedding): the next position's decode row
            self._frames[prompt.id] = tagged(generated + 2, HIDDEN, "gepard", prompt.id, "frames")
            self._P[prompt.id] = len(prompt_ids)
            out.append(ConformRequest(prompt.id, prompt_ids, {}, fixed_tokens(prompt.id, generated + 1,
                                                                             self.codec_vocab)))
        return out
