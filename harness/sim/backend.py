"""The sim backend: each cell (arm x deploy x repeat) through vLLM's scheduler on the CPU.

A cell is ``run_cell``'s step loop (``harness.sim.steploop``), run in forked workers
(``harness.sim.pool``) or in this process; each finished request is spoken by the sim's Code2Wav.
The step loop lives below both this module and the pool, so the imports run one way
(backend -> pool -> steploop, backend -> steploop) and the pool never imports this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from harness.sim.steploop import SimRequestResult, run_cell

if TYPE_CHECKING:
    from concurrent.futures import Future
    from pathlib import Path

    from harness.backends import CellJob, CellOutcome, EmitRecord, EmitSpans, RunOptions
    from harness.sim.pool import SimPool


def _preload_report_modules() -> None:
    import importlib

    for name in ("harness.report.tables", "harness.report.plots"):
        try:
            importlib.import_module(name)
        except Exception:  # the report imports them again itself, and says what is wrong
            return


class SimBackend:
    """The sim behind ``harness.backends.Backend``: cells in forked workers when it can, else
    in this process; each finished request is spoken by the sim's Code2Wav before it is emitted.

    ``open`` must run before any thread exists: the worker pool forks.
    """

    name = "sim"

    def __init__(self, run_dir: Path, options: RunOptions) -> None:
        self.options = options
        self.talker_mode = getattr(options, "sim_talker", "words")
        self.code2wav = None
        if options.asr != "none":  # --asr none scores the oracle transcript: no speech needed
            from harness.sim.code2wav import Code2Wav

            self.code2wav = Code2Wav.for_options(run_dir, options.cache_dir, options.use_cache)
        self.pool: SimPool | None = None
        self.futures: dict[str, Future] = {}
        self.warm_seconds = 0.0

    def open(self, jobs: list[CellJob]) -> None:
        import threading

        from harness.sim.pool import SimPool, default_workers

        from harness.sim import armcall

        if not jobs:
            return  # a resumed run with every cell done: nothing to run, no pool
        workers = self.options.sim_workers if self.options.sim_workers >= 0 else default_workers(len(jobs))
        if threading.active_count() > 1:
            return  # forking a process with other threads (a host application, a test runner) is unsafe
        if workers < 2 or len(jobs) < 2:
            if armcall.limit() <= 0 or self.options.sim_workers == 0:
                return  # one cell at a time, in this process (--sim-workers 0, or no per-call limit)
            # Under --arm-timeout the cells run in a worker even one at a time: an arm call that ignores its
            # limit is ended by ending the process it runs in, which must not be the run's (issue 33, case 1).
            workers = 1
        t0 = time.perf_counter()
        self.pool = SimPool(workers, jobs[0].deploy)  # imports vLLM: the in-process path pays it in its first cell
        self.warm_seconds = time.perf_counter() - t0
        latency = getattr(self.options, "latency", False)
        self.futures = {j.key: self.pool.submit(j.arm, j.deploy, j.prompts, j.repeat, j.seed, j.skip, self.talker_mode,
                                                latency)
                        for j in jobs}
        # The workers are forked (the first submit starts them all): while they simulate, this process only
        # writes records, so it imports what the report at the end of the run needs (pandas, matplotlib)
        # now, on the core the cells leave free, instead of after the last cell with one core idle.
        threading.Thread(target=_preload_report_modules, name="omni-stress-preload", daemon=True).start()

    def run_cell(self, job: CellJob, emit: EmitRecord, emit_spans: EmitSpans,
                 idle: Callable[[], None]) -> CellOutcome:
        from harness.backends import CellOutcome

        t_sim = time.perf_counter()
        future = self.futures.pop(job.key, None)
        if future is not None:
            from harness.sim.pool import SimPool

            stats, finished = SimPool.result(future, job.label, idle)
        else:
            finished: list[SimRequestResult] = []  # type: ignore[no-redef]
            stats = run_cell(job.arm, job.deploy, job.prompts, job.repeat, job.seed, finished.append, job.skip,
                             self.talker_mode, getattr(self.options, "latency", False))
        outcome = CellOutcome(sim_seconds=stats.sim_seconds, scheduled_tokens=stats.scheduled_tokens,
                              sim_wall=time.perf_counter() - t_sim + self.warm_seconds)
        self.warm_seconds = 0.0
        emit_spans(stats.spans)
        t0 = time.perf_counter()
        tts0 = self.code2wav.seconds if self.code2wav else 0.0
        for result in finished:  # completion order
            if self.code2wav is not None:
                self.code2wav.speak(result.record, result.units)
            emit(result.record)
        if self.code2wav is not None:
            outcome.tts_seconds = self.code2wav.seconds - tts0
            outcome.tts_cache_hits = self.code2wav.cache_hits
        outcome.seconds = stats.sim_seconds + time.perf_counter() - t0
        return outcome

    def close(self, cancel: bool = False) -> None:
        if self.pool is not None:
            self.pool.close(cancel=cancel)
            self.pool = None
