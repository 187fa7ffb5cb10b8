"""The sim's step loop: one cell (arm x deploy x repeat) through vLLM's scheduler on the CPU.

Each Talker step: add the requests whose Thinker has finished, snapshot
``num_computed_tokens`` (``schedule()`` advances them), ``schedule()``, run the arm's
``talker_preprocess`` per scheduled request through the runner, let the simulated Talker
sample one token for every request whose span reached its last token, and hand vLLM a
``ModelRunnerOutput`` with those tokens (nothing for partial prefill chunks).

Why a module of its own: the worker pool (``harness.sim.pool``) runs this same ``run_cell`` in its
forked workers and the backend (``harness.sim.backend``) runs it in process and drives the pool; with
the loop here, below both, neither of them imports the other back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.config import ArmSpec, Deploy, PromptSet, SamplingSettings
from harness.contract import count_events
from harness.errors import UserError
from harness.records import RequestRecord, SpanRecord, schedule_digest
from harness.family import get_family
from harness.sim import chunkhold
from harness.sim.load import Arrivals
from harness.sim.runner import SimRunner
from harness.sim.scheduler import _quiet_vllm, make_scheduler
from harness.sim.specdec import Drafter, verify
from harness.sim.windows import connector_rule, record_windows
from harness.talkers import load_impl


_NO_DRAFTS: list[int] = []  # never appended to: the spans without drafts share it


@dataclass
class SimRequestResult:
    record: RequestRecord
    units: list[str]  # what Code2Wav speaks: words, pauses, babble syllables


@dataclass
class CellStats:
    steps: int = 0
    scheduled_tokens: int = 0
    sim_seconds: float = 0.0
    preemptions: int = 0
    spans: list[SpanRecord] = field(default_factory=list)


def run_cell(arm: ArmSpec, deploy: Deploy, prompts: PromptSet, repeat: int, seed: int,
             on_request: Callable[[SimRequestResult], None], skip: frozenset[str] = frozenset(),
             talker_mode: str = "words", latency: bool = False) -> CellStats:
    """Simulates every prompt of the cell; ``on_request`` gets each request as it finishes.

    ``skip``: prompt ids already recorded (``--resume``); they still run, since they shape the
    schedule of the others, but are not reported again. ``talker_mode``: ``words`` (the sim's own
    Talker, ``harness/sim/talker.py``) or ``speaking`` (the speaking tiny model's rules and
    tokenizer, ``harness/sim/speaking_talker.py``). Requests arrive under the deploy's ``load``
    (``harness/sim/load.py``); ``latency``: each record gets its sent, arrival, first codec token
    and finish steps (``omni-stress sweep``; off, the records are the seed's, field for field).
    """
    _quiet_vllm()  # before vLLM's first import, which logs its start-up warnings to stderr
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    import torch

    # The sim's tensors hold a few rows: intra-op threads only add hand-offs, and their
    # spin-waits would take the second core from the Whisper workers transcribing alongside.
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    family = get_family(deploy.family, f"{deploy.path}: family")
    cell = family.sim_cell(load_impl(arm), deploy, prompts, seed, talker_mode)
    outputs, talker, token_ids = cell.requests, cell.talker, cell.token_ids
    sampling = SamplingSettings(**{**deploy.sampling.__dict__, "seed": seed})
    spec = deploy.speculative
    scheduler, resolved = make_scheduler(deploy, spec.num_speculative_tokens if spec else 0)
    drafter = Drafter(talker, spec.num_speculative_tokens, spec.acceptance_rate, seed) if spec else None
    verify_steps: dict[str, list[int]] = {o.request_id: [] for o in outputs}
    cell.model.profile_run(resolved.max_num_batched_tokens)
    runner = (cell.runner_class or SimRunner)(cell.model, cell.space, (arm.name, deploy.name, repeat), cell.contract,
                                              deploy.talker.model_runner)
    mrv2 = deploy.talker.model_runner == "v2"  # a resumed request starts from its payload again (SimRunner.resumed)
    resumed_at: dict[str, int] = {}  # preemptions of each request its buffer has been rebuilt for

    arrivals = Arrivals(outputs, deploy.load, deploy.sim.thinker_steps_per_token, deploy.thinker.max_num_seqs, seed)
    first_token: dict[str, int] = {}
    # a streaming deploy of a family whose connector sends Code2Wav windows: each request's generated-token
    # count after every step that sampled for it, the windows' clock (harness.sim.windows)
    chunk_rule = connector_rule(family, deploy)
    progress: dict[str, list[tuple[int, int]]] = {o.request_id: [] for o in outputs} if chunk_rule is not None else {}
    by_id = {o.request_id: o for o in outputs}
    live: dict[str, Request] = {}
    errors: dict[str, str] = {}
    spans_by_req: dict[str, list[SpanRecord]] = {o.request_id: [] for o in outputs}
    started = {o.request_id: 0.0 for o in outputs}
    stats = CellStats()

    def finish(req: Request) -> None:
        rid = req.request_id
        codes, transcript, units = cell.speak(list(req.output_token_ids))
        out = by_id[rid]
        reason = req.get_finished_reason()
        record = RequestRecord(
            arm=arm.name, deploy=deploy.name, repeat=repeat, prompt_id=rid, backend="sim",
            reference_text=out.reference_text, thinker_text=out.reference_text, talker_prompt_len=out.P,
            codec_tokens=codes, num_codec_tokens=len(codes),
            finish_reason=str(reason) if reason is not None else None,
            oracle_transcript=transcript, preemptions=req.num_preemptions,
            events=count_events(spans_by_req[rid], cell.contract.text_len(out)), error=errors.get(rid),
            accepted_tokens_per_step=(round(sum(verify_steps[rid]) / len(verify_steps[rid]), 3)
                                      if verify_steps[rid] else None),
            wall_s=round(time.perf_counter() - started[rid], 4),
        )
        from harness.audio.scoring import wer

        record.events.cross_request_positions = runner.cross.get(rid, 0)
        record.oracle_wer = wer(record.reference_text, record.oracle_transcript or "")
        if latency:
            record.sent_step = arrivals.sent.get(rid)
            record.arrival_step = arrivals.arrived.get(rid)
            record.first_token_step = first_token.get(rid)
            record.finish_step = step
            record.schedule = schedule_digest(spans_by_req[rid])
        if chunk_rule is not None and record.error is None:  # as the real backend: no windows for a failed request
            record_windows(record, progress[rid], chunk_rule)
        stats.preemptions += req.num_preemptions
        if rid not in skip:
            on_request(SimRequestResult(record, units))

    step = 0
    for step in range(deploy.sim.max_steps):
        for out in arrivals.due(step):
            sp = SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, top_k=sampling.top_k, seed=seed,
                                stop_token_ids=cell.stop_token_ids)
            req = Request(request_id=out.request_id, prompt_token_ids=out.talker_prompt_ids,
                          sampling_params=sp, pooling_params=None)
            if out.P > resolved.max_model_len:
                raise UserError(f"prompt {out.request_id!r}: Talker prompt length {out.P} exceeds "
                                f"{deploy.path}: talker.max_model_len {resolved.max_model_len}")
            scheduler.add_request(req)
            live[out.request_id] = req
            started[out.request_id] = time.perf_counter()
            runner.add_request(out, out.payload(token_ids), resolved.max_model_len + 1)
        if not live:
            if not arrivals.pending():
                break
            continue
        before = {rid: r.num_computed_tokens for rid, r in live.items()}
        held_running, held_waiting = chunkhold.hold(scheduler, runner, step, deploy.sim.chunk_ready_lag)
        sched_out = scheduler.schedule()
        chunkhold.restore(scheduler, held_running, held_waiting)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        failed: list[str] = []
        drafts_by_req = sched_out.scheduled_spec_decode_tokens
        if mrv2:  # MRV2 rebuilds a resumed request's buffer before the step's hooks run
            for rid in sched_out.num_scheduled_tokens:
                req = live[rid]
                if req.num_preemptions != resumed_at.get(rid, 0):
                    resumed_at[rid] = req.num_preemptions
                    runner.resumed(by_id[rid], by_id[rid].payload(token_ids))
        runner.begin_step([(rid, before[rid], n) for rid, n in sched_out.num_scheduled_tokens.items()])
        for rid, n in sched_out.num_scheduled_tokens.items():
            req = live[rid]
            c = before[rid]
            drafts = drafts_by_req.get(rid)
            drafts = list(drafts) if drafts else _NO_DRAFTS
            result = runner.call(req, c, n, step, drafts)
            spans_by_req[rid].append(result.span)
            stats.scheduled_tokens += n
            if result.error is not None:
                errors[rid] = result.error
                failed.append(rid)
                continue
            req_ids.append(rid)
            if c + n < req.num_tokens + len(drafts):
                sampled.append([])  # a partial prefill chunk samples nothing
            elif drafts:
                tokens = verify(talker, runner.kv[rid], req.num_output_tokens, drafts)
                verify_steps[rid].append(len(tokens))
                sampled.append(tokens)
            else:
                sampled.append([talker.next_token(runner.kv[rid], req.num_output_tokens)])
            if latency and sampled[-1] and rid not in first_token:
                first_token[rid] = step
        if failed:
            scheduler.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        scheduler.update_from_output(sched_out, mro)
        if chunk_rule is not None:
            for rid, tokens in zip(req_ids, sampled):
                if tokens:
                    progress[rid].append((step, live[rid].num_output_tokens))
        if drafter is not None:  # the runner proposes drafts after sampling; the engine hands them over
            ids = [r for r, toks in zip(req_ids, sampled) if toks and not live[r].is_finished()]
            scheduler.update_draft_token_ids(DraftTokenIds(
                ids, [drafter.propose(runner.kv[r], live[r].num_output_tokens) for r in ids]))
        for rid in [r for r, q in live.items() if q.is_finished()]:
            finish(live.pop(rid))
            runner.remove_request(rid)
            arrivals.finished(rid, step)
    else:
        raise UserError(f"cell {arm.name} x {deploy.name}: no progress after {deploy.sim.max_steps} steps "
                        f"({deploy.path}: sim.max_steps)")
    stats.steps = step
    stats.spans = [s for rid in spans_by_req for s in spans_by_req[rid]]
    stats.spans.sort(key=lambda s: (s.step, s.request))
    stats.sim_seconds = time.perf_counter() - t0
    return stats
