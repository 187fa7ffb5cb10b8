"""What vLLM-Omni's GPU model runner does around the Talker's preprocess, on the CPU.

Mirrors vLLM-Omni 0.30.0 ``vllm_omni/worker/gpu_model_runner.py`` (``_preprocess``, l.1840-1920,
and ``_update_intermediate_buffer``, l.2154): per scheduled request it takes the request's
intermediate buffer as ``req_infos`` (the Thinker->Talker payload plus whatever earlier calls
stored), adds ``_omni_prompt_len``, ``_omni_num_computed_tokens``, ``_omni_is_prefill``,
starts the span's rows as the Talker's embeddings of the span's ids, calls the arm's
``talker_preprocess``, merges the returned ``update_dict`` into the buffer, copies
``req_embeds[:min(n, rows)]`` into the span, and replaces the span's ids only when the arm
returned exactly that many.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from harness.contract import misaligned_regions, same_hidden, span_flags
from harness.errors import UserError
from harness.records import SpanRecord
from harness.sim import armcall, hooks
from harness.sim.cell import SimContract
from harness.sim.rows import RowSpace, tagged_index, tagged_rows


_new_span = object.__new__


@dataclass
class CallResult:
    span: SpanRecord
    error: str | None


class SimRunner:
    # the family's one-token decodes take the runner's talker_mtp path: the decode hook's text step is added
    # to the position's codec row (Qwen3-TTS, Qwen3-Omni); Qwen2.5-Omni's Talker has no such path
    text_step_added = False

    def __init__(self, model: Any, space: RowSpace, cell: tuple[str, str, int], contract: SimContract,
                 kind: str = "v1") -> None:
        """``contract``: the family's (``harness.sim.cell.SimContract``): the per-request KV the Talker
        reads and the misaligned positions of each span. ``kind``: the model runner (``v1``, or ``v2``:
        MRV2), which decides the hooks called besides the per-span one (``harness.sim.hooks``)."""
        self.model, self.space, self.cell, self.contract = model, space, cell, contract
        self.kind = kind
        why = hooks.refuse_unmodelled(model)
        if why:
            raise UserError(f"arm {cell[0]!r}: {why}")
        self._decode_hook = hooks.decode_hook(model, kind)
        self._batch_hook = callable(getattr(model, hooks.PREFILL_BATCH_HOOK[hooks.kind(kind)], None))
        self._batch_error: str | None = None  # the step's batch hook failed: every span of the step fails with it
        # the Talker's hidden state per request and position (MTP families): what the release's postprocess
        # leaves in the buffer as hidden_states.last, and what a decode must hand the code predictor
        self.hidden: dict[str, torch.Tensor] = {}
        self._past: list[Any] = []  # the past hidden state the decode path handed the code predictor, if any
        self.buffer: dict[str, dict[str, Any]] = {}
        # per request, its positions that ran with another request's row or past hidden state (each span's
        # positions, as misaligned positions are counted): what state kept across calls and not keyed by
        # request does (the record count cross_request_positions)
        self.cross: dict[str, int] = {}
        self._index: dict[str, int] = {}  # request -> its index in _owner (any request of the cell, admitted or not)
        self._owner = np.zeros(0, dtype=np.int64)  # registered text row -> its request's index, -1 for shared rows
        self.kv: dict[str, Any] = {}
        self.thinker: dict[str, Any] = {}
        armcall.prepare()  # the per-call time limit's signal handler, once per cell
        # A stand-in's Talker module that embeds ids as rows of the codec table (``EMBEDS_CODEC_TABLE``,
        # Qwen2.5-Omni's): read them straight from the table (``RowSpace.embed_numpy``); any other module
        # (an arm's own, a subclass) is called as the runner always did.
        talker = type(getattr(model, "talker", None))  # its own class only: a subclass may embed otherwise
        self._embed = space.embed_numpy if vars(talker).get("EMBEDS_CODEC_TABLE", False) else None
        self._decode_flags = span_flags(1, 1, 1, 1)  # a decode span's flags (c >= P, n == rows == 1)
        # a family whose requests carry a voice in a codec row (Qwen3-TTS's speaker): its positions holding
        # another request's voice (``foreign_voice(out, codec_ids)``); None where the contract has none
        self._foreign_voice = getattr(contract, "foreign_voice", None)

    def add_request(self, out: Any, payload: dict[str, Any], capacity: int) -> None:
        self.buffer[out.request_id] = payload
        self.thinker[out.request_id] = out
        self._index.setdefault(out.request_id, len(self._index))
        self.kv[out.request_id] = self.contract.new_kv(out, capacity)
        if self.text_step_added:
            self.hidden[out.request_id] = hidden_rows(out.request_id, capacity)

    def remove_request(self, request_id: str) -> None:
        self.buffer.pop(request_id, None)

    def resumed(self, out: Any, payload: dict[str, Any]) -> None:
        """A preempted request is scheduled again under MRV2 (``talker.model_runner: v2``): its model state
        was dropped with the preemption (worker_v2/omni_model_runner.py ``finish_requests``) and it comes
        back as a new request, its buffer rebuilt from its payload. V1 keeps the buffer: the backend calls
        this only for v2."""
        self.buffer[out.request_id] = payload

    def begin_step(self, scheduled: list[tuple[str, int, int]]) -> None:
        """Before the step's per-request calls: the model's batch hook, if it defines one, as the runner
        calls it (``harness.sim.hooks.prefill_batch``). ``scheduled``: ``(request, c, n)`` of the step's spans."""
        self._batch_error = None
        if not self._batch_hook:
            return
        prefill = [rid for rid, c, _n in scheduled if c < self.thinker[rid].P]
        try:
            armcall.call(hooks.prefill_batch, model=self.model, runner=self.kind, req_ids=[r for r, _c, _n in scheduled],
                         buffers=self.buffer, prefill_ids=prefill, device=torch.device("cpu"))
        except armcall.ArmFailure as exc:
            self._batch_error = str(exc)

    def invoke(self, span_ids: torch.Tensor, inputs_embeds: torch.Tensor, req_infos: dict[str, Any],
               is_prefill: bool, n: int) -> Any:
        """The runner's call for one span, fenced (``armcall``): ``(ids, rows, update_dict)``. A one-token
        decode goes to the decode hook the runner resolves (``harness.sim.hooks.decode_hook``: V1's
        ``preprocess_decode_batch``, MRV2's ``preprocess_decode_batch_mrv2`` first) as a batch of one, where
        the model defines one; every other span to the family's per-span hook (:meth:`invoke_span`)."""
        if self._batch_error is not None:
            raise armcall.ArmFailure(self._batch_error)
        if n == 1 and not is_prefill and self._decode_hook is not None:
            return armcall.call(_decode_batch_of_one, hook=self._decode_hook, span_ids=span_ids,
                                inputs_embeds=inputs_embeds, req_infos=req_infos, add_text=self.text_step_added,
                                sink=self._past)
        return self.invoke_span(span_ids, inputs_embeds, req_infos, is_prefill, n)

    def invoke_span(self, span_ids: torch.Tensor, inputs_embeds: torch.Tensor, req_infos: dict[str, Any],
                    is_prefill: bool, n: int) -> Any:
        """The family's per-span hook. Qwen2.5-Omni's runner calls ``talker_preprocess`` for every span; a
        family whose runner path differs (the MTP text row of Qwen3-TTS and Qwen3-Omni) overrides this."""
        return armcall.call(self.model.talker_preprocess, input_ids=span_ids, input_embeds=inputs_embeds,
                            **req_infos)

    def _update_buffer(self, request_id: str, upd: Any) -> None:
        if not isinstance(upd, dict) or not upd:
            return
        existing = self.buffer.setdefault(request_id, {})
        for k, v in upd.items():
            if isinstance(v, dict):
                existing.setdefault(k, {}).update(v)
            else:
                existing[k] = v

    def call(self, request: Any, c: int, n: int, step: int, drafts: list[int] | None = None) -> CallResult:
        """One ``talker_preprocess`` call for one request's span, and the rows it leaves in KV.

        ``drafts``: the span's scheduled draft tokens (a verify span's positions after the first).
        """
        rid = request.request_id
        P = len(request.prompt_token_ids)
        ids = request.all_token_ids[c:c + n]
        if drafts and len(ids) < n:  # a verify span: the scheduled drafts follow the last token
            ids = list(ids) + list(drafts)[:n - len(ids)]
        # The arm gets this tensor itself (no copy): the runner reads the span's ids from ``ids`` after the call.
        # Made from NumPy (a third of torch.tensor's cost on a list); the same int64 values either way. The
        # arm may write into it: after the call the runner reads ``ids``, never ``ids_np``.
        ids_np = np.array(ids, dtype=np.int64)
        span_ids = torch.from_numpy(ids_np)
        req_infos = self.buffer.setdefault(rid, {})
        req_infos["request_id"] = rid
        req_infos["_omni_prompt_len"] = P
        req_infos["_omni_num_computed_tokens"] = c
        req_infos["_omni_is_prefill"] = c < P
        sp = request.sampling_params
        req_infos["_omni_max_tokens"] = sp.max_tokens
        req_infos["_omni_seed"] = sp.seed
        # the Talker's embeddings of the span's ids: the codec table's rows, a new tensor per call
        inputs_embeds = (self._embed(ids_np) if self._embed is not None
                         else self.model.talker.embed_input_ids(span_ids))
        self._past.clear()
        try:  # the arm's failure (an exception, sys.exit, a hang, bad rows) is this request's, not the run's
            result = self.invoke(span_ids, inputs_embeds, req_infos, c < P, n)
            try:
                _ids, req_embeds, update_dict = result
                rows = armcall.check_rows(req_embeds, inputs_embeds.shape[1])
                self._update_buffer(rid, update_dict)
            except armcall.ArmFailure:
                raise
            except Exception as exc:
                raise armcall.ArmFailure(f"{type(exc).__name__}: talker_preprocess returned something the runner "
                                         f"cannot use: {exc}") from None
        except armcall.ArmFailure as exc:
            arm, deploy, repeat = self.cell
            span = SpanRecord(arm, deploy, repeat, rid, step, P, c, n, rows=0, error=str(exc))
            return CallResult(span, span.error)
        if rows >= n and type(req_embeds) is torch.Tensor and req_embeds.dtype == inputs_embeds.dtype == torch.float32 \
                and req_embeds.layout == torch.strided and not req_embeds.requires_grad and req_embeds.is_cpu:
            # the span's rows are the arm's first n: identify those (copying them into the span's
            # rows first would give the same float32 values)
            final = req_embeds if rows == n else req_embeds[:n]
        else:
            seg = min(n, rows)
            inputs_embeds[:seg] = req_embeds[:seg].to(inputs_embeds.dtype)
            final = inputs_embeds
        kv = self.kv[rid]
        out = self.thinker[rid]
        hidden = self.hidden.get(rid)
        if hidden is not None:  # the release's postprocess: the span's last position's hidden state, into the buffer
            req_infos.setdefault("hidden_states", {})["last"] = hidden[c + n - 1]
        if n == 1:  # a decode step (or a one-token tail): scalar identification and check
            t_id, k_id = self.space.identify_one(final)
            kv.write_one(c, t_id, k_id)
            text, end = self.contract.misaligned_one(kv, out, int(ids[0]), c, t_id, k_id)
            cross = t_id >= 0 and self._owner_of(t_id) not in (-1, self._index[rid])
            if c < P and self._foreign_voice is not None:  # a one-position prompt chunk: its codec row's voice
                cross = cross or bool(self._foreign_voice(out, np.array((k_id,), dtype=np.int64))[0])
            if self._past and c >= P and not same_hidden(self._past[0], hidden[c - 1]):
                # the code predictor got another position's hidden state (stale, zeroed, another request's):
                # the position is misaligned although its row is right
                cross = cross or self._hidden_of_another(rid, self._past[0])
                if text + end == 0:
                    text, end = misaligned_regions((c,), P, self.contract.text_len(out))
            if cross:
                self.cross[rid] = self.cross.get(rid, 0) + 1
            if rows == 1 and c >= P:  # a decode span: its event flags are the same for every one
                return CallResult(self._decode_span(rid, step, P, c, text, end), None)
        else:
            text_ids, codec_ids = self.space.identify(final)
            foreign = self._foreign(rid, out, text_ids, codec_ids)
            if foreign:
                self.cross[rid] = self.cross.get(rid, 0) + foreign
            kv.write(c, text_ids, codec_ids)
            text, end = self.contract.misaligned(kv, out, np.asarray(ids, dtype=np.int64), c, n, text_ids, codec_ids)
        arm, deploy, repeat = self.cell
        span = SpanRecord(arm, deploy, repeat, rid, step, P, c, n, rows, misaligned_text=text, misaligned_end=end)
        return CallResult(span, None)

    def _foreign(self, rid: str, out: Any, text_ids: np.ndarray, codec_ids: np.ndarray) -> int:
        """How many of a span's positions have a text row registered to another request of the cell, or (a
        family with voices) another request's voice."""
        voice = self._foreign_voice(out, codec_ids) if self._foreign_voice is not None else None
        known = text_ids >= 0
        if not known.any():
            return 0 if voice is None else int(voice.sum())
        self._owner_of(int(text_ids[known].max()))
        owners = np.where(known, self._owner[np.where(known, text_ids, 0)], -1)
        foreign = (owners >= 0) & (owners != self._index[rid])
        return int((foreign if voice is None else foreign | voice).sum())

    def _owner_of(self, text_id: int) -> int:
        """The index of the request a registered text row belongs to (-1: a row every request shares)."""
        if text_id >= len(self._owner):  # rows registered since: their owners, once
            meanings = self.space.meanings
            added = [self._index.setdefault(m.request, len(self._index)) if m.request is not None else -1
                     for m in meanings[len(self._owner):]]  # rows of a request not admitted yet are its too
            self._owner = np.concatenate([self._owner, np.array(added, dtype=np.int64)])
        return int(self._owner[text_id])

    def _hidden_of_another(self, rid: str, got: Any) -> bool:
        """Whether a past hidden state is exactly another request's hidden state at some position
        (``hidden_position`` says which position it would be)."""
        if not isinstance(got, torch.Tensor) or not got.dtype.is_floating_point or got.numel() == 0:
            return False
        pos = hidden_position(got)
        return any(0 <= pos < len(rows) and same_hidden(got, rows[pos])
                   for other, rows in self.hidden.items() if other != rid)

    def _decode_span(self, rid: str, step: int, P: int, c: int, text: int, end: int) -> SpanRecord:
        """``SpanRecord(..., n=1, rows=1, ...)`` of a decode span (``c >= P``), without its
        ``__post_init__``: the same fields and values, the flags being ``contract.span_flags``' decode
        flags (one evaluation of the table for all such spans) and ``misaligned`` the regions' sum."""
        span = _new_span(SpanRecord)
        arm, deploy, repeat = self.cell
        span.__dict__.update(arm=arm, deploy=deploy, repeat=repeat, request=rid, step=step, P=P, c=c, n=1, rows=1,
                             misaligned_text=text, misaligned_end=end, misaligned=text + end, error=None,
                             **self._decode_flags)
        return span


def _decode_batch_of_one(hook: Any, span_ids: torch.Tensor, inputs_embeds: torch.Tensor, req_infos: dict[str, Any],
                         add_text: bool, sink: list[Any]) -> tuple[Any, Any, Any]:
    """The runner's flush of its decode batch for one request: the hook's row for the position, plus its
    ``text_step`` row where the family's decode runs the MTP path (``add_text``); the past hidden state it
    hands the code predictor goes to ``sink``."""
    result = hook(input_ids=span_ids, input_embeds=inputs_embeds, req_infos=[req_infos])
    ids, rows, past_hidden, text_step, updates = hooks.unpack_decode(result)
    if len(updates) != 1:
        raise ValueError(f"the batched decode hook returned {len(updates)} updates for 1 request")
    if add_text and text_step is not None:
        rows = rows.reshape(1, -1) + text_step.reshape(1, -1).to(rows.dtype)
    if add_text and past_hidden is not None:
        sink.append(past_hidden)
    return ids, rows, updates[0]


def hidden_rows(request_id: str, count: int) -> torch.Tensor:
    """The Talker's hidden state at each position of a request, ``[count, DIM]``: deterministic in the request
    and distinct per position, so a past hidden state handed to the code predictor is checked exactly."""
    return tagged_rows(count, 0, "talker-hidden", request_id)


def hidden_position(row: torch.Tensor) -> int:
    """The position whose ``hidden_rows`` row ``row`` would be (-1: none)."""
    return tagged_index(row, 0)

