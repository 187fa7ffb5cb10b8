"""Sim cells in forked worker processes: two cells simulate at once on a 2-core machine.

Why fork, and why after a warm-up: importing vLLM costs about 4 s and the first scheduler another
0.7 s of lazy imports; workers forked from a parent that has done both start at once. The parent
forks while it is still single-threaded (every worker is started at the first submit, before
the Whisper pool or any intra-op thread exists), and torch is set to one thread first, so no
OpenMP pool is copied into a child. Each cell is the same ``run_cell`` the in-process path
runs, so its records and spans are identical (tested); results come back pickled.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from harness.config import ArmSpec, Deploy, PromptSet
from harness.errors import UserError, WorkerOutOfMemory, out_of_memory
from harness.proc import exit_with_parent
from harness.sim.backend import CellStats, SimRequestResult, run_cell

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
          skip: frozenset[str], talker_mode: str = "words", latency: bool = False) -> CellResult:
    finished: list[SimRequestResult] = []
    stats = run_cell(arm, deploy, prompts, repeat, seed, finished.append, skip, talker_mode, latency)
    return stats, finished


class SimPool:
    """``submit`` a cell, ``result`` its (stats, finished requests in completion order)."""

    def __init__(self, workers: int, warm_deploy: Deploy) -> None:
        _warm_up(warm_deploy)
        self._executor = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"),
                                             initializer=exit_with_parent, initargs=(os.getpid(),))

    def submit(self, arm: ArmSpec, deploy: Deploy, prompts: PromptSet, repeat: int, seed: int,
               skip: frozenset[str], talker_mode: str = "words", latency: bool = False) -> Future:
        return self._executor.submit(_cell, arm, deploy, prompts, repeat, seed, skip, talker_mode, latency)

    @staticmethod
    def result(fut: Future, label: str, idle: Callable[[], None] = lambda: None) -> CellResult:
        """The cell's result; ``idle`` runs every quarter second meanwhile (the run writes the
        records whose transcripts came in, so a kill now loses none of them)."""
        deadline = time.monotonic() + CELL_TIMEOUT_S
        try:
            while not fut.done() and time.monotonic() < deadline:
                idle()
                wait([fut], timeout=IDLE_S)
            return fut.result(timeout=0)
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
