"""Sim cells in forked worker processes: two cells simulate at once on a 2-core machine.

Why fork, and why after a warm-up: importing vLLM costs about 4 s and the first scheduler another
0.7 s of lazy imports; workers forked from a parent that has done both start at once. The parent
forks while it is still single-threaded (every worker is started at the first submit, before
the Whisper pool or any intra-op thread exists), and torch is set to one thread first, so no
OpenMP pool is copied into a child. Each cell is the same ``run_cell`` the in-process path
runs, so its records and spans are identical (tested); results come back pickled.

An arm call that ignores its time limit (``--arm-timeout``) cannot be ended inside its worker: the
worker's watchdog says which call of which cell is stuck (a line in the pool's report file) and ends
the worker (``harness.sim.armcall.kill_when_stuck``). A dead worker breaks the executor, so the pool
starts a new one and submits every cell still in flight again, the stuck call failed without being
made; the sim is deterministic, so each cell's records are those an interruptible timeout would have
given (issue 33, case 1).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from harness.config import ArmSpec, Deploy, PromptSet
from harness.errors import UserError, WorkerOutOfMemory, out_of_memory
from harness.proc import exit_with_parent
from harness.sim import armcall
from harness.sim.steploop import CellStats, SimRequestResult, run_cell

CELL_TIMEOUT_S = 3600.0  # a cell is bounded by sim.max_steps; this only guards a hung worker
IDLE_S = 0.25


def default_workers(cells: int, cpus: int | None = None) -> int:
    cpus = max(1, cpus if cpus is not None else (os.cpu_count() or 1))
    return max(1, min(2, cpus, cells))


def _warm_up(deploy: Deploy) -> None:
    """Everything a cell imports or builds lazily, once, in the parent (children inherit it)."""
    import torch

    from harness.sim.scheduler import _quiet_vllm, make_scheduler

    _quiet_vllm()
    torch.set_num_threads(1)
    import vllm.sampling_params  # noqa: F401
    import vllm.v1.outputs  # noqa: F401
    import vllm.v1.request  # noqa: F401

    make_scheduler(deploy)


CellResult = tuple[CellStats, list[SimRequestResult]]  # the stats, and the requests in completion order


def _cell(arm: ArmSpec, deploy: Deploy, prompts: PromptSet, repeat: int, seed: int,
          skip: frozenset[str], talker_mode: str = "words", latency: bool = False, tag: str = "",
          doomed: dict[int, str] | None = None) -> CellResult:
    finished: list[SimRequestResult] = []
    armcall.set_cell(tag, doomed)
    stats = run_cell(arm, deploy, prompts, repeat, seed, finished.append, skip, talker_mode, latency)
    return stats, finished


def _init_worker(parent_pid: int, report_path: str) -> None:
    exit_with_parent(parent_pid)
    armcall.kill_when_stuck(report_path)


class CellHandle:
    """One submitted cell: what ``SimPool.result`` waits on (its future changes when the pool replaces a
    worker that an arm's call hung)."""

    def __init__(self, pool: SimPool, args: tuple, tag: str) -> None:
        self.pool, self.args, self.tag = pool, args, tag
        self.doomed: dict[int, str] = {}
        self.submitted: dict[int, str] = {}  # the doomed calls its current future was submitted with
        self.future: Future = pool._submit_future(self)
        self.collected = False

    def done(self) -> bool:
        return self.future.done()


class _Bare:
    def __init__(self, future: Future) -> None:
        self.future, self.pool, self.collected = future, None, False

    def done(self) -> bool:
        return self.future.done()


class SimPool:
    """``submit`` a cell, ``result`` its (stats, finished requests in completion order)."""

    def __init__(self, workers: int, warm_deploy: Deploy) -> None:
        _warm_up(warm_deploy)
        self._workers = workers
        fd, self._report = tempfile.mkstemp(prefix="omni-stress-stuck-", suffix=".txt")
        os.close(fd)
        self._reported = 0  # lines of the report file already acted on
        self._handles: list[CellHandle] = []
        self._executor = self._new_executor()

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=self._workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=_init_worker, initargs=(os.getpid(), self._report))

    def _submit_future(self, handle: CellHandle) -> Future:
        handle.submitted = dict(handle.doomed)
        return self._executor.submit(_cell, *handle.args, tag=handle.tag, doomed=handle.submitted)

    def submit(self, arm: ArmSpec, deploy: Deploy, prompts: PromptSet, repeat: int, seed: int,
               skip: frozenset[str], talker_mode: str = "words", latency: bool = False) -> CellHandle:
        handle = CellHandle(self, (arm, deploy, prompts, repeat, seed, skip, talker_mode, latency),
                            str(len(self._handles)))
        self._handles.append(handle)
        return handle

    def _replace_stuck_workers(self) -> bool:
        """After the executor broke: when workers reported calls stuck past their limit, a new executor
        runs every cell still in flight again, those calls failed; False when no worker reported one."""
        try:
            with open(self._report, encoding="utf-8") as f:
                lines = f.read().split("\n")[:-1]  # whole lines only: one may be being written
        except OSError:
            return False
        new = lines[self._reported:]
        self._reported = len(lines)
        by_tag = {h.tag: h for h in self._handles}
        for line in new:
            tag, _, index = line.partition("\t")
            handle = by_tag.get(tag)
            if handle is not None and index.isdigit():
                handle.doomed.setdefault(int(index), armcall.stuck_message(armcall.limit()))
        # A line can come late (a worker of the executor before this one): what counts is whether a cell in
        # flight runs without a call known to hang. If none does, the break is something else (a real crash).
        if not any(h.doomed != h.submitted for h in self._handles if not h.collected):
            return False
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._executor = self._new_executor()
        for handle in self._handles:
            f = handle.future
            if handle.collected or (f.done() and not f.cancelled() and f.exception() is None):
                continue
            handle.future = self._submit_future(handle)
        return True

    @staticmethod
    def result(fut: CellHandle | Future, label: str, idle: Callable[[], None] = lambda: None) -> CellResult:
        """The cell's result; ``idle`` runs every quarter second meanwhile (the run writes the
        records whose transcripts came in, so a kill now loses none of them)."""
        if not isinstance(fut, CellHandle):  # a bare future (tests): nothing to replace
            fut = _Bare(fut)
        try:
            while True:
                deadline = time.monotonic() + CELL_TIMEOUT_S
                while not fut.done() and time.monotonic() < deadline:
                    idle()
                    wait([fut.future], timeout=IDLE_S)
                try:
                    result = fut.future.result(timeout=0)
                except BrokenProcessPool:
                    if fut.pool is not None and fut.pool._replace_stuck_workers():
                        continue  # the cell (and every other in flight) runs again in a new worker
                    raise
                fut.collected = True
                return result
        except FutureTimeout:
            raise UserError(f"cell {label}: no result from its sim worker in {CELL_TIMEOUT_S:.0f} s") from None
        except (MemoryError, OSError, ImportError) as exc:  # the worker's own code out of memory (issue 24 case 10)
            if not out_of_memory(exc):
                raise
            raise WorkerOutOfMemory(label) from None
        except BrokenProcessPool:
            # One dead worker breaks every cell in flight, so this cell is not necessarily the culprit.
            raise UserError(f"a sim worker process died (killed, out of memory, or a crash in an arm's native "
                            f"code) while cell {label} was in flight; the records written so far are kept: rerun "
                            f"with --resume, with --sim-workers 1 to see the cell that dies") from None

    def close(self, cancel: bool = False) -> None:
        self._executor.shutdown(wait=True, cancel_futures=cancel)
        try:
            os.unlink(self._report)
        except OSError:
            pass
