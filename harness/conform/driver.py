"""The schedule driver: feeds a model's real preprocess the spans of a schedule, as the runner does.

Shared with the sim rather than copied: the buffer handling is the sim runner's
(``harness.sim.runner.SimRunner``: the request's intermediate buffer as ``req_infos``, the
``_omni_*`` metadata, ``update_dict`` merged into the buffer, ``req_embeds[:min(n, rows)]``
copied into the span), the scheduler is the sim's (``harness.sim.scheduler.make_scheduler``:
vLLM's own v1 ``Scheduler`` under a deploy from ``deploy_configs/``), and spans are classified
by ``harness.contract.classify_span``. What differs from the sim: no simulated Talker. The
output tokens are fixed in advance (teacher forcing), so every schedule feeds every position
the same id and the only thing that can differ is the row the preprocess delivers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.conform.adapter import Adapter, ConformRequest
from harness.conform.schedules import PREEMPT, Schedule
from harness.config import Deploy
from harness.errors import UserError
from harness.sim import armcall
from harness.sim.runner import SimRunner


@dataclass
class Feed:
    """One preprocess call: the span and the rows its positions received."""

    schedule: str
    request: str
    step: int
    P: int
    c: int
    n: int
    replay: int  # preemptions of the request so far (0: first pass)
    rows: int | None  # rows the hook returned (None: it raised)
    received: torch.Tensor | None  # [n, hidden] what the positions c..c+n-1 run with
    ids: torch.Tensor | None = None  # the span's ids
    error: str | None = None
    start: torch.Tensor | None = None  # the rows the span started with (V1's stale buffer rows), when not bare
    all_ids: list[int] | None = None  # the request's tokens (prompt + generated): the restart check's start ids
    counter: int | None = None  # the model's own generated-frame count after the call (Adapter.generated_count)


class ConformRunner(SimRunner):
    """The sim runner's buffer semantics around any adapter's hook (one runner per model instance)."""

    def __init__(self, adapter: Adapter, model: Any, runner: str = "v1") -> None:  # noqa: D107 -- no RowSpace
        from harness.sim import hooks

        self.adapter, self.model, self.runner = adapter, model, runner
        # the decode hook the release's runner resolves for this model (MRV2's reads the hook's signature):
        # once per runner, as the sim's runner resolves it once per cell
        self.decode_hook = hooks.decode_hook(model, runner)
        self.buffer: dict[str, dict[str, Any]] = {}
        self.calls: dict[str, int] = {}  # calls per request so far (the connector's per-call deliveries)
        self.streams: dict[str, dict[str, Any]] = {}  # per-request delivery state (adapter.deliver)
        self.persist: torch.Tensor | None = None  # V1's persistent inputs_embeds buffer (adapter.stale_rows)
        self.batch_error: str | None = None  # the step's batch hook failed: the step's spans fail with it

    def begin_step(self, req_ids: list[str], prefill_ids: list[str]) -> None:  # type: ignore[override]
        """The model's batch hook before the step's spans, as the runner calls it (``harness.sim.hooks``)."""
        from harness.sim import hooks

        self.batch_error = None
        try:
            armcall.call(hooks.prefill_batch, model=self.model, runner=self.runner, req_ids=req_ids,
                         buffers=self.buffer, prefill_ids=prefill_ids, device=torch.device("cpu"))
        except armcall.ArmFailure as exc:
            self.batch_error = str(exc)[:300]
        except Exception as exc:  # the model's failure is this step's result
            self.batch_error = f"{type(exc).__name__}: {exc}"[:300]

    def add(self, req: ConformRequest) -> None:
        self.buffer[req.request_id] = _copy_payload(req.payload)

    def preempted(self, req: ConformRequest) -> None:
        """V1 (gpu_model_runner.py) keeps the request's buffer across a preemption. MRV2
        (worker_v2/omni_model_runner.py ``finish_requests``) removes the request's model state for
        preempted ids as for finished ones, and the resumed request comes back as a new one: its
        buffer is rebuilt from the request's own payload."""
        if self.runner == "v2":
            self.add(req)

    def _starting_rows(self, bare: torch.Tensor, offset: int) -> torch.Tensor | None:
        """V1 without multimodal support: the persistent buffer's rows at the span's batch offset (zeros
        until a step writes them); None where the span starts from its ids' embeddings."""
        if not (self.adapter.stale_rows and self.runner == "v1"):
            return None
        n, need = bare.shape[0], offset + bare.shape[0]
        if self.persist is None or self.persist.shape[0] < need:
            grown = torch.zeros(max(need, 256), bare.shape[1], dtype=bare.dtype)
            if self.persist is not None:
                grown[:self.persist.shape[0]] = self.persist
            self.persist = grown
        return self.persist[offset:offset + n].clone()

    def feed(self, req: ConformRequest, c: int, n: int, step: int, schedule: str, replay: int,
             max_tokens: int | None = None, offset: int = 0) -> Feed:
        rid, P = req.request_id, req.P
        span_ids = torch.tensor(req.tokens[c:c + n], dtype=torch.long)
        calls = self.calls.get(rid, 0)
        self.calls[rid] = calls + 1
        chunk = self.adapter.deliver(req, self.streams.setdefault(rid, {}), calls, c)
        if chunk:  # a streamed chunk (async_chunk): merged into the buffer as the runner merges one
            self._update_buffer(rid, chunk)
        req_infos = self.buffer.setdefault(rid, {})
        req_infos["request_id"] = rid
        req_infos["_omni_prompt_len"] = P
        req_infos["_omni_num_computed_tokens"] = c
        req_infos["_omni_is_prefill"] = c < P
        req_infos["_omni_max_tokens"] = max_tokens
        req_infos["_omni_seed"] = 42
        if self.batch_error is not None:
            return Feed(schedule, rid, step, P, c, n, replay, None, None, span_ids, self.batch_error)
        received = self.adapter.embed(self.model, span_ids)
        start = self._starting_rows(received, offset)
        if start is not None:
            received = start.clone()
        try:
            # fenced as the sim fences an arm's call (harness.sim.armcall): a call past --arm-timeout, a
            # KeyboardInterrupt or sys.exit the hook raises itself fail this schedule, not the command
            out = armcall.call(self.adapter.preprocess, model=self.model, ids=span_ids.clone(),
                               embeds=received.clone(), info=req_infos, is_prefill=c < P, runner=self.runner,
                               decode_hook=self.decode_hook)
            rows = int(out.rows.shape[0])
            self._update_buffer(rid, out.update)
        except armcall.ArmFailure as exc:
            return Feed(schedule, rid, step, P, c, n, replay, None, None, span_ids, str(exc)[:300])
        except Exception as exc:  # the model's failure is this schedule's result
            return Feed(schedule, rid, step, P, c, n, replay, None, None, span_ids,
                        f"{type(exc).__name__}: {exc}"[:300])
        seg = min(n, rows)
        received[:seg] = out.rows[:seg].to(received.dtype).reshape(seg, -1)
        if out.text_step is not None:  # the runner's talker_mtp path adds the decode step's text row
            received = received + out.text_step.to(received.dtype).reshape(1, -1)
        if start is not None:  # what the step leaves in the persistent buffer
            self.persist[offset:offset + n] = received
        return Feed(schedule, rid, step, P, c, n, replay, rows, received, span_ids, start=start,
                    all_ids=req.tokens if replay else None, counter=self.adapter.generated_count(self.model, rid))


def _copy_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """A fresh buffer per run (nested dicts copied, tensors shared: the hooks never write into them)."""
    return {k: (_copy_payload(v) if isinstance(v, dict) else v) for k, v in payload.items()}


def run_forced(adapter: Adapter, impl: Any, req: ConformRequest, schedule: Schedule, runner_kind: str = "v1"
               ) -> list[Feed]:
    """One request through one forced schedule on a fresh model instance, under V1's or MRV2's buffer rules."""
    runner = ConformRunner(adapter, adapter.make_model(impl), runner_kind)
    runner.add(req)
    feeds: list[Feed] = []
    replay = 0
    for step, (c, n) in enumerate(schedule.ops):
        if (c, n) == PREEMPT:
            replay += 1
            runner.preempted(req)
            continue
        runner.begin_step([req.request_id], [req.request_id] if c < req.P else [])
        feed = runner.feed(req, c, n, step, schedule.name, replay)
        feeds.append(feed)
        if feed.error is not None:
            break
    return feeds


def run_deploy(adapter: Adapter, impl: Any, requests: list[ConformRequest], deploy: Deploy,
               max_steps: int = 100_000, runner_kind: str = "v1") -> tuple[list[Feed], dict[str, int]]:
    """All requests at once through vLLM's scheduler under ``deploy`` (one model instance, as one
    server), until each has its fixed output tokens. Returns the feeds and the scheduler's counts.

    A deploy with ``speculative`` gets vLLM's spec-decode scheduling (``harness.sim.specdec``):
    the drafts handed over after each step are the request's next fixed tokens, so every draft
    is accepted and each verify span carries ``k + 1`` positions whose ids are the fixed ones."""
    from harness.sim.scheduler import _quiet_vllm, make_scheduler

    _quiet_vllm()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    k = deploy.speculative.num_speculative_tokens if deploy.speculative else 0
    scheduler, resolved = make_scheduler(deploy, k)
    runner = ConformRunner(adapter, adapter.make_model(impl), runner_kind)
    by_id = {r.request_id: r for r in requests}
    seen_preemptions: dict[str, int] = {}
    live: dict[str, Any] = {}
    for r in requests:
        if r.P + len(r.generated) > resolved.max_model_len:
            raise UserError(f"request {r.request_id}: {r.P + len(r.generated)} positions exceed "
                            f"{deploy.path}: talker.max_model_len {resolved.max_model_len} (lower --deploy-generated)")
        sp = SamplingParams(max_tokens=len(r.generated), temperature=0.0, seed=42, ignore_eos=True)
        req = Request(request_id=r.request_id, prompt_token_ids=list(r.prompt_ids), sampling_params=sp,
                      pooling_params=None)
        scheduler.add_request(req)
        live[r.request_id] = req
        runner.add(r)
    feeds: list[Feed] = []
    preemptions = 0
    for step in range(max_steps):
        if not live:
            break
        before = {rid: q.num_computed_tokens for rid, q in live.items()}
        sched = scheduler.schedule()
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        failed: list[str] = []
        drafts_by_req = sched.scheduled_spec_decode_tokens
        offset = 0  # the span's rows in the step's flattened batch (V1's persistent buffer)
        for rid in sched.num_scheduled_tokens:
            q = live[rid]
            if q.num_preemptions != seen_preemptions.get(rid, 0):  # resumed after a preemption
                seen_preemptions[rid] = q.num_preemptions
                runner.preempted(by_id[rid])
        runner.begin_step(list(sched.num_scheduled_tokens),
                          [rid for rid in sched.num_scheduled_tokens if before[rid] < by_id[rid].P])
        for rid, n in sched.num_scheduled_tokens.items():
            q, r = live[rid], by_id[rid]
            c = before[rid]
            drafts = len(drafts_by_req.get(rid, ()))
            feed = runner.feed(r, c, n, step, f"vllm:{deploy.name}", q.num_preemptions, len(r.generated), offset)
            offset += n
            feeds.append(feed)
            if feed.error is not None:
                failed.append(rid)
                continue
            req_ids.append(rid)
            # the fixed tokens that follow the span's last position, once the span reaches the end
            # (a verify span: its accepted drafts plus the bonus token)
            sampled.append(r.tokens[q.num_tokens:q.num_tokens + drafts + 1] if c + n >= q.num_tokens + drafts else [])
        if failed:
            scheduler.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
        scheduler.update_from_output(sched, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled))
        if k:  # the engine hands the runner's drafts to the scheduler after each step
            ids = [rid for rid, toks in zip(req_ids, sampled) if toks and not live[rid].is_finished()]
            scheduler.update_draft_token_ids(DraftTokenIds(
                ids, [by_id[rid].tokens[live[rid].num_tokens:live[rid].num_tokens + k] for rid in ids]))
        for rid in [r for r, q in live.items() if q.is_finished()]:
            preemptions += live.pop(rid).num_preemptions
            runner.remove_request(rid)
    else:
        raise UserError(f"vllm:{deploy.name}: no end after {max_steps} scheduler steps")
    return feeds, {"steps": step, "preemptions": preemptions}
