"""Whisper worker processes: sizing, in-flight de-duplication, same transcripts as in-process,
and one clear error when a model cannot load or a worker dies; ``--asr-batch``'s queue (sends at
once while a worker is free, fills batches while all are busy) and its batched transcripts."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path

import pytest

from harness.audio.asr import make_transcriber
from harness.audio.pool import AsrPool, PoolSpec, QueuedPool, default_workers, result_of
from harness.audio.tts import speak, units_from_text
from harness.errors import UserError

SENTENCE = "Mix four cups of flour with a spoon of salt."


@pytest.mark.parametrize(("cpus", "expected"), [(1, (1, 1)), (2, (2, 1)), (3, (2, 1)), (16, (2, 8))])
def test_default_workers_split_the_cores(cpus: int, expected: tuple[int, int]) -> None:
    assert default_workers(cpus) == expected


@pytest.fixture(scope="module")
def wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pool") / "s.wav"
    speak(units_from_text(SENTENCE), path)
    return path


@pytest.mark.slow
def test_pool_transcribes_like_the_process_and_decodes_duplicates_once(wav: Path) -> None:
    pool = AsrPool(PoolSpec("faster-whisper", "tiny.en", 1, workers=1, threads_per_worker=1))
    try:
        first, started = pool.submit("digest-a", wav)
        again, started_again = pool.submit("digest-a", wav)
        assert started is True and started_again is False and again is first
        text, seconds, cpu = result_of(first, timeout=600)
        assert seconds > 0 and cpu > 0  # the worker's own CPU time of the decode
        pool.forget("digest-a")
        _, started_after = pool.submit("digest-a", wav)  # finished and forgotten: a new decode
        assert started_after is True
    finally:
        pool.close()
    assert text == make_transcriber("faster-whisper", "tiny.en", 1, cpu_threads=2).transcribe(wav)


@pytest.mark.slow
def test_a_model_that_cannot_load_is_one_user_error(wav: Path, tmp_path: Path) -> None:
    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "model.bin").write_bytes(b"not a ctranslate2 model")
    pool = AsrPool(PoolSpec("faster-whisper", str(bad), 1, workers=1, threads_per_worker=1))
    try:
        fut, _ = pool.submit("d", wav)
        with pytest.raises(UserError, match=r"^--asr-model .*broken-model.*: cannot load a CTranslate2 Whisper model"):
            result_of(fut, timeout=600)
    finally:
        pool.close()


@pytest.mark.slow
def test_a_worker_that_dies_is_one_user_error(wav: Path) -> None:
    pool = AsrPool(PoolSpec("faster-whisper", "tiny.en", 1, workers=1, threads_per_worker=1))
    try:
        fut, _ = pool.submit("d", wav)
        deadline = time.monotonic() + 60
        while not pool._executor._processes and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.05)
        for pid in list(pool._executor._processes):  # type: ignore[union-attr]
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(UserError, match=r"^ASR worker process died .*rerun with --resume$"):
            result_of(fut, timeout=600)
    finally:
        pool.close(cancel=True)


@pytest.mark.slow
def test_workers_exit_when_the_run_is_killed(wav: Path, tmp_path: Path) -> None:
    """A SIGKILLed run leaves no Whisper worker behind (they would block on their queue forever)."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "from harness.audio.pool import AsrPool, PoolSpec\n"
        "if __name__ == '__main__':\n"
        "    pool = AsrPool(PoolSpec('faster-whisper', 'tiny.en', 1, workers=2, threads_per_worker=1))\n"
        "    pool.submit('a', Path(sys.argv[1]))\n"
        "    pool.submit('b', Path(sys.argv[1]))\n"
        "    print(' '.join(str(p) for p in pool._executor._processes), flush=True)\n"
        "    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(script), str(wav)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2
    finally:
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if _alive(p)]
    assert alive == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_in_process_and_worker_transcription_record_the_same(tmp_path: Path) -> None:
    """``--asr-workers 0`` (this process) and ``--asr-workers 1`` give the same records; the
    in-flight de-duplication makes pr's stress audio (identical to its reference audio) a hit."""
    import json

    from tests.conftest import run_cli

    for workers in ("0", "1"):
        res = run_cli("run", "--arm", "pr", "--prompts", "tests/fixtures/prompts_small.yaml", "--asr-model", "tiny.en",
                      "--no-cache", "--asr-workers", workers, "--out", str(tmp_path), "--run-id", f"w{workers}", "-q")
        assert res.exit_code == 0, res.stderr
        assert "(4 transcribed, 4 cache hits)" in res.stdout
    rows = {w: sorted((r["deploy"], r["prompt_id"], r["transcript"], r["wer"]) for r in
                      map(json.loads, (tmp_path / f"w{w}" / "requests.jsonl").read_text().splitlines()))
            for w in ("0", "1")}
    assert rows["0"] == rows["1"] and len(rows["0"]) == 8


# ---------------------------------------------------------------- --asr-batch: the queue that fills batches


class _ManualPool(QueuedPool):
    """A ``QueuedPool`` whose calls are Futures the test completes by hand (no worker, no clock)."""

    def __init__(self, per_call: int, capacity: int) -> None:
        super().__init__(per_call, capacity)
        self.calls: list[tuple[list[str], Future]] = []

    def _dispatch(self, paths: list[Path]) -> Future:
        call: Future = Future()
        self.calls.append(([p.name for p in paths], call))
        return call


def test_queue_sends_at_once_while_a_worker_is_free_and_fills_batches_while_all_are_busy() -> None:
    pool = _ManualPool(per_call=3, capacity=2)
    futs = {name: pool.submit(name, Path(f"{name}.wav"))[0] for name in "abcdefg"}
    # a and b went at once (two free slots); c..g wait for a slot.
    assert [c[0] for c in pool.calls] == [["a.wav"], ["b.wav"]]
    again, started = pool.submit("c", Path("c.wav"))
    assert again is futs["c"] and started is False  # the same clip queued twice is decoded once
    pool.calls[0][1].set_result((["A"], 2.0, 1.0))
    assert futs["a"].result(timeout=0) == ("A", 2.0, 1.0)
    pool.pump()  # a slot is free: the next call takes up to three queued clips
    assert [c[0] for c in pool.calls][2:] == [["c.wav", "d.wav", "e.wav"]]
    pool.calls[2][1].set_result((["C", "D", "E"], 3.0, 1.5))
    assert [futs[n].result(timeout=0) for n in "cde"] == [("C", 1.0, 0.5), ("D", 1.0, 0.5), ("E", 1.0, 0.5)]
    pool.calls[1][1].set_exception(RuntimeError("worker gone"))
    with pytest.raises(RuntimeError, match="worker gone"):
        futs["b"].result(timeout=0)
    pool.pump()
    assert [c[0] for c in pool.calls][3:] == [["f.wav", "g.wav"]]
    pool.calls[3][1].set_result((["F"], 1.0, 1.0))  # one transcript for two clips: both fail, clearly
    with pytest.raises(RuntimeError, match="^ASR call returned 1 transcripts for 2 clips$"):
        futs["g"].result(timeout=0)
    assert pool.batches == [1, 1, 3, 2]
    pool.pump()
    assert len(pool.calls) == 4  # nothing queued, nothing sent


def test_closing_cancels_what_is_still_queued() -> None:
    pool = _ManualPool(per_call=2, capacity=1)
    first, _ = pool.submit("a", Path("a.wav"))
    queued, _ = pool.submit("b", Path("b.wav"))
    pool._cancel_queued()
    assert queued.cancelled() and not first.done()
    pool.pump()
    assert [c[0] for c in pool.calls] == [["a.wav"]]


@pytest.mark.slow
def test_batched_pool_gives_the_batched_transcripts(tmp_path: Path) -> None:
    sentences = [SENTENCE, "Keep your room dark, quiet and cool.", "Plan to stop every two hours to stretch and change drivers."]
    wavs = []
    for i, text in enumerate(sentences):
        wavs.append(tmp_path / f"s{i}.wav")
        speak(units_from_text(text), wavs[-1])
    pool = AsrPool(PoolSpec("faster-whisper", "tiny.en", 1, workers=1, threads_per_worker=1, batch=2))
    try:
        futs = [pool.submit(f"d{i}", w)[0] for i, w in enumerate(wavs)]
        texts = []
        for fut in futs:
            while not fut.done():
                pool.pump()
                wait([f for f in futs if not f.done()], timeout=600, return_when=FIRST_COMPLETED)
            texts.append(result_of(fut, timeout=0)[0])
    finally:
        pool.close()
    want = ["Mix 4 cups on flour with a spoon unsalted", "Keep your room dark, quiet and cool.",
            "Plan to stop every two hours to stretch and change drivers."]
    assert texts == want
    assert texts == make_transcriber("faster-whisper", "tiny.en", 1, cpu_threads=1, batch=2).transcribe_many(wavs)
    assert sum(pool.batches) == 3 and pool.batches[0] == 1 and max(pool.batches) <= 2
