"""Scoring at scale (issue 34, item 2): Whisper throughput per clip, batched, and on Ray actors.

The default prompt set's 16 replies, spoken by espeak-ng as the sim speaks them (``--copies K``
repeats them, as K distinct clips each), are transcribed by:

* **floor**: one per-clip transcriber in this process on one thread, clip after clip: Whisper's
  single-thread floor (nothing runs beside it, no process or transfer in between);
* **batched floor**: faster-whisper's batched pipeline in this process on one thread, all clips in
  one ``transcribe_many`` (batches of ``--batch``);
* **per-clip**: the run's default, ``AsrPool`` (two spawned worker processes, one thread each);
* **batched**: ``AsrPool`` with ``--asr-batch N``: clips queue and go N at a time;
* **Ray per-clip** / **Ray batched**: ``RayAsrPool``, Whisper actors on a one-machine Ray on
  127.0.0.1 started here (``--no-ray`` skips them), the clips' bytes streamed to them.

Each pool is warmed up first (workers spawned, models loaded), then timed from the first submit to
the last transcript. Columns: clips per second (wall), CPU seconds per audio second (Whisper's own:
the CPU time the workers or actors report for their calls; the driver's CPU beside it), clips per
second as a share of the floor's times the workers (1.00: every worker as fast as the floor), mean WER
against the replies, and how many transcripts equal the per-clip floor's. Prints a table and
writes JSON (``--out``, default bench/asr_scale.json). Noisy on a shared machine: the load average
is recorded before and after.

    .venv/bin/python bench/asr_scale.py                      # base, batch 8, 16 clips
    .venv/bin/python bench/asr_scale.py --model tiny.en --copies 4 --no-ray
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a Ray started here stays on 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # else ray.init() leaves a token in ~/.ray that later `ray start`s use

from harness.audio.asr import make_transcriber  # noqa: E402
from harness.audio.pool import AsrPool, PoolSpec  # noqa: E402
from harness.audio.scoring import wer  # noqa: E402
from harness.audio.tts import speak, units_from_text  # noqa: E402
from harness.config import load_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def speak_clips(prompts: Any, copies: int, folder: Path) -> tuple[list[Path], list[str], float]:
    """(WAV paths, reference texts, audio seconds): every reply ``copies`` times."""
    wavs, refs, audio_s = [], [], 0.0
    for p in prompts:
        wav = folder / f"{p.id}.wav"
        audio_s += speak(units_from_text(p.reply), wav)
        for _ in range(copies):
            wavs.append(wav)
            refs.append(p.reply)
    return wavs, refs, audio_s * copies


def in_process(transcriber: Any, wavs: list[Path], batched: bool) -> dict[str, Any]:
    transcriber._load()  # the model loads before the clock starts
    t0, c0 = time.perf_counter(), time.process_time()
    texts = transcriber.transcribe_many(wavs) if batched else [transcriber.transcribe(w) for w in wavs]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"texts": texts, "wall_s": wall, "worker_cpu_s": cpu, "driver_cpu_s": 0.0, "batches": None}


def drain(pool: Any, wavs: list[Path], tag: str) -> tuple[list[tuple[str, float, float]], list[int]]:
    """Every clip through ``pool`` (distinct digests: each is decoded), pumping as the run's sink does."""
    futs: list[Future] = [pool.submit(f"{tag}-{i}", w)[0] for i, w in enumerate(wavs)]
    while not all(f.done() for f in futs):
        pool.pump()
        wait([f for f in futs if not f.done()], timeout=900, return_when=FIRST_COMPLETED)
    return [f.result() for f in futs], list(pool.batches)


def pooled(pool: Any, wavs: list[Path], warm: int) -> dict[str, Any]:
    try:
        drain(pool, wavs[:warm], "warm")  # workers spawned, models loaded
        before = len(pool.batches)
        t0, c0 = time.perf_counter(), time.process_time()
        results, batches = drain(pool, wavs, "timed")
        wall, driver_cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        pool.close()
    return {"texts": [r[0] for r in results], "wall_s": wall, "worker_cpu_s": sum(r[2] for r in results),
            "driver_cpu_s": driver_cpu, "batches": batches[before:]}


def row(name: str, what: str, got: dict[str, Any], refs: list[str], audio_s: float, floor_texts: list[str] | None,
        workers: int) -> dict[str, Any]:
    n = len(refs)
    wers = [wer(r, t) for r, t in zip(refs, got["texts"])]
    return {"mode": name, "what": what, "workers": workers, "clips": n, "audio_s": round(audio_s, 2),
            "wall_s": round(got["wall_s"], 3), "clips_per_s": round(n / got["wall_s"], 3),
            "audio_s_per_s": round(audio_s / got["wall_s"], 2),
            "worker_cpu_s": round(got["worker_cpu_s"], 3), "cpu_per_audio_s": round(got["worker_cpu_s"] / audio_s, 4),
            "driver_cpu_s": round(got["driver_cpu_s"], 3), "mean_wer": round(statistics.fmean(wers), 4),
            "same_as_floor": None if floor_texts is None else sum(a == b for a, b in zip(got["texts"], floor_texts)),
            "batches": got["batches"], "texts": got["texts"], "wers": wers}


def table(rows: list[dict[str, Any]], floor_cpu: float) -> str:
    floor_rate = rows[0]["clips_per_s"]
    head = ("mode", "workers", "clips/s", "of floor x workers", "audio s/s", "CPU s per audio s", "x floor CPU",
            "driver CPU s", "mean WER", "= floor text")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['workers']} | {r['clips_per_s']:.3f} | "
                     f"{r['clips_per_s'] / (floor_rate * r['workers']):.2f} | {r['audio_s_per_s']:.1f} | "
                     f"{r['cpu_per_audio_s']:.4f} | {r['cpu_per_audio_s'] / floor_cpu:.2f} | {r['driver_cpu_s']:.1f} | "
                     f"{r['mean_wer']:.4f} | {r['same_as_floor']}/{r['clips']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="default")
    ap.add_argument("--model", default="base")
    ap.add_argument("--batch", type=int, default=8, help="clips per batched call (--asr-batch)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes / Ray actors, one thread each")
    ap.add_argument("--copies", type=int, default=1, help="each reply this many times (distinct clips)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray actor rows")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "asr_scale.json")
    args = ap.parse_args()

    prompts = load_prompts(args.prompts).prompts
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="omni-stress-asr-scale-") as tmp:
        wavs, refs, audio_s = speak_clips(prompts, args.copies, Path(tmp))
        print(f"{len(wavs)} clips, {audio_s:.1f} s of audio, Whisper {args.model}, batch {args.batch}, "
              f"{args.workers} workers x 1 thread; load average {load_before[0]:.2f}", file=sys.stderr, flush=True)

        def add(name: str, what: str, got: dict[str, Any], workers: int) -> None:
            floor_texts = rows[0]["texts"] if rows else got["texts"]
            rows.append(row(name, what, got, refs, audio_s, floor_texts, workers))
            r = rows[-1]
            print(f"  {name}: {r['clips_per_s']:.3f} clips/s, {r['cpu_per_audio_s']:.4f} CPU s per audio s, "
                  f"mean WER {r['mean_wer']:.4f}", file=sys.stderr, flush=True)

        add("floor (per clip, 1 thread, in process)", "Whisper's single-thread floor",
            in_process(make_transcriber("faster-whisper", args.model, 1, cpu_threads=1), wavs, batched=False), 1)
        add(f"batched floor (batch {args.batch}, 1 thread, in process)", "the batched pipeline's single-thread floor",
            in_process(make_transcriber("faster-whisper", args.model, 1, cpu_threads=1, batch=args.batch), wavs,
                       batched=True), 1)
        warm = 2 * args.workers
        add("per clip (worker processes: the default)", "AsrPool, --asr-batch 0",
            pooled(AsrPool(PoolSpec("faster-whisper", args.model, 1, args.workers, 1)), wavs, warm), args.workers)
        add(f"batched (worker processes, --asr-batch {args.batch})", "AsrPool, --asr-batch N",
            pooled(AsrPool(PoolSpec("faster-whisper", args.model, 1, args.workers, 1, args.batch)), wavs, warm),
            args.workers)
        if not args.no_ray:
            from harness.backends import RunOptions
            from harness.executors import ray as rayexec

            rayexec.connect(None)
            import ray

            try:
                options = RunOptions(executor="ray", asr_workers=args.workers)
                for batch, name in ((0, "Ray actors per clip"), (args.batch, f"Ray actors batched ({args.batch})")):
                    spec = PoolSpec("faster-whisper", args.model, 1, args.workers, 1, batch)
                    add(name, f"RayAsrPool on 127.0.0.1, --asr-batch {batch}",
                        pooled(rayexec.RayAsrPool(spec, options), wavs, warm), args.workers)
            finally:
                ray.shutdown()

    floor_cpu = rows[0]["cpu_per_audio_s"]
    per_clip, batched = rows[0], rows[1]
    diffs = [{"clip": i, "per_clip": a, "batched": b, "wer_per_clip": wa, "wer_batched": wb}
             for i, (a, b, wa, wb) in enumerate(zip(per_clip["texts"], batched["texts"], per_clip["wers"],
                                                    batched["wers"])) if a != b]
    load_after = os.getloadavg()
    print(table(rows, floor_cpu))
    print(f"\nbatched vs per clip: {len(wavs) - len(diffs)}/{len(wavs)} transcripts identical; mean WER "
          f"{batched['mean_wer']:.4f} vs {per_clip['mean_wer']:.4f} (difference "
          f"{batched['mean_wer'] - per_clip['mean_wer']:+.4f}); "
          f"{sum(d['wer_batched'] != d['wer_per_clip'] for d in diffs)} clips score differently")
    print(f"measured under load: load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
          f"({os.cpu_count()} CPUs)")
    result = {"model": args.model, "batch": args.batch, "workers": args.workers, "prompts": args.prompts,
              "copies": args.copies, "clips": len(wavs), "audio_seconds": audio_s, "host": platform.platform(),
              "cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": load_after,
              "rows": rows, "batched_vs_per_clip": {"identical": len(wavs) - len(diffs), "differences": diffs,
                                                    "mean_wer_per_clip": per_clip["mean_wer"],
                                                    "mean_wer_batched": batched["mean_wer"]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
