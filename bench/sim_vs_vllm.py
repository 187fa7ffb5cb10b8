"""Issue 23's sim and report targets, each beside its floor, measured in one bench run.

* **sim per cell vs vLLM's own scheduling** (target: <= 2x): every cell of the matrix is simulated
  in this process after a warm-up cell (vLLM imported, first-use costs paid), and inside the same
  cells vLLM's ``Scheduler.schedule()`` + ``update_from_output()`` are timed (the floor: the sim
  cannot cost less than the scheduler it drives). Both are read as this thread's CPU time
  (``time.thread_time``), which a loaded machine stretches far less than wall time, and as wall
  time; the ratio is cell / scheduler.
* **main job** (target: warm <= 8 s): ``omni-stress run`` on the matrix as a fresh process with
  faster-whisper, against a transcript/TTS cache (``--cache-dir``; the first run fills it when it
  is cold, and only a run whose requests were all cache hits counts as warm).
* **--asr none** (target <= 8 s): the same run without TTS and Whisper.
* **cold** (target <= 45 s, ``--cold``): the main job with an empty transcript/TTS cache, and its
  Whisper stage beside Whisper's floor (target: within 1.5x): the run's distinct audio seconds x
  the real-time factor of the same model decoding a sample of those WAVs alone in a fresh
  one-thread process / ASR workers (``bench/matrix.py``'s probe).
* **floors of the runs**: ``python -c`` importing what a run imports (the CLI, torch, vLLM's
  scheduler, pandas, matplotlib), plus vLLM's own scheduling of the cells (wall, measured above)
  over the two sim workers; the cold floor adds Whisper's floor.
* **quick commands** (target <= 1.5 s each, ``--startup``): ``--help``, ``list``, ``report``,
  ``gate``, ``compare`` on the ``--asr none`` run, each beside its import floor
  (``bench/startup.py``'s measurement, fewer repeats).
* **report** (target: its own work <= 1 s beyond imports): ``omni-stress report`` on the
  ``--asr none`` run's directory (64 requests), as a fresh process, beside its floor: a fresh
  ``python -c`` importing what ``report`` imports (Click, pandas, the harness's report modules).
  Wall and CPU (user + sys of the child) are both printed; commands and floors alternate.

    .venv/bin/python bench/sim_vs_vllm.py --cold --startup    # every target of issue 23 (cold: a few minutes)
    .venv/bin/python bench/sim_vs_vllm.py                     # sim, warm main job, --asr none, report
    .venv/bin/python bench/sim_vs_vllm.py --no-asr-run        # sim, --asr none and report only
    .venv/bin/python bench/sim_vs_vllm.py --prompts tests/fixtures/prompts_small.yaml --no-asr-run

Prints a table with the load average before and after, and writes ``bench/sim_vs_vllm.json``
(``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"sim_over_scheduler": 2.0, "main_warm_s": 8.0, "asr_none_s": 8.0, "cold_s": 45.0,
           "whisper_over_floor": 1.5, "report_own_s": 1.0, "quick_command_s": 1.5}
REPORT_FLOOR = ("import click, yaml, numpy, pandas; import harness.cli, harness.report.tables, harness.report.summary, "
                "harness.commands.report")
# What an ``omni-stress run`` of the sim cannot avoid importing: the CLI, torch, vLLM's scheduler and what a
# cell builds, and the report's pandas and matplotlib.
RUN_FLOOR = ("import click, yaml, torch, pandas; import harness.cli, harness.commands.run; "
             "import vllm.config, vllm.sampling_params, vllm.v1.core.sched.scheduler, vllm.v1.request, "
             "vllm.v1.outputs; import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot")


def _timed(fn, clock: dict[str, float]):
    """``fn`` adding its thread CPU time, wall time and one call to ``clock`` each time it runs."""

    def timed(*a, **k):
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            clock["cpu"] += time.thread_time() - c0
            clock["wall"] += time.perf_counter() - w0
            clock["calls"] += 1

    timed.__wrapped__ = fn  # type: ignore[attr-defined]
    return timed


def _time_vllm_scheduler() -> dict[str, float]:
    """Wraps vLLM's ``Scheduler.schedule`` and ``update_from_output`` with a timer (thread CPU and
    wall); returns the accumulator they add to."""
    from vllm.v1.core.sched.scheduler import Scheduler

    clock = {"cpu": 0.0, "wall": 0.0, "calls": 0}
    for name in ("schedule", "update_from_output"):
        fn = getattr(Scheduler, name)
        setattr(Scheduler, name, _timed(getattr(fn, "__wrapped__", fn), clock))
    return clock


def _time_arm() -> dict[str, float]:
    """Times the arm's own ``talker_preprocess`` (the code under test, which the sim calls once per
    request per step as the real runner does) inside ``armcall.call``: the sim's guards and row
    checks stay on the sim's side of the ledger. Returns the accumulator."""
    from harness.sim import armcall

    clock = {"cpu": 0.0, "wall": 0.0, "calls": 0}
    call = getattr(armcall.call, "__wrapped__", armcall.call)

    def timed_call(fn, /, **kwargs):
        return call(_timed(fn, clock), **kwargs)

    timed_call.__wrapped__ = call  # type: ignore[attr-defined]
    armcall.call = timed_call
    return clock


def sim_cells(args: argparse.Namespace) -> list[dict]:
    from harness.config import load_arms, load_deploy, load_prompts
    from harness.talkers import resolve_arm
    from harness.sim.steploop import run_cell

    known = load_arms()
    arms = [resolve_arm(a, known) for a in args.arm]
    deploys = [load_deploy(d) for d in args.deploy]
    prompts = load_prompts(args.prompts)
    run_cell(arms[0], deploys[0], load_prompts("cpu_smoke"), 1, args.seed, lambda r: None)  # imports, first use
    clock = _time_vllm_scheduler()
    arm_clock = _time_arm()
    rows = []
    for arm in arms:
        for dep in deploys:
            for c in (clock, arm_clock):
                for key in c:
                    c[key] = 0
            c0, w0 = time.thread_time(), time.perf_counter()
            stats = run_cell(arm, dep, prompts, 1, args.seed, lambda r: None)
            cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
            rows.append({"cell": f"{arm.name}/{dep.name}", "steps": stats.steps, "spans": len(stats.spans),
                         "scheduled_tokens": stats.scheduled_tokens, "cell_cpu_s": round(cpu, 3),
                         "cell_wall_s": round(wall, 3), "scheduler_cpu_s": round(clock["cpu"], 3),
                         "scheduler_wall_s": round(clock["wall"], 3), "arm_cpu_s": round(arm_clock["cpu"], 3),
                         "arm_wall_s": round(arm_clock["wall"], 3), "arm_calls": arm_clock["calls"],
                         "ratio_cpu": round(cpu / clock["cpu"], 2) if clock["cpu"] else None,
                         "ratio_wall": round(wall / clock["wall"], 2) if clock["wall"] else None})
    return rows


def _child(cmd: list[str], env: dict[str, str] | None = None, ok: tuple[int, ...] = (0,)) -> tuple[float, float]:
    """(wall, user + sys CPU) of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in ok:
        raise SystemExit(f"bench: `{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_job(args: argparse.Namespace, out: Path, name: str, asr: str, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "harness.cli", "run", "--quiet", "--out", str(out), "--run-id", name,
           "--cache-dir", str(cache), "--prompts", args.prompts, "--asr", asr, "--seed", str(args.seed)]
    for a in args.arm:
        cmd += ["--arm", a]
    for d in args.deploy:
        cmd += ["--deploy", d]
    shutil.rmtree(out / name, ignore_errors=True)
    wall, cpu = _child(cmd)
    manifest = json.loads((out / name / "manifest.json").read_text())
    st = manifest.get("stage_seconds", {})
    requests = sum(1 for line in (out / name / "requests.jsonl").read_text().splitlines() if line.strip())
    return {"run": name, "asr": asr, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "requests": requests,
            "sim_wall_s": st.get("sim_wall"), "asr_transcribed": st.get("asr_transcribed"),
            "asr_cache_hits": st.get("asr_cache_hits"), "run_dir": str(out / name)}


def time_report(run_dir: Path, repeat: int) -> dict:
    """``omni-stress report RUN_DIR`` and its import floor, alternating; medians."""
    cmd = [sys.executable, "-m", "harness.cli", "report", str(run_dir)]
    floor = [sys.executable, "-c", REPORT_FLOOR + _bench_module("startup").CLI_EXIT]
    _child(cmd)  # the first report after a run may draw what the run did not record
    samples: dict[str, list[tuple[float, float]]] = {"report": [], "floor": []}
    for _ in range(repeat):
        samples["report"].append(_child(cmd))
        samples["floor"].append(_child(floor))

    def med(kind: str, i: int) -> float:
        return round(statistics.median(s[i] for s in samples[kind]), 3)

    return {"report_wall_s": med("report", 0), "report_cpu_s": med("report", 1), "floor_wall_s": med("floor", 0),
            "floor_cpu_s": med("floor", 1), "own_wall_s": round(med("report", 0) - med("floor", 0), 3),
            "own_cpu_s": round(med("report", 1) - med("floor", 1), 3), "floor": f"python -c \"{REPORT_FLOOR}\"",
            "samples": samples}


def _bench_module(name: str):
    """``bench/<name>.py`` as a module (its measurement code, shared rather than copied)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses resolve their string annotations through it
    spec.loader.exec_module(module)
    return module


def time_run_floor(repeat: int) -> dict:
    """A fresh ``python -c`` importing what a sim run imports (median wall and CPU)."""
    code = RUN_FLOOR + _bench_module("startup").CLI_EXIT  # the run's own exit: no interpreter teardown
    samples = [_child([sys.executable, "-c", code]) for _ in range(repeat)]
    teardown = [_child([sys.executable, "-c", RUN_FLOOR]) for _ in range(repeat)]  # said beside it, not used
    return {"wall_s": round(statistics.median(s[0] for s in samples), 3),
            "cpu_s": round(statistics.median(s[1] for s in samples), 3), "floor": f"python -c \"{code}\"",
            "wall_with_teardown_s": round(statistics.median(s[0] for s in teardown), 3)}


def whisper_floor(run_dir: Path, asr: str, model: str) -> dict:
    """Whisper's floor for a cold run: its distinct audio seconds x the RTF of the same model decoding
    about six of those WAVs alone in a fresh one-thread process / ASR workers (``bench/matrix.py``)."""
    matrix = _bench_module("matrix")
    audio_s, paths = matrix.unique_audio(run_dir)
    workers = min(2, os.cpu_count() or 1)
    if not paths:
        return {"unique_audio_s": 0.0, "rtf_alone": None, "workers": workers, "floor_s": None}
    step = max(1, len(paths) // 6)
    sample = [str(p) for p in paths[::step][:6]]
    proc = subprocess.run([sys.executable, "-c", matrix._RTF_PROBE, asr, model, *sample], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=True)
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    rtf = probe["decode_s"] / probe["audio_s"] if probe["audio_s"] else None
    return {"unique_audio_s": round(audio_s, 1), "rtf_alone": None if rtf is None else round(rtf, 4),
            "workers": workers, "floor_s": None if rtf is None else round(audio_s * rtf / workers, 2)}


def quick_commands(run_dir: Path, repeat: int) -> list[dict]:
    """``bench/startup.py``'s measurement of the quick commands on copies of ``run_dir``."""
    startup = _bench_module("startup")
    where = Path(tempfile.mkdtemp(prefix="omni-stress-bench23-startup-"))
    try:
        a, b = startup.make_run(where, run_dir)
        return startup.measure(a, b, repeat, None)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _fmt_table(head: tuple[str, ...], rows: list[tuple]) -> str:
    rows = [tuple(str(x) for x in r) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="default")
    ap.add_argument("--arm", action="append", default=None, help="repeatable (default: main, pr)")
    ap.add_argument("--deploy", action="append", default=None, help="repeatable (default: reference, stress)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--no-sim", action="store_true", help="skip the in-process sim-vs-scheduler cells")
    ap.add_argument("--no-asr-run", action="store_true", help="skip the main job with faster-whisper")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="transcript/TTS cache of the main job (default: the run's default cache)")
    ap.add_argument("--cold", action="store_true",
                    help="also the main job cold (an empty cache) and Whisper beside its floor (minutes)")
    ap.add_argument("--startup", action="store_true",
                    help="also the quick commands (--help, list, report, gate, compare) beside their floors")
    ap.add_argument("--startup-repeat", type=int, default=3)
    ap.add_argument("--floor-repeat", type=int, default=3)
    ap.add_argument("--report-repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "sim_vs_vllm.json")
    args = ap.parse_args()
    args.arm = args.arm or ["main", "pr"]
    args.deploy = args.deploy or ["reference", "stress"]
    load_before = [round(x, 2) for x in os.getloadavg()]
    work = Path(tempfile.mkdtemp(prefix="omni-stress-bench23-"))
    result: dict = {"config": {"prompts": args.prompts, "arms": args.arm, "deploys": args.deploy, "seed": args.seed},
                    "host": {"platform": platform.platform(), "python": platform.python_version(),
                             "cpus": os.cpu_count()}, "load_average_before": load_before, "targets": TARGETS}
    try:
        if not args.no_sim:
            print("bench: sim cells in-process ...", file=sys.stderr, flush=True)
            cells = sim_cells(args)
            tot = {k: sum(c[k] for c in cells) for k in ("cell_cpu_s", "cell_wall_s", "scheduler_cpu_s",
                                                          "scheduler_wall_s", "arm_cpu_s", "arm_wall_s")}
            result["sim"] = {"cells": cells, "total": {**{k: round(v, 3) for k, v in tot.items()},
                             "ratio_cpu": round(tot["cell_cpu_s"] / tot["scheduler_cpu_s"], 2),
                             "ratio_wall": round(tot["cell_wall_s"] / tot["scheduler_wall_s"], 2),
                             # the floor with the arms as they are: vLLM's scheduling plus the arm's own calls
                             "floor_with_arm_cpu": round((tot["scheduler_cpu_s"] + tot["arm_cpu_s"])
                                                         / tot["scheduler_cpu_s"], 2),
                             # the sim's own work (neither the scheduler nor the arm) over the scheduler's
                             "own_over_scheduler_cpu": round((tot["cell_cpu_s"] - tot["scheduler_cpu_s"]
                                                              - tot["arm_cpu_s"]) / tot["scheduler_cpu_s"], 2)}}
        print("bench: omni-stress run --asr none ...", file=sys.stderr, flush=True)
        none_run = run_job(args, work / "runs", "asr-none", "none", work / "cache-none")
        result["asr_none"] = none_run
        if not args.no_asr_run:
            cache = args.cache_dir or Path(os.environ.get("OMNI_STRESS_CACHE_DIR") or
                                           Path.home() / ".cache" / "omni-stress")
            print(f"bench: omni-stress run (faster-whisper, cache {cache}) ...", file=sys.stderr, flush=True)
            first = run_job(args, work / "runs", "main-1", "faster-whisper", cache)
            warm = first
            if first["asr_transcribed"]:  # it was cold: run again, warm
                print("bench: omni-stress run again (warm) ...", file=sys.stderr, flush=True)
                warm = run_job(args, work / "runs", "main-2", "faster-whisper", cache)
            result["main_first"], result["main_warm"] = first, warm
        if args.cold:
            print("bench: omni-stress run cold (faster-whisper, an empty cache) ...", file=sys.stderr, flush=True)
            cold = run_job(args, work / "runs", "main-cold", "faster-whisper", work / "cache-cold")
            print("bench: Whisper's floor ...", file=sys.stderr, flush=True)
            manifest = json.loads((Path(cold["run_dir"]) / "manifest.json").read_text())
            cold["asr_s"] = manifest.get("stage_seconds", {}).get("asr")
            cold["asr_cpu_s"] = manifest.get("stage_seconds", {}).get("asr_cpu")
            result["main_cold"] = cold
            result["whisper_floor"] = whisper_floor(Path(cold["run_dir"]), "faster-whisper", "base")
        print("bench: omni-stress report ...", file=sys.stderr, flush=True)
        result["report"] = time_report(Path(none_run["run_dir"]), args.report_repeat)
        print("bench: the runs' import floor ...", file=sys.stderr, flush=True)
        result["run_floor"] = time_run_floor(args.floor_repeat)
        if args.startup:
            print("bench: quick commands (bench/startup.py) ...", file=sys.stderr, flush=True)
            result["quick_commands"] = quick_commands(Path(none_run["run_dir"]), args.startup_repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]

    sched_wall = result.get("sim", {}).get("total", {}).get("scheduler_wall_s")
    sim_workers = min(2, os.cpu_count() or 1)
    run_floor = result["run_floor"]["wall_s"] + (sched_wall / sim_workers if sched_wall else 0.0)
    result["run_floor"]["with_scheduling_s"] = round(run_floor, 2)
    wf = result.get("whisper_floor", {})
    cold = result.get("main_cold")
    measured = {"sim_over_scheduler": result.get("sim", {}).get("total", {}).get("ratio_cpu"),
                "main_warm_s": result["main_warm"]["wall_s"] if "main_warm" in result and
                not result["main_warm"]["asr_transcribed"] else None,
                "asr_none_s": result["asr_none"]["wall_s"], "report_own_s": result["report"]["own_cpu_s"],
                "cold_s": cold["wall_s"] if cold else None,
                "whisper_over_floor": round(cold["asr_s"] / wf["workers"] / wf["floor_s"], 2)
                if cold and cold.get("asr_s") and wf.get("floor_s") else None,
                # Whisper's own work (the workers' CPU seconds) over the same floor: what is left of the
                # ratio once the cores it shares with the sim are taken out
                "whisper_cpu_over_floor": round(cold["asr_cpu_s"] / wf["workers"] / wf["floor_s"], 2)
                if cold and cold.get("asr_cpu_s") and wf.get("floor_s") else None,
                "quick_command_s": max(r["measured_s"] for r in result["quick_commands"])
                if result.get("quick_commands") else None}
    result["measured"] = measured
    result["meets_target"] = {k: None if v is None else v <= TARGETS[k] for k, v in measured.items()
                              if k in TARGETS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    if "sim" in result:
        rows = [(c["cell"], c["steps"], c["spans"], f"{c['cell_cpu_s']:.2f}", f"{c['scheduler_cpu_s']:.2f}",
                 f"{c['arm_cpu_s']:.2f}", f"{c['ratio_cpu']:.2f}", f"{c['cell_wall_s']:.2f}",
                 f"{c['scheduler_wall_s']:.2f}", f"{c['ratio_wall']:.2f}") for c in result["sim"]["cells"]]
        t = result["sim"]["total"]
        rows.append(("all cells", "", "", f"{t['cell_cpu_s']:.2f}", f"{t['scheduler_cpu_s']:.2f}",
                     f"{t['arm_cpu_s']:.2f}", f"{t['ratio_cpu']:.2f}", f"{t['cell_wall_s']:.2f}",
                     f"{t['scheduler_wall_s']:.2f}", f"{t['ratio_wall']:.2f}"))
        print(_fmt_table(("cell", "steps", "spans", "sim cpu s", "vLLM sched cpu s", "arm cpu s", "ratio",
                          "sim wall s", "vLLM sched wall s", "ratio"), rows))
        print()
    r = result["report"]
    floor_what = (f"{run_floor:.2f} (imports {result['run_floor']['wall_s']}"
                  + (f" + vLLM scheduling {sched_wall:.2f} / {sim_workers})" if sched_wall else ")"))
    rows = []
    if "sim" in result:
        t = result["sim"]["total"]
        rows.append(("sim per cell / vLLM scheduling (cpu)", t["ratio_cpu"],
                     f"1.00 (the scheduler); {t['floor_with_arm_cpu']:.2f} with the arms' own calls", "<= 2x"))
        rows.append(("  of which the sim's own work / scheduling", t["own_over_scheduler_cpu"], "0", ""))
    if "main_warm" in result:
        w = result["main_warm"]
        rows.append(("main job warm: wall s" + ("" if not w["asr_transcribed"] else " (NOT warm: transcribed)"),
                     w["wall_s"], floor_what, "<= 8 s"))
    rows.append(("--asr none: wall s", result["asr_none"]["wall_s"], floor_what, "<= 8 s"))
    if cold:
        cold_floor = run_floor + (wf.get("floor_s") or 0.0)
        rows.append(("main job cold: wall s", cold["wall_s"], f"{cold_floor:.2f} (the above + Whisper's floor)",
                     "<= 45 s"))
        if wf.get("floor_s"):
            rows.append(("Whisper (cold): decode s / workers", round(cold["asr_s"] / wf["workers"], 2),
                         f"{wf['floor_s']} ({wf['unique_audio_s']} s audio x RTF {wf['rtf_alone']} / {wf['workers']})",
                         "<= 1.5x floor"))
            if cold.get("asr_cpu_s"):
                rows.append(("  Whisper's CPU s / workers (its own work)", round(cold["asr_cpu_s"] / wf["workers"], 2),
                             f"{wf['floor_s']}", ""))
    rows.append(("report (64 requests): wall s", r["report_wall_s"], f"{r['floor_wall_s']} (imports)", ""))
    rows.append(("report: cpu s (own = report - floor)", f"{r['report_cpu_s']} (own {r['own_cpu_s']})",
                 f"{r['floor_cpu_s']} (imports)", "own <= 1 s"))
    for q in result.get("quick_commands") or []:
        rows.append((f"{q['command']}: wall s", q["measured_s"], f"{q['floor_s']} (imports)", "<= 1.5 s"))
    print(_fmt_table(("what", "measured", "floor", "target"), rows))
    print(f"load average before {load_before}, after {result['load_average_after']} ({os.cpu_count()} cpus)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
