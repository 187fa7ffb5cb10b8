"""Benchmark of a sweep: ``omni-stress sweep`` as a user runs it, each stage beside its floor.

Target (issue 20, 2 CPU cores): the default sweep (24 grid points x 2 arms x 16 prompts, plus the
reference cell of each arm), ``--asr none``, under 2 minutes of wall time. The machine's load
average is recorded before and after: on shared cores the wall time says as much about the
neighbours as about the sweep.

Stages and their floors:

* sim: the run's time simulating or waiting for its sim workers (``stage_seconds.sim_wall`` of the
  manifest), beside the cells' own simulation seconds summed / sim workers (perfect parallelism of
  the same work);
* map: ``sweep_report.build_map`` + ``write_sweep_report`` in this process (load, summarize, gate,
  heatmaps), beside ``summary.load_run`` alone;
* other: wall - sim - map (interpreter start-up, imports, manifest, records), beside
  ``python -c "import vllm"`` + ``python -m harness.cli --help``.

    .venv/bin/python bench/sweep.py                         # default sweep, main and pr, seed 42
    .venv/bin/python bench/sweep.py --repeat 5              # five seeds (42..46): distinct schedules
    .venv/bin/python bench/sweep.py --sweep tests/data/sweep_tiny.yaml --prompts tests/data/prompts_e2e.yaml

Writes ``bench/sweep_results.json`` (``--out``) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_WALL_S = 120.0


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", default="default")
    parser.add_argument("--prompts", default="default")
    parser.add_argument("--arm", action="append", default=None)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "sweep_results.json")
    parser.add_argument("--keep", type=Path, default=None, help="write the run directory here (default: a temp dir)")
    args = parser.parse_args()
    arms = args.arm or ["main", "pr"]
    python = sys.executable
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        cmd = [python, "-m", "harness.cli", "sweep", args.sweep, "--asr", "none", "--quiet", "--no-plots",
               "--prompts", args.prompts, "--repeat", str(args.repeat), "--seed", str(args.seed),
               "--out", str(out), "--run-id", "bench"]
        for arm in arms:
            cmd += ["--arm", arm]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()
        if proc.returncode != 0:
            print(f"sweep exited {proc.returncode}:\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 2
        run_dir = out / "bench"
        manifest = json.loads((run_dir / "manifest.json").read_text())
        stages = manifest.get("stage_seconds", {})
        cells = manifest.get("cells", [])
        sys.path.insert(0, str(ROOT))
        from harness.gate import DEFAULT_RULES, load_rules
        from harness.report.summary import load_run
        from harness.sweep.report import build_map, write_sweep_report

        t1 = time.perf_counter()
        load_run(run_dir)
        load_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        sweep_map = build_map(run_dir, load_rules(DEFAULT_RULES))
        write_sweep_report(sweep_map, plots=True)
        map_s = time.perf_counter() - t1
        workers = min(2, os.cpu_count() or 1)
        floor_import = _timed([python, "-c", "import vllm"]) + _timed([python, "-m", "harness.cli", "--help"])
        sweep = manifest["sweep"]
        result = {
            "command": " ".join(cmd[1:]).replace(str(out), "OUT"),
            "points": len(sweep["points"]), "arms": arms, "repeat": args.repeat, "cells": len(cells),
            "prompts": len(manifest.get("prompt_ids", [])),
            "requests": sum(1 for line in (run_dir / "requests.jsonl").read_text().splitlines() if line.strip()),
            "wall_s": round(wall, 1), "target_wall_s": TARGET_WALL_S, "within_target": wall <= TARGET_WALL_S,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in load_after],
            "cpus": os.cpu_count(),
            "stages": {
                "sim_wall_s": stages.get("sim_wall"), "sim_floor_s": round(stages.get("sim", 0.0) / workers, 1),
                "sim_cell_seconds_summed": stages.get("sim"),
                "map_s": round(map_s, 2), "map_floor_s (load_run)": round(load_s, 2),
                "other_s": round(wall - (stages.get("sim_wall") or 0.0), 1),
                "other_floor_s (import vllm + cli --help)": round(floor_import, 1),
            },
            "mean_cell_sim_s": round(stages.get("sim", 0.0) / max(1, len(cells)), 2),
            "distinct_schedules": sweep_map.schedules.distinct, "request_runs": sweep_map.schedules.requests,
            "schedules_per_arm": sweep_map.schedules.per_arm,
            "verdict": {a.arm: {"status": a.status, "summary": a.summary, "knee": a.knee}
                        for a in sweep_map.verdict.arms},
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
        }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
