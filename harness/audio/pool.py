"""Whisper in worker processes: transcription overlaps the simulation and uses every core.

Why processes, not the run's own process: the simulation holds the GIL, and CTranslate2's
OpenMP threads decode 25-35 % slower in a process that has imported torch and vLLM
(measured on 2 cores: 4 clean clips 4.2 s in a fresh process, 5.6 s after the vLLM import).
Why several single-threaded workers: greedy decoding of a small Whisper is latency-bound, so
on 2 cores two 1-thread workers beat one 2-thread model by about 16 % (same transcripts).

Workers are spawned (never forked from a process holding torch's thread pools), start only
when the first transcript is missing from the cache, and each builds its own transcriber
with ``make_transcriber`` from the same (backend, model, beam) the run validated.

``--asr-batch N`` (``PoolSpec.batch``): clips wait in a queue here and go to a worker N at a time,
decoded together by faster-whisper's batched pipeline (``harness.audio.batched``). A worker never
idles while clips wait: with fewer calls in flight than ``capacity``, what is queued goes at once,
so batches fill only while every worker is busy. ``pump`` sends what can go; the run's record sink
calls it each time it looks for finished transcripts. ``QueuedPool`` is that queue for any worker
kind (these processes; Ray actors in ``harness.executors.ray``).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.audio.asr import Transcriber, make_transcriber
from harness.errors import UserError
from harness.proc import exit_with_parent


@dataclass(frozen=True)
class PoolSpec:
    """What each worker builds: ``make_transcriber(backend, model, beam_size, cpu_threads, batch)``."""

    backend: str
    model: str
    beam_size: int
    workers: int
    threads_per_worker: int
    batch: int = 0  # 0: one clip per call, decoded alone; N: up to N clips per call, batched

    def make(self) -> Transcriber:
        return make_transcriber(self.backend, self.model, self.beam_size, cpu_threads=self.threads_per_worker,
                                batch=self.batch)


def default_workers(cpus: int | None = None) -> tuple[int, int]:
    """(workers, threads each): two workers when there are two cores, the cores split between them."""
    cpus = max(1, cpus if cpus is not None else (os.cpu_count() or 1))
    workers = min(2, cpus)
    return workers, max(1, cpus // workers)


_WORKER: Transcriber | None = None


def _init_worker(spec: PoolSpec, parent_pid: int) -> None:
    global _WORKER
    exit_with_parent(parent_pid)
    _WORKER = spec.make()


def _transcribe(wav_path: str) -> tuple[str, float, float]:
    """(transcript, wall seconds, CPU seconds of this worker): the wall stretches while the sim
    shares the cores, the CPU time is Whisper's own work (``bench/sim_vs_vllm.py`` sets it beside
    Whisper's floor)."""
    assert _WORKER is not None, "worker not initialised"
    t0, c0 = time.perf_counter(), time.process_time()
    text = _WORKER.transcribe(Path(wav_path))
    return text, time.perf_counter() - t0, time.process_time() - c0


def transcribe_clips(transcriber: Transcriber, paths: Sequence[Path]) -> list[str]:
    """One transcript per path: the batched pipeline takes them all at once, per clip one by one."""
    many = getattr(transcriber, "transcribe_many", None)
    if many is not None:
        return list(many(list(paths)))
    return [transcriber.transcribe(p) for p in paths]


def _transcribe_batch(wav_paths: list[str]) -> tuple[list[str], float, float]:
    """(transcripts, wall seconds, CPU seconds of this worker) of one call's clips."""
    assert _WORKER is not None, "worker not initialised"
    t0, c0 = time.perf_counter(), time.process_time()
    texts = transcribe_clips(_WORKER, [Path(p) for p in wav_paths])
    return texts, time.perf_counter() - t0, time.process_time() - c0


class QueuedPool:
    """Clips queue here; ``pump`` sends up to ``per_call`` of them per call while fewer than
    ``capacity`` calls are in flight. Each clip has its own Future of (transcript, seconds, cpu
    seconds), a call's wall and CPU time shared evenly among its clips. Subclasses say how a call
    goes out (``_dispatch``: a Future of (transcripts, wall, cpu)) and how a failed call reads
    (``_error``)."""

    def __init__(self, per_call: int, capacity: int) -> None:
        self.per_call, self.capacity = max(1, per_call), max(1, capacity)
        self._queue: list[tuple[Path, Future]] = []
        self._inflight: dict[str, Future] = {}
        self._calls = 0
        self._lock = threading.Lock()
        self.batches: list[int] = []  # clips per call sent, in order (bench/asr_scale.py prints them)

    def submit(self, digest: str, wav_path: Path) -> tuple[Future, bool]:
        """The decode of ``wav_path``, and whether this call started it (False: already queued or in flight)."""
        fut = self._inflight.get(digest)
        if fut is not None:
            return fut, False
        fut = Future()
        self._inflight[digest] = fut
        self._queue.append((Path(wav_path), fut))
        self.pump()
        return fut, True

    def pump(self) -> None:
        """Sends what can go now: a call of up to ``per_call`` queued clips per free slot."""
        while True:
            with self._lock:
                if not self._queue or self._calls >= self.capacity:
                    return
                items, self._queue = self._queue[:self.per_call], self._queue[self.per_call:]
                self._calls += 1
            self.batches.append(len(items))
            try:
                call = self._dispatch([p for p, _ in items])
            except BaseException as exc:
                self._settle(items, None, exc)
                raise
            call.add_done_callback(lambda done, items=items: self._finished(items, done))

    def _finished(self, items: list[tuple[Path, Future]], call: Future) -> None:
        try:
            result = call.result()
        except BaseException as exc:  # noqa: BLE001 - each clip's Future carries it
            self._settle(items, None, self._error(exc))
        else:
            self._settle(items, result, None)

    def _settle(self, items: list[tuple[Path, Future]], result: Any, error: BaseException | None) -> None:
        with self._lock:
            self._calls -= 1
        if error is not None or len(result[0]) != len(items):
            error = error or RuntimeError(f"ASR call returned {len(result[0])} transcripts for {len(items)} clips")
            for _, fut in items:
                if not fut.done():
                    fut.set_exception(error)
            return
        texts, wall, cpu = result
        for text, (_, fut) in zip(texts, items):
            if not fut.done():
                fut.set_result((text, wall / len(items), cpu / len(items)))

    def forget(self, digest: str) -> None:
        """Drops a finished decode from the in-flight table (its transcript is cached by then)."""
        self._inflight.pop(digest, None)

    def _cancel_queued(self) -> None:
        with self._lock:
            queued, self._queue = self._queue, []
        for _, fut in queued:
            fut.cancel()

    def _dispatch(self, paths: list[Path]) -> Future:
        raise NotImplementedError

    def _error(self, exc: BaseException) -> BaseException:
        return exc


class AsrPool(QueuedPool):
    """``submit(wav) -> Future[(transcript, seconds, cpu seconds)]``; the same audio in flight is decoded once.

    Per clip (``spec.batch`` 0) each clip goes to the process pool as it comes; batched, clips
    queue (``QueuedPool``) and go ``spec.batch`` at a time, one call per worker in flight."""

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(per_call=spec.batch, capacity=spec.workers)
        self.spec = spec
        self._executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=self.spec.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(self.spec, os.getpid()))
        return self._executor

    def submit(self, digest: str, wav_path: Path) -> tuple[Future, bool]:
        if self.spec.batch:
            return super().submit(digest, wav_path)
        fut = self._inflight.get(digest)
        if fut is not None:
            return fut, False
        fut = self._pool().submit(_transcribe, str(wav_path))
        self._inflight[digest] = fut
        return fut, True

    def _dispatch(self, paths: list[Path]) -> Future:
        return self._pool().submit(_transcribe_batch, [str(p) for p in paths])

    def close(self, cancel: bool = False) -> None:
        if cancel:
            self._cancel_queued()
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


