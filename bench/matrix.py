"""Benchmark of the whole matrix: ``omni-stress run`` cold (empty transcript cache), then warm.

Why: a run has to be cheap enough to repeat on every change. This runs the default matrix (main,
pr x reference, stress, 16 prompts) the way a user does, a fresh ``omni-stress run`` process per
run, so interpreter start-up, imports and reports count in the wall time; the stage times (sim,
TTS, ASR), scheduled tokens and cache hits come from each run's ``manifest.json``
(``pipeline.StageTimes``), the ASR real-time factor from its records. A third measurement runs
the sim cells in this process after a warm-up (vLLM already imported, no audio, no files): the
steady-state scheduled tokens/s of the simulation itself.

    .venv/bin/python bench/matrix.py                      # faster-whisper base (the run default)
    .venv/bin/python bench/matrix.py --asr none           # sim only: no TTS, no Whisper
    .venv/bin/python bench/matrix.py --prompts tests/fixtures/prompts_small.yaml --asr-model tiny.en

Writes ``bench/results.json`` (``--out``) and prints a table. Targets (issues 7 and 13, 2 CPU
cores): cold <= 60 s, warm <= 10 s, sim >= 50k scheduled tokens/s.

Floors (issue 13): each stage of the cold run is printed beside the least it could cost, measured
in the same bench run, and the ratio (target: within 1.5x):

* Whisper: unique audio seconds of the run x the real-time factor of the same model decoding a
  sample of the run's own WAVs alone in a fresh one-thread process / ASR workers;
* sim: vLLM's own ``Scheduler.schedule()`` + ``update_from_output()`` time for the same steps,
  timed inside the in-process steady-state cells (the rest of a cell is the runner, the arm's
  ``talker_preprocess`` and the simulated Talker);
* startup: ``python -c "import vllm"`` + ``python -m harness.cli --help``, against the cold run's
  wall minus its simulation (summed cell seconds / sim workers), TTS and Whisper wait.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"cold_wall_s": 60.0, "warm_wall_s": 10.0, "sim_tokens_per_s": 50_000.0}


@dataclass
class RunResult:
    """One ``omni-stress run`` process: wall time and what its manifest and records say."""

    name: str
    wall_s: float
    sim_s: float  # the run's time on the sim: simulating, or waiting for its sim workers (and importing vLLM)
    sim_cpu_s: float  # simulation seconds summed over cells (two cells run at once in sim workers)
    tts_s: float
    asr_s: float  # Whisper decode seconds summed over transcripts (workers overlap the sim)
    asr_wait_s: float  # seconds the run waited for Whisper once everything else was done
    other_s: float  # wall - sim - TTS - ASR wait: start-up, imports, writing records, reports
    scheduled_tokens: int
    sim_tokens_per_s: float
    requests: int
    transcribed: int
    cache_hits: int
    tts_cache_hits: int
    audio_s_transcribed: float
    asr_rtf: float | None  # ASR seconds per audio second, over the transcribed (not cached) requests
    run_dir: str


@dataclass
class SteadyCell:
    cell: str
    steps: int
    scheduled_tokens: int
    seconds: float
    tokens_per_s: float
    scheduler_s: float = 0.0  # vLLM's schedule() + update_from_output() inside this cell


@dataclass
class SteadyResult:
    cells: list[SteadyCell] = field(default_factory=list)
    seconds: float = 0.0
    scheduled_tokens: int = 0
    tokens_per_s: float = 0.0
    scheduler_s: float = 0.0


@dataclass
class Floors:
    """The least each stage of the cold run could cost (see the module docstring)."""

    unique_audio_s: float
    asr_rtf_alone: float | None  # decode seconds per audio second, one thread, nothing else running
    asr_workers: int
    sim_workers: int
    import_vllm_s: float
    cli_s: float
    rows: list[dict] = field(default_factory=list)  # stage, measured, floor, ratio, what


def run_cli(name: str, args: argparse.Namespace, out: Path, cache: Path) -> RunResult:
    cmd = [sys.executable, "-m", "harness.cli", "run", "--quiet", "--out", str(out), "--run-id", name,
           "--cache-dir", str(cache), "--prompts", args.prompts, "--asr", args.asr, "--asr-model", args.asr_model,
           "--repeat", str(args.repeat)]
    for a in args.arm:
        cmd += ["--arm", a]
    for d in args.deploy:
        cmd += ["--deploy", d]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench: `{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    run_dir = out / name
    manifest = json.loads((run_dir / "manifest.json").read_text())
    st = manifest.get("stage_seconds", {})
    records = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines() if line.strip()]
    fresh = [r for r in records if r.get("asr_cached") is False]
    audio = sum(r.get("audio_seconds") or 0.0 for r in fresh)
    asr_fresh = sum(r.get("asr_seconds") or 0.0 for r in fresh)
    sim_cpu, tts, asr = float(st.get("sim", 0.0)), float(st.get("tts", 0.0)), float(st.get("asr", 0.0))
    sim = float(st.get("sim_wall", sim_cpu))
    wait = float(st.get("asr_wait", 0.0))
    tokens = int(st.get("scheduled_tokens", 0))
    return RunResult(
        name=name, wall_s=round(wall, 2), sim_s=round(sim, 2), sim_cpu_s=round(sim_cpu, 2), tts_s=round(tts, 2), asr_s=round(asr, 2),
        asr_wait_s=round(wait, 2), other_s=round(wall - sim - tts - wait, 2), scheduled_tokens=tokens,
        sim_tokens_per_s=round(tokens / sim_cpu) if sim_cpu else 0.0, requests=len(records),
        transcribed=int(st.get("asr_transcribed", 0)), cache_hits=int(st.get("asr_cache_hits", 0)),
        tts_cache_hits=int(st.get("tts_cache_hits", 0)),
        audio_s_transcribed=round(audio, 2), asr_rtf=round(asr_fresh / audio, 3) if audio else None,
        run_dir=str(run_dir),
    )


def steady_sim(args: argparse.Namespace) -> SteadyResult:
    """The sim cells in this process, after one warm-up cell: the simulation's own throughput."""
    from harness.config import load_arms, load_deploy, load_prompts
    from harness.talkers import resolve_arm
    from harness.sim.steploop import run_cell

    known = load_arms()
    arms = [resolve_arm(a, known) for a in args.arm]
    deploys = [load_deploy(d) for d in args.deploy]
    prompts = load_prompts(args.prompts)
    run_cell(arms[0], deploys[0], prompts, 1, args.seed, lambda r: None)  # imports, first-use costs
    clock = _time_vllm_scheduler()
    result = SteadyResult()
    for arm in arms:
        for dep in deploys:
            for rep in range(1, args.repeat + 1):
                clock[0] = 0.0
                t0 = time.perf_counter()
                stats = run_cell(arm, dep, prompts, rep, args.seed + rep - 1, lambda r: None)
                seconds = time.perf_counter() - t0
                result.cells.append(SteadyCell(f"{arm.name}/{dep.name}/{rep}", stats.steps, stats.scheduled_tokens,
                                               round(seconds, 3), round(stats.scheduled_tokens / seconds),
                                               round(clock[0], 3)))
                result.seconds += seconds
                result.scheduled_tokens += stats.scheduled_tokens
                result.scheduler_s += clock[0]
    result.tokens_per_s = round(result.scheduled_tokens / result.seconds) if result.seconds else 0.0
    result.seconds = round(result.seconds, 3)
    result.scheduler_s = round(result.scheduler_s, 3)
    return result


def _time_vllm_scheduler() -> list[float]:
    """Wraps vLLM's ``Scheduler.schedule`` and ``update_from_output`` (the class the sim drives)
    with a timer; returns the one-element accumulator they add their seconds to."""
    from vllm.v1.core.sched.scheduler import Scheduler

    clock = [0.0]
    for name in ("schedule", "update_from_output"):
        fn = getattr(Scheduler, name)
        if getattr(fn, "_bench_timed", False):
            fn = fn.__wrapped__

        def timed(*a, _fn=fn, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                clock[0] += time.perf_counter() - t0

        timed.__wrapped__, timed._bench_timed = fn, True  # type: ignore[attr-defined]
        setattr(Scheduler, name, timed)
    return clock


_RTF_PROBE = r"""
import json, sys, time, wave
from harness.audio.asr import make_transcriber
backend, model, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
tr = make_transcriber(backend, model, beam_size=1, cpu_threads=1)
tr.transcribe(paths[0])  # load the model, first-call costs
decode = audio = 0.0
for p in paths:
    with wave.open(p) as w:
        audio += w.getnframes() / w.getframerate()
    t0 = time.perf_counter(); tr.transcribe(p); decode += time.perf_counter() - t0
print(json.dumps({"decode_s": decode, "audio_s": audio}))
"""


def unique_audio(run_dir: Path) -> tuple[float, list[Path]]:
    """Seconds of distinct audio (by content) among the run's WAVs, and one path per distinct WAV."""
    import hashlib
    import wave

    seen: dict[str, Path] = {}
    total = 0.0
    for path in sorted((run_dir / "audio").rglob("*.wav")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest in seen:
            continue
        seen[digest] = path
        with wave.open(str(path)) as w:
            total += w.getnframes() / w.getframerate()
    return total, list(seen.values())


def measure_floors(args: argparse.Namespace, cold: RunResult | None) -> Floors:
    """Startup floor (two fresh processes) and Whisper's real-time factor alone (a sample of the
    cold run's distinct WAVs, decoded in a fresh one-thread process while nothing else runs)."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}

    def wall(cmd: list[str]) -> float:
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=300, check=True, env=env)
        return time.perf_counter() - t0

    import_vllm = wall([sys.executable, "-c", "import vllm"])
    cli = wall([sys.executable, "-m", "harness.cli", "--help"])
    audio_s, rtf, paths = 0.0, None, []
    if cold is not None and args.asr != "none":
        audio_s, paths = unique_audio(Path(cold.run_dir))
        if paths:
            step = max(1, len(paths) // 6)  # about six distinct WAVs, spread over the run
            sample = [str(p) for p in paths[::step][:6]]
            proc = subprocess.run([sys.executable, "-c", _RTF_PROBE, args.asr, args.asr_model, *sample],
                                  cwd=ROOT, capture_output=True, text=True, timeout=900, check=True)
            probe = json.loads(proc.stdout.strip().splitlines()[-1])
            rtf = probe["decode_s"] / probe["audio_s"] if probe["audio_s"] else None
    workers = min(2, os.cpu_count() or 1)
    return Floors(unique_audio_s=round(audio_s, 1), asr_rtf_alone=round(rtf, 4) if rtf is not None else None,
                  asr_workers=workers, sim_workers=workers, import_vllm_s=round(import_vllm, 2), cli_s=round(cli, 2))


def floor_rows(fl: Floors, cold: RunResult | None, steady: SteadyResult | None) -> list[dict]:
    rows: list[dict] = []

    def row(stage: str, measured: float | None, floor: float | None, what: str) -> None:
        ratio = round(measured / floor, 2) if measured is not None and floor else None
        rows.append({"stage": stage, "measured_s": None if measured is None else round(measured, 2),
                     "floor_s": None if floor is None else round(floor, 2), "ratio": ratio, "floor_is": what})

    if cold is not None:
        whisper_floor = fl.unique_audio_s * fl.asr_rtf_alone / fl.asr_workers if fl.asr_rtf_alone else None
        row("Whisper (cold)", cold.asr_s / fl.asr_workers if cold.asr_s else None, whisper_floor,
            f"{fl.unique_audio_s:.0f} s unique audio x RTF {fl.asr_rtf_alone} alone / {fl.asr_workers} workers")
        row("sim (cold run: cells + Code2Wav, cores shared with Whisper)", cold.sim_cpu_s / fl.sim_workers,
            steady.scheduler_s / fl.sim_workers if steady else None,
            f"vLLM schedule()+update_from_output() for the same steps / {fl.sim_workers} workers")
        startup = cold.wall_s - cold.sim_cpu_s / fl.sim_workers - cold.tts_s - cold.asr_wait_s
        row("startup + reports (cold)", startup, fl.import_vllm_s + fl.cli_s,
            f"import vllm {fl.import_vllm_s} s + CLI --help {fl.cli_s} s")
    if steady is not None:
        row("sim (steady, in-process)", steady.seconds, steady.scheduler_s,
            "vLLM schedule()+update_from_output() inside the same cells")
    return rows


def table(runs: list[RunResult], steady: SteadyResult | None) -> str:
    head = ("run", "wall s", "sim s", "sim cpu s", "TTS s", "ASR decode s", "ASR wait s", "other s", "sim tok/s", "transcribed",
            "ASR cache hits", "TTS cache hits", "ASR RTF")
    rows = [(r.name, f"{r.wall_s:.1f}", f"{r.sim_s:.1f}", f"{r.sim_cpu_s:.1f}", f"{r.tts_s:.1f}", f"{r.asr_s:.1f}", f"{r.asr_wait_s:.1f}",
             f"{r.other_s:.1f}", f"{r.sim_tokens_per_s:,.0f}", str(r.transcribed), str(r.cache_hits),
             str(r.tts_cache_hits), f"{r.asr_rtf:.3f}" if r.asr_rtf is not None else "n/a") for r in runs]
    if steady is not None:
        rows.append(("sim steady", "", "", f"{steady.seconds:.1f}", "", "", "", "", f"{steady.tokens_per_s:,.0f}", "",
                     "", "", ""))
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
    return "\n".join(lines)


def floor_table(rows: list[dict]) -> str:
    head = ("stage", "measured s", "floor s", "ratio", "within 1.5x", "floor")
    body = [(r["stage"], "n/a" if r["measured_s"] is None else f"{r['measured_s']:.1f}",
             "n/a" if r["floor_s"] is None else f"{r['floor_s']:.1f}",
             "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}",
             "n/a" if r["ratio"] is None else ("yes" if r["ratio"] <= 1.5 else "no"), r["floor_is"]) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)] if body else [len(h) for h in head]
    fmt = "  ".join(f"{{:<{w}}}" if i in (0, 5) else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in body])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="default")
    ap.add_argument("--arm", action="append", default=None, help="repeatable (default: main, pr)")
    ap.add_argument("--deploy", action="append", default=None, help="repeatable (default: reference, stress)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--asr", default="faster-whisper", choices=("faster-whisper", "openai-whisper", "none"))
    ap.add_argument("--asr-model", default="base")
    ap.add_argument("--runs", default="cold,warm", help="comma list of cold, warm")
    ap.add_argument("--no-steady", action="store_true", help="skip the in-process steady-state sim measurement")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before giving up")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories and cache here")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    args = ap.parse_args()
    args.arm = args.arm or ["main", "pr"]
    args.deploy = args.deploy or ["reference", "stress"]

    work = args.keep or Path(tempfile.mkdtemp(prefix="omni-stress-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)  # cold means an empty transcript cache
    runs: list[RunResult] = []
    try:
        for name in [n.strip() for n in args.runs.split(",") if n.strip()]:
            if name not in ("cold", "warm"):
                raise SystemExit(f"bench: --runs: unknown run {name!r} (cold, warm)")
            shutil.rmtree(work / "runs" / name, ignore_errors=True)
            print(f"bench: {name} run ...", file=sys.stderr, flush=True)
            runs.append(run_cli(name, args, work / "runs", cache))
        steady = None
        if not args.no_steady:
            print("bench: steady-state sim ...", file=sys.stderr, flush=True)
            steady = steady_sim(args)
        print("bench: floors ...", file=sys.stderr, flush=True)
        cold_run = next((r for r in runs if r.name == "cold"), None)
        floors = measure_floors(args, cold_run)
        floors.rows = floor_rows(floors, cold_run, steady)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    by_name = {r.name: r for r in runs}
    measured = {
        "cold_wall_s": by_name["cold"].wall_s if "cold" in by_name else None,
        "warm_wall_s": by_name["warm"].wall_s if "warm" in by_name else None,
        "sim_tokens_per_s": steady.tokens_per_s if steady else (runs[0].sim_tokens_per_s if runs else None),
    }
    verdict = {k: (None if measured[k] is None else
                   (measured[k] >= v if k == "sim_tokens_per_s" else measured[k] <= v)) for k, v in TARGETS.items()}
    result = {
        "config": {"prompts": args.prompts, "arms": args.arm, "deploys": args.deploy, "repeat": args.repeat,
                   "asr": args.asr, "asr_model": args.asr_model, "seed": args.seed},
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                 "load_avg_1m": round(os.getloadavg()[0], 2)},
        "runs": [asdict(r) for r in runs],
        "sim_steady": asdict(steady) if steady else None,
        "floors": asdict(floors),
        "targets": TARGETS, "measured": measured, "meets_target": verdict,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(runs, steady))
    print()
    print(floor_table(floors.rows))
    print("targets: " + ", ".join(
        f"{k} {measured[k]} ({'ok' if verdict[k] else 'missed' if verdict[k] is False else 'n/a'}; target "
        f"{'>=' if k == 'sim_tokens_per_s' else '<='} {v:g})" for k, v in TARGETS.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
