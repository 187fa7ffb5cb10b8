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

Writes ``bench/results.json`` (``--out``) and prints a table. Targets (issue 7, 2 CPU cores): cold
<= 60 s, warm <= 10 s, sim >= 50k scheduled tokens/s.
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


@dataclass
class SteadyResult:
    cells: list[SteadyCell] = field(default_factory=list)
    seconds: float = 0.0
    scheduled_tokens: int = 0
    tokens_per_s: float = 0.0


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
    from harness.config import load_arms, load_deploy, load_prompts, resolve_arm
    from harness.sim.backend import run_cell

    known = load_arms()
    arms = [resolve_arm(a, known) for a in args.arm]
    deploys = [load_deploy(d) for d in args.deploy]
    prompts = load_prompts(args.prompts)
    run_cell(arms[0], deploys[0], prompts, 1, args.seed, lambda r: None)  # imports, first-use costs
    result = SteadyResult()
    for arm in arms:
        for dep in deploys:
            for rep in range(1, args.repeat + 1):
                t0 = time.perf_counter()
                stats = run_cell(arm, dep, prompts, rep, args.seed + rep - 1, lambda r: None)
                seconds = time.perf_counter() - t0
                result.cells.append(SteadyCell(f"{arm.name}/{dep.name}/{rep}", stats.steps, stats.scheduled_tokens,
                                               round(seconds, 3), round(stats.scheduled_tokens / seconds)))
                result.seconds += seconds
                result.scheduled_tokens += stats.scheduled_tokens
    result.tokens_per_s = round(result.scheduled_tokens / result.seconds) if result.seconds else 0.0
    result.seconds = round(result.seconds, 3)
    return result


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
        "targets": TARGETS, "measured": measured, "meets_target": verdict,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(runs, steady))
    print("targets: " + ", ".join(
        f"{k} {measured[k]} ({'ok' if verdict[k] else 'missed' if verdict[k] is False else 'n/a'}; target "
        f"{'>=' if k == 'sim_tokens_per_s' else '<='} {v:g})" for k, v in TARGETS.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
