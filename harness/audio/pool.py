"""Whisper in worker processes: transcription overlaps the simulation and uses every core.

Why processes, not the run's own process: the simulation holds the GIL, and CTranslate2's
OpenMP threads decode 25-35 % slower in a process that has imported torch and vLLM
(measured on 2 cores: 4 clean clips 4.2 s in a fresh process, 5.6 s after the vLLM import).
Why several single-threaded workers: greedy decoding of a small Whisper is latency-bound, so
on 2 cores two 1-thread workers beat one 2-thread model by about 16 % (same transcripts).

Workers are spawned (never forked from a process holding torch's thread pools), start only
when the first transcript is missing from the cache, and each builds its own transcriber
with ``make_transcriber`` from the same (backend, model, beam) the run validated.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from harness.audio.asr import Transcriber, make_transcriber
from harness.errors import UserError
from harness.proc import exit_with_parent


@dataclass(frozen=True)
class PoolSpec:
    """What each worker builds: ``make_transcriber(backend, model, beam_size, cpu_threads)``."""

    backend: str
    model: str
    beam_size: int
    workers: int
    threads_per_worker: int


def default_workers(cpus: int | None = None) -> tuple[int, int]:
    """(workers, threads each): two workers when there are two cores, the cores split between them."""
    cpus = max(1, cpus if cpus is not None else (os.cpu_count() or 1))
    workers = min(2, cpus)
    return workers, max(1, cpus // workers)


_WORKER: Transcriber | None = None


def _init_worker(spec: PoolSpec, parent_pid: int) -> None:
    global _WORKER
    exit_with_parent(parent_pid)
    _WORKER = make_transcriber(spec.backend, spec.model, spec.beam_size, cpu_threads=spec.threads_per_worker)


def _transcribe(wav_path: str) -> tuple[str, float, float]:
    """(transcript, wall seconds, CPU seconds of this worker): the wall stretches while the sim
    shares the cores, the CPU time is Whisper's own work (``bench/sim_vs_vllm.py`` sets it beside
    Whisper's floor)."""
    assert _WORKER is not None, "worker not initialised"
    t0, c0 = time.perf_counter(), time.process_time()
    text = _WORKER.transcribe(Path(wav_path))
    return text, time.perf_counter() - t0, time.process_time() - c0


class AsrPool:
    """``submit(wav) -> Future[(transcript, seconds, cpu seconds)]``; the same audio in flight is decoded once."""

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self._executor: ProcessPoolExecutor | None = None
        self._inflight: dict[str, Future] = {}

    def submit(self, digest: str, wav_path: Path) -> tuple[Future, bool]:
        """The decode of ``wav_path``, and whether this call started it (False: already in flight)."""
        fut = self._inflight.get(digest)
        if fut is not None:
            return fut, False
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=self.spec.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(self.spec, os.getpid()))
        fut = self._executor.submit(_transcribe, str(wav_path))
        self._inflight[digest] = fut
        return fut, True

    def forget(self, digest: str) -> None:
        """Drops a finished decode from the in-flight table (its transcript is cached by then)."""
        self._inflight.pop(digest, None)

    def close(self, cancel: bool = False) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=cancel)
            self._executor = None


def result_of(fut: Future, timeout: float) -> tuple[str, float, float]:
    """The worker's (transcript, seconds, cpu seconds); a worker that died or hangs is one clear error."""
    from concurrent.futures import TimeoutError as FutureTimeout
    from concurrent.futures.process import BrokenProcessPool

    try:
        return fut.result(timeout=timeout)
    except FutureTimeout:
        raise UserError(f"ASR worker gave no transcript within {timeout:.0f} s") from None
    except BrokenProcessPool as exc:
        raise UserError(f"ASR worker process died ({exc}); the records written so far are kept, "
                        f"rerun with --resume") from None


