"""Benchmark of the quick commands' start-up: ``--help``, ``list``, ``report``, ``gate``, ``compare``.

Why (issue 23): a CI gate calls ``report`` and ``gate`` on every change and a user waits for
``--help``; none of them needs torch, vLLM or Whisper, so each should cost little more than
Python, Click and the libraries it really uses. This times each command the way a user runs it
(a fresh ``omni-stress`` process, wall time, median of ``--repeat`` runs) on a 64-request sim
run it makes first (main, pr x reference, stress x the 16 default prompts, ``--asr none``), and
beside it the command's floor: a fresh ``python -c "import click, ..."`` of those libraries.
Command and floor runs alternate, so a change in the machine's load hits both alike.

    .venv/bin/python bench/startup.py                      # makes the run (about a minute), then times
    .venv/bin/python bench/startup.py --run-dir results/X  # times on a copy of an existing run
    .venv/bin/python bench/startup.py --checkout /tmp/old  # another source tree's CLI (python -m harness.cli there)

Prints a table (command, measured s, floor s, target 1.5 s) with the load average before and
after, and writes ``bench/startup_results.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 1.5

_CLICK = "import click"
_MPL = "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot"
# How a floor process ends: as the console script does (``harness.cli.entry``: atexit handlers, then no
# interpreter teardown), so a command and its floor end alike and the teardown is in neither.
CLI_EXIT = "; import atexit, os; atexit._run_exitfuncs(); os._exit(0)"

# (label, omni-stress arguments with {a} and {b} for the two run directories, floor: what that command imports
# beyond the standard library, i.e. Python + Click + the libraries it really uses).
COMMANDS: list[tuple[str, list[str], str]] = [
    ("--help", ["--help"], _CLICK),
    ("list", ["list"], f"{_CLICK}, yaml"),
    ("report", ["report", "{a}"], f"{_CLICK}, yaml, pandas; {_MPL}"),
    ("report --no-write", ["report", "{a}", "--no-write"], f"{_CLICK}, yaml, pandas"),
    ("gate", ["gate", "{a}"], f"{_CLICK}, yaml, numpy"),
    ("compare", ["compare", "{a}", "{b}"], f"{_CLICK}, yaml, pandas"),
]
GATE_CODES = (0, 1)  # pass / a rule failed: both are a gate that ran; 2 (could not evaluate) is a bench error


def _wall(cmd: list[str], cwd: Path, env: dict[str, str], ok: tuple[int, ...] = (0,)) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          check=False)
    wall = time.perf_counter() - start
    if proc.returncode not in ok:
        raise SystemExit(f"bench: {' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return wall


def _cli(checkout: Path | None) -> tuple[list[str], Path, dict[str, str]]:
    """The command line, working directory and environment of ``omni-stress``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_STRESS_")}
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
        return [sys.executable, "-m", "harness.cli"], checkout, env
    script = Path(sys.executable).parent / "omni-stress"
    return ([str(script)] if script.exists() else [sys.executable, "-m", "harness.cli"]), ROOT, env


def make_run(where: Path, existing: Path | None) -> tuple[Path, Path]:
    """Two run directories: A (a fresh 64-request sim run, or a copy of EXISTING) and a copy B."""
    a, b = where / "a", where / "b"
    if existing is not None:
        shutil.copytree(existing, a)
    else:
        cmd = [sys.executable, "-m", "harness.cli", "run", "--arm", "main", "--arm", "pr", "--deploy", "reference",
               "--deploy", "stress", "--prompts", "default", "--asr", "none", "--quiet", "--out", str(where),
               "--run-id", "a"]
        print("bench: making the 64-request sim run ...", file=sys.stderr, flush=True)
        t = _wall(cmd, ROOT, _cli(None)[2])
        print(f"bench: run made in {t:.1f} s", file=sys.stderr, flush=True)
    requests = sum(1 for line in (a / "requests.jsonl").read_text().splitlines() if line.strip())
    if existing is None and requests != 64:
        raise SystemExit(f"bench: the sim run has {requests} requests, expected 64")
    shutil.copytree(a, b)
    return a, b


def measure(run_a: Path, run_b: Path, repeat: int, checkout: Path | None) -> list[dict]:
    base, cwd, env = _cli(checkout)
    samples: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label, _, _ in COMMANDS}
    for _label, args, floor in COMMANDS:  # one unmeasured run each: file caches warm, .pyc written
        cmd = base + [x.format(a=run_a, b=run_b) for x in args]
        _wall(cmd, cwd, env, GATE_CODES if args[0] == "gate" else (0,))
        _wall([sys.executable, "-c", floor + CLI_EXIT], ROOT, env)
    for _ in range(repeat):
        for label, args, floor in COMMANDS:
            cmd = base + [x.format(a=run_a, b=run_b) for x in args]
            samples[label][0].append(_wall(cmd, cwd, env, GATE_CODES if args[0] == "gate" else (0,)))
            samples[label][1].append(_wall([sys.executable, "-c", floor + CLI_EXIT], ROOT, env))
    rows = []
    for label, args, floor in COMMANDS:
        measured, floors = samples[label]
        m, f = statistics.median(measured), statistics.median(floors)
        rows.append({"command": f"omni-stress {label}", "args": args, "measured_s": round(m, 3),
                     "floor_s": round(f, 3), "floor": f"python -c \"{floor}\"", "target_s": TARGET_S,
                     "within_target": m <= TARGET_S, "over_floor_s": round(m - f, 3),
                     "samples_s": [round(x, 3) for x in measured], "floor_samples_s": [round(x, 3) for x in floors]})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'command':<32} {'measured s':>10} {'floor s':>8} {'target s':>8}  ok",
             f"{'-' * 32} {'-' * 10} {'-' * 8} {'-' * 8}  --"]
    for r in rows:
        lines.append(f"{r['command']:<32} {r['measured_s']:>10.2f} {r['floor_s']:>8.2f} {r['target_s']:>8.1f}  "
                     f"{'yes' if r['within_target'] else 'NO'}")
    return "\n".join(lines)


def _git_head(where: Path) -> str | None:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=False)
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="Timed runs per command and floor (median).")
    ap.add_argument("--run-dir", type=Path, default=None,
                    help="Time on a copy of this run directory instead of making a 64-request sim run.")
    ap.add_argument("--checkout", type=Path, default=None,
                    help="Time another source tree's CLI (python -m harness.cli with it first on PYTHONPATH).")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "startup_results.json")
    args = ap.parse_args()
    checkout = args.checkout.resolve() if args.checkout else None
    with tempfile.TemporaryDirectory(prefix="omni-stress-startup-") as tmp:
        run_a, run_b = make_run(Path(tmp), args.run_dir)
        load_before = os.getloadavg()
        rows = measure(run_a, run_b, args.repeat, checkout)
        load_after = os.getloadavg()
    where = f"checkout {checkout}" if checkout else "this checkout"
    print(f"start-up of the quick commands ({where}), median of {args.repeat} fresh processes; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(table(rows))
    result = {
        "what": "omni-stress quick-command start-up vs its floor (issue 23)",
        "host": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "git_head": _git_head(checkout or ROOT), "checkout": str(checkout) if checkout else None,
        "run": f"{'copy of ' + str(args.run_dir) if args.run_dir else '64-request sim run (main, pr x reference, stress x 16 default prompts, --asr none)'}",
        "repeat": args.repeat, "target_s": TARGET_S,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
