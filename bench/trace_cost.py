"""What the trace plugin costs the real Talker it times (issue 34): the same real CPU run at each
``--trace`` level, per-step instrumentation overhead from the worker's own clocks, and the latency
difference against ``off``.

    .venv/bin/python bench/trace_cost.py [--model DIR] [--arm pr] [--repeat 1] [--json bench/trace_cost.json]

Per level (``off``, ``spans``, ``contract``): ``omni-stress run --backend vllm-omni --platform cpu`` with
the speaking tiny checkpoint (built with ``omni-stress tiny-model`` when ``--model`` is not given), the
``cpu-reference`` and ``cpu-stress`` deploys, the ``cpu_smoke`` prompts and ``--asr none``. The arm is
served from an arms file of the bench's own that adds ``OMNI_STRESS_TRACE_TIMING=1`` to its server
environment, so the Talker worker writes ``timing-<pid>.jsonl``: per runner step, the thread / process
CPU seconds and wall seconds spent in the instrumentation (everything the wrapper does around the
arm's call, the trace line's write and the contract check included) and the step's own (from its first
``talker_preprocess`` call to the next step's). Figures:

* overhead = instrumentation seconds / step seconds, summed over the cell's steps, on the worker
  thread's CPU clock (the primary figure: the host is shared, wall time is not this process's alone),
  its process CPU clock, and wall; ``off`` has no wrapper, so nothing to time (0 by construction);
* E2E, TTFA and RTF per cell (means over the requests), and E2E's difference from ``off``. TTFA is read
  from the trace (the first call at a generated position), so ``off`` has none; its difference is
  against ``spans``. Every line of the table carries the 1-minute load average around its run.

Targets: ``spans`` <= 3 %, ``contract`` <= 10 % of the step's time (thread CPU).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REAL_PY = REPO / ".venv-omni" / "bin" / "python"
CLI = [sys.executable, "-m", "harness.cli"]
LEVELS = ("off", "spans", "contract")
DEPLOYS = ("cpu-reference", "cpu-stress")
TARGETS = {"spans": 0.03, "contract": 0.10}
ARM_TALKERS = {"pr": "harness.families.qwen2_5_omni.pr:FixedTalker", "main": "harness.families.qwen2_5_omni.main:MainTalker"}


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def ensure_model(model: Path | None) -> Path:
    """The speaking tiny checkpoint: ``--model``, else one built once under the cache folder."""
    if model is not None:
        return model
    cache = Path(os.environ.get("OMNI_STRESS_CACHE_DIR") or Path.home() / ".cache" / "omni-stress")
    path = cache / "bench-tiny-speaking"
    if (path / "omni_stress_tiny_model.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the speaking tiny model in {path} ...", file=sys.stderr, flush=True)
    built = subprocess.run([*CLI, "tiny-model", str(path), "--python", str(REAL_PY)], cwd=REPO,
                           capture_output=True, text=True, timeout=1800, check=False)
    if built.returncode != 0:
        raise SystemExit(f"tiny-model failed:\n{built.stderr[-3000:]}")
    return path


def arms_file(folder: Path, arm: str) -> Path:
    """The arm, served by the real environment with per-step timings on (JSON is YAML)."""
    path = folder / "arms.yaml"
    path.write_text(json.dumps({"arms": {arm: {
        "talker": ARM_TALKERS[arm], "role": "candidate" if arm == "pr" else "baseline",
        "serve": {"python": str(REAL_PY), "env": {"OMNI_STRESS_TRACE_TIMING": "1"}}}}}))
    return path


def run_level(level: str, model: Path, arms: Path, arm: str, out: Path, run_id: str) -> dict:
    before = load1()
    t0 = time.monotonic()
    proc = subprocess.run(
        [*CLI, "run", "--backend", "vllm-omni", "--platform", "cpu", "--model", str(model), "--arms-file", str(arms),
         "--arm", arm, *[a for d in DEPLOYS for a in ("--deploy", d)], "--prompts", "cpu_smoke", "--asr", "none",
         "--trace", level, "--out", str(out), "--run-id", run_id, "--quiet", "--health-timeout", "900",
         "--request-timeout", "900"],
        cwd=out, capture_output=True, text=True, timeout=3600, check=False)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"--trace {level}: run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return {"run_dir": out / run_id, "wall_s": round(wall, 1), "load1_before": before, "load1_after": load1()}


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def cell_figures(run_dir: Path, arm: str, deploy: str) -> dict:
    """One cell's latencies (its requests) and instrumentation overhead (its Talker's timing lines)."""
    from harness.records import read_manifest, read_requests

    recs = [r for r in read_requests(run_dir) if r.arm == arm and r.deploy == deploy]
    cell = next(c for c in read_manifest(run_dir)["cells"] if c["arm"] == arm and c["deploy"] == deploy)
    steps = [json.loads(line) for p in sorted((run_dir / "serve" / f"{arm}-{deploy}-r1").glob("timing-*.jsonl"))
             for line in p.read_text().splitlines() if line.strip()]
    out: dict = {"trace": cell.get("trace"), "requests": len(recs), "errors": sum(r.error is not None for r in recs),
                 "e2e_s": _mean([r.wall_s for r in recs if r.error is None]),
                 "ttfa_s": _mean([r.ttfa_s for r in recs if r.ttfa_s is not None]),
                 "rtf": _mean([r.rtf for r in recs if r.rtf is not None]),
                 "steps": len(steps), "calls": sum(s["calls"] for s in steps)}
    for clock in ("thread", "process", "wall"):
        instr = sum(s[f"instr_{clock}_s"] for s in steps)
        step = sum(s[f"step_{clock}_s"] for s in steps)
        out[f"instr_{clock}_s"] = round(instr, 4)
        out[f"step_{clock}_s"] = round(step, 4)
        out[f"overhead_{clock}"] = round(instr / step, 4) if step > 0 else None
    per_step = [s["instr_thread_s"] / s["step_thread_s"] for s in steps if s["step_thread_s"] > 0]
    out["overhead_thread_median_step"] = round(statistics.median(per_step), 4) if per_step else None
    out["instr_us_per_call"] = round(1e6 * out["instr_thread_s"] / out["calls"], 1) if out["calls"] else None
    return out


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f} %"


def _num(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _delta(value: float | None, base: float | None) -> str:
    if value is None or base is None:
        return "–"
    return f"{value - base:+.3f} ({100 * (value - base) / base:+.1f} %)" if base else f"{value - base:+.3f}"


def table(rows: list[dict]) -> str:
    head = ["Deploy", "Level", "Steps", "Calls", "Instr µs/call (thread)", "Overhead thread CPU", "(process CPU)",
            "(wall)", "Median step", "Target", "E2E s", "ΔE2E vs off", "TTFA s", "ΔTTFA vs spans", "RTF",
            "Load 1m"]
    body = []
    for r in rows:
        target = TARGETS.get(r["level"])
        verdict = "–" if target is None or r["overhead_thread"] is None else (
            f"≤ {100 * target:.0f} % {'ok' if r['overhead_thread'] <= target else 'MISSED'}")
        body.append([r["deploy"], r["level"], str(r["steps"]), str(r["calls"]), _num(r["instr_us_per_call"], 1),
                     _pct(r["overhead_thread"]), _pct(r["overhead_process"]), _pct(r["overhead_wall"]),
                     _pct(r["overhead_thread_median_step"]), verdict, _num(r["e2e_s"]),
                     _delta(r["e2e_s"], r["e2e_off_s"]), _num(r["ttfa_s"]), _delta(r["ttfa_s"], r["ttfa_spans_s"]),
                     _num(r["rtf"]), f"{r['load1_before']:.2f}→{r['load1_after']:.2f}"])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="speaking tiny checkpoint (default: build one)")
    ap.add_argument("--arm", choices=sorted(ARM_TALKERS), default="pr")
    ap.add_argument("--levels", default=",".join(LEVELS), help="comma-separated, in run order")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over the levels (figures are per round)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the run directories (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "trace_cost.json")
    args = ap.parse_args()
    if not REAL_PY.exists():
        raise SystemExit(f"no real environment ({REAL_PY}): run scripts/install-real-cpu.sh")
    levels = [lv for lv in args.levels.split(",") if lv]
    if not set(levels) <= set(LEVELS):
        raise SystemExit(f"--levels: choose from {', '.join(LEVELS)}")
    model = ensure_model(args.model)
    out = args.out or Path(tempfile.mkdtemp(prefix="trace-cost-"))
    out.mkdir(parents=True, exist_ok=True)
    arms = arms_file(out, args.arm)
    rows: list[dict] = []
    runs: list[dict] = []
    for rnd in range(1, args.repeat + 1):
        by_level: dict[str, dict] = {}
        for level in levels:
            print(f"round {rnd}: --trace {level} ...", file=sys.stderr, flush=True)
            info = run_level(level, model, arms, args.arm, out, f"{level}-r{rnd}")
            runs.append({"round": rnd, "level": level, **{k: v for k, v in info.items() if k != "run_dir"}})
            by_level[level] = {d: {**cell_figures(info["run_dir"], args.arm, d), **info} for d in DEPLOYS}
            print(f"  {info['wall_s']} s, load {info['load1_before']} -> {info['load1_after']}", file=sys.stderr)
        for deploy in DEPLOYS:
            for level in levels:
                fig = dict(by_level[level][deploy])
                fig.pop("run_dir", None)
                rows.append({"round": rnd, "deploy": deploy, "level": level, **fig,
                             "e2e_off_s": by_level.get("off", {}).get(deploy, {}).get("e2e_s"),
                             "ttfa_spans_s": by_level.get("spans", {}).get(deploy, {}).get("ttfa_s")})
    text = table(rows)
    print(text)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                            check=False).stdout.strip()
    payload = {
        "what": "per-step instrumentation overhead of the trace plugin and latency per --trace level, real "
                "vllm-omni 0.30.0 server on CPU, speaking tiny model, cpu_smoke prompts, --asr none",
        "arm": args.arm, "deploys": list(DEPLOYS), "levels": levels, "targets": TARGETS,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()}, "runs": runs, "rows": rows,
        "table": text.splitlines(),
    }
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
