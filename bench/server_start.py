"""Where a real CPU server's start goes, and what the CPU profile's start-up options save (issue 48 item 3).

    .venv/bin/python bench/server_start.py [--model DIR] [--repeat 2] [--baseline /path/to/old/checkout]

Each sample is one cell the way a user runs it: ``omni-stress run --backend vllm-omni --platform cpu``
(arm pr, ``cpu-reference``, the four ``cpu_smoke`` prompts, ``--asr none``) on the speaking tiny
checkpoint (built with ``omni-stress tiny-model`` when ``--model`` is not given), from this checkout
and, with ``--baseline``, from another source tree (``python -m harness.cli`` there, e.g. a
``git worktree`` of the commit before a change); the two alternate, so a change in the machine's load
hits both alike. From each sample: the harness's ``server_start_s`` (launch to ``/health`` 200, the
manifest), the cell's wall time, and from the server log (vLLM's per-line timestamps, 1 s resolution)
when the API server logged its first line, when each stage's engine core began, when it finished its
start (``init engine ... took``), and how many processes logged (API server, stage engine cores, stage
workers).

Prints a table and writes ``bench/server_start.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REAL_PY = ROOT / ".venv-omni" / "bin" / "python"
LINE = re.compile(r"^(?:\((?P<proc>[A-Za-z_0-9]+) pid=(?P<pid>\d+)\) )?(?:INFO|WARNING|DEBUG|ERROR) "
                  r"(?P<ts>\d\d-\d\d \d\d:\d\d:\d\d) \[[^\]]+\] (?P<msg>.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAGE = re.compile(r"StageEngineCoreProc_stage(\d+)_replica\d+")


def _ts(text: str) -> float:
    return datetime.strptime(f"2000-{text}", "%Y-%m-%d %H:%M:%S").timestamp()


def phases(log: Path) -> dict[str, Any]:
    """The start's milestones, in seconds after the API server's first timestamped line."""
    first: float | None = None
    stage_begin: dict[str, float] = {}
    stage_ready: dict[str, float] = {}
    pids: set[tuple[str, str]] = set()
    for raw in log.read_text(encoding="utf-8", errors="replace").splitlines():
        m = LINE.match(ANSI.sub("", raw))
        if m is None:
            continue
        t = _ts(m["ts"])
        first = t if first is None else first
        proc, msg = m["proc"] or "", m["msg"]
        if m["pid"]:
            pids.add((proc.split("_")[0], m["pid"]))
        if (s := STAGE.fullmatch(proc)) is not None:
            stage_begin.setdefault(s[1], t)
            if "init engine" in msg:
                stage_ready[s[1]] = t
    if first is None:
        return {}
    rel = lambda t: None if t is None else round(t - first, 0)  # noqa: E731
    return {
        "stage_begin_s": {k: rel(v) for k, v in sorted(stage_begin.items())},
        "stage_ready_s": {k: rel(v) for k, v in sorted(stage_ready.items())},
        "processes": {kind: sum(1 for k, _ in pids if k == kind) for kind in sorted({k for k, _ in pids})},
    }


def sample(checkout: Path, model: Path, work: Path, run_id: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "harness.cli", "run", "--backend", "vllm-omni", "--platform", "cpu",
            "--serve-python", str(REAL_PY), "--model", str(model), "--arm", "pr", "--deploy", "cpu-reference",
            "--prompts", "cpu_smoke", "--asr", "none", "--out", str(work), "--run-id", run_id, "--quiet",
            "--health-timeout", "900", "--request-timeout", "900"]
    t0 = time.perf_counter()
    res = subprocess.run(argv, cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True,
                         text=True, timeout=1800, check=False)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{checkout}: run exited {res.returncode}: {res.stderr[-1500:]}")
    run = work / run_id
    manifest = json.loads((run / "manifest.json").read_text())
    start = manifest["cells"][0]["serve_seconds"]["server_start_s"]
    logs = sorted(run.glob("server-*.log"))
    return {"server_start_s": start, "cell_wall_s": round(wall, 1), **(phases(logs[0]) if logs else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="the speaking tiny checkpoint (built when not given)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--baseline", type=Path, help="another source tree to time beside this one")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "server_start.json")
    args = ap.parse_args()
    if not REAL_PY.exists():
        raise SystemExit(f"{REAL_PY} is missing: bash scripts/install-real-cpu.sh")
    with tempfile.TemporaryDirectory(prefix="omni-stress-start-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            model = work / "tiny"
            subprocess.run([sys.executable, "-m", "harness.cli", "tiny-model", str(model), "--python", str(REAL_PY)],
                           cwd=ROOT, check=True, capture_output=True, timeout=900)
        trees = {"this checkout": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
        load_before = os.getloadavg()
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for i in range(args.repeat):
            for name, tree in (reversed(trees.items()) if i % 2 else trees.items()):
                samples[name].append(sample(tree, model, work, f"{name.replace(' ', '-')}-{i}"))
                print(f"{name} #{i}: {samples[name][-1]}", file=sys.stderr)
        load_after = os.getloadavg()
    rows = []
    for name, got in samples.items():
        rows.append({"tree": name, "path": str(trees[name]),
                     "server_start_s_median": statistics.median(s["server_start_s"] for s in got),
                     "cell_wall_s_median": statistics.median(s["cell_wall_s"] for s in got), "samples": got})
    print(f"{'tree':<15} {'server start (s)':>17} {'cell wall (s)':>14}  processes, stage begin -> ready (s)")
    for row in rows:
        last = row["samples"][-1]
        stages = ", ".join(f"{k}: {last.get('stage_begin_s', {}).get(k)}->{v}"
                           for k, v in last.get("stage_ready_s", {}).items())
        print(f"{row['tree']:<15} {row['server_start_s_median']:>17} {row['cell_wall_s_median']:>14}  "
              f"{last.get('processes')}, {stages}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    args.out.write_text(json.dumps({"what": "real CPU server start (issue 48 item 3)", "cpu_count": os.cpu_count(),
                                    "repeat": args.repeat, "load_average_before": load_before,
                                    "load_average_after": load_after, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
