"""Issue 34's targets, each beside its floor, from one bench run: prints a table, writes JSON.

Runs the benches that measure them (each also writes its own JSON, under ``--work``) and puts
their figures side by side:

* **warm job** (target <= 1.3x its floor): ``omni-stress run --arm main --arm pr`` with a warm
  transcript cache, beside ``bench/sim_vs_vllm.py``'s floor: the run's imports
  (``python -c "import click, yaml, torch, pandas, vllm..."``) + vLLM's own scheduling of the four
  cells / the two sim workers;
* **sim per cell** (target <= 3.2x vLLM's scheduling): the four cells in one process, the sim's
  CPU seconds over ``Scheduler.schedule`` + ``update_from_output``'s; the floor with the arms as
  they are adds the arm's own ``talker_preprocess`` CPU seconds;
* **default sweep** (target <= 120 s wall): ``bench/sweep.py``, beside its sim floor (the cells'
  own simulation seconds summed / 2 workers) + the import floor;
* **trace levels** (targets: ``spans`` <= 3 %, ``contract`` <= 10 % of the Talker's step time on
  CPU): ``bench/trace_cost.py`` on the real server, when ``--trace`` is given (minutes; needs
  ``.venv-omni``), else the figures of its last JSON (``bench/trace_cost.json``), marked as such;
* **scoring at scale**: ``bench/asr_scale.py``'s CPU seconds per audio second, per-clip vs
  batched vs workers vs Ray actors, beside Whisper's single-thread floor, from its last JSON
  (``bench/asr_scale.json``; ``--asr`` runs it again: about 15 minutes on 2 cores).

Every target is only as good as the machine is quiet: the load averages before and after are
recorded, and a run on shared cores says so in the table's last line.

    .venv/bin/python bench/targets.py                 # warm job, sim cells, default sweep (~6 min quiet)
    .venv/bin/python bench/targets.py --trace --asr   # and the real-server trace levels and ASR scaling
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
TARGETS = {"warm_over_floor": 1.3, "sim_over_scheduler": 3.2, "sweep_s": 120.0,
           "trace_spans_pct": 3.0, "trace_contract_pct": 10.0}


def _bench(script: str, args: list[str], out: Path, out_flag: str = "--out") -> dict:
    """Runs ``bench/<script>`` writing its JSON to ``out``; its table goes to our stdout."""
    cmd = [sys.executable, str(ROOT / "bench" / script), *args, out_flag, str(out)]
    print(f"bench: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, check=False, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {script} exited {proc.returncode}")
    return json.loads(out.read_text())


def _stored(name: str) -> tuple[dict | None, str]:
    path = ROOT / "bench" / name
    if not path.is_file():
        return None, f"no {path.relative_to(ROOT)}"
    data = json.loads(path.read_text())
    # when it was measured: its own date, else the commit that last wrote it (a checkout's mtime says nothing)
    stamp = data.get("date") or subprocess.run(["git", "log", "-1", "--format=%cs %h", "--", str(path)], cwd=ROOT,
                                               capture_output=True, text=True, check=False).stdout.strip() or "?"
    return data, f"from {path.relative_to(ROOT)} ({stamp}, not re-run)"


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def rows_for(sim: dict, sweep: dict, trace: dict | None, trace_src: str, asr: dict | None, asr_src: str) -> list[dict]:
    """The table's rows: what, measured, floor, measured/floor, target, met (pure: from the JSONs)."""
    rows: list[dict] = []
    warm = sim.get("main_warm") or {}
    floor = (sim.get("run_floor") or {}).get("with_scheduling_s")
    warm_s = warm.get("wall_s") if warm and not warm.get("asr_transcribed") else None
    ratio = _ratio(warm_s, floor)
    rows.append({"what": "main job warm: wall s", "measured": warm_s, "floor": floor,
                 "floor_what": "imports + vLLM scheduling / 2 workers", "ratio": ratio,
                 "target": f"<= {TARGETS['warm_over_floor']}x floor",
                 "met": None if ratio is None else ratio <= TARGETS["warm_over_floor"]})
    total = (sim.get("sim") or {}).get("total") or {}
    r = total.get("ratio_cpu")
    rows.append({"what": "sim per cell: CPU s / vLLM scheduling CPU s", "measured": r, "floor": 1.0,
                 "floor_what": f"the scheduler; {total.get('floor_with_arm_cpu')} with the arms' own calls",
                 "ratio": r, "target": f"<= {TARGETS['sim_over_scheduler']}x",
                 "met": None if r is None else r <= TARGETS["sim_over_scheduler"]})
    d = sweep.get("default") or sweep  # bench/sweep.py's JSON (older ones nested it under "default")
    st = d.get("stages") or {}
    sweep_floor = None
    if st.get("sim_floor_s") is not None and st.get("other_floor_s (import vllm + cli --help)") is not None:
        sweep_floor = round(st["sim_floor_s"] + st["other_floor_s (import vllm + cli --help)"], 1)
    rows.append({"what": f"default sweep ({d.get('cells')} cells, --asr none): wall s", "measured": d.get("wall_s"),
                 "floor": sweep_floor, "floor_what": "cells' sim seconds / 2 workers + imports",
                 "ratio": _ratio(d.get("wall_s"), sweep_floor), "target": f"<= {TARGETS['sweep_s']:g} s",
                 "met": None if d.get("wall_s") is None else d["wall_s"] <= TARGETS["sweep_s"]})
    trace_rows = (trace or {}).get("rows", [])
    for deploy in dict.fromkeys(r.get("deploy") for r in trace_rows) if trace_rows else [None]:
        for level, key in (("spans", "trace_spans_pct"), ("contract", "trace_contract_pct")):
            # bench/trace_cost.py: the worker's thread-CPU seconds inside the instrumentation / the Talker
            # step's, over the cell's steps (the worst round)
            fracs = [r["overhead_thread"] for r in trace_rows if r.get("deploy") == deploy
                     and r.get("level") == level and r.get("overhead_thread") is not None]
            pct = round(100 * max(fracs), 2) if fracs else None
            rows.append({"what": f"trace {level} on {deploy or '?'}: instrumentation % of Talker step (thread CPU)",
                         "measured": pct, "floor": 0.0 if trace else None, "floor_what": f"--trace off ({trace_src})",
                         "ratio": None, "target": f"<= {TARGETS[key]:g} %",
                         "met": None if pct is None else pct <= TARGETS[key]})
    floor_row = next((x for x in (asr or {}).get("rows", []) if x.get("mode", "").startswith("floor")), None)
    for x in (asr or {}).get("rows", []):
        rows.append({"what": f"ASR {x['mode']}: CPU s per audio s", "measured": x.get("cpu_per_audio_s"),
                     "floor": floor_row.get("cpu_per_audio_s") if floor_row else None,
                     "floor_what": f"Whisper single-thread ({asr_src})",
                     "ratio": _ratio(x.get("cpu_per_audio_s"), floor_row.get("cpu_per_audio_s") if floor_row else None),
                     "target": "report", "met": None})
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("what", "measured", "floor", "x floor", "target", "met", "floor is")
    body = [(r["what"], "–" if r["measured"] is None else str(r["measured"]),
             "–" if r["floor"] is None else str(r["floor"]), "–" if r["ratio"] is None else str(r["ratio"]),
             r["target"], {True: "yes", False: "NO", None: "–"}[r["met"]], r["floor_what"]) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" if i in (0, 6) else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="store_true", help="run bench/trace_cost.py (the real server on CPU)")
    ap.add_argument("--asr", action="store_true", help="run bench/asr_scale.py (about 15 minutes)")
    ap.add_argument("--work", type=Path, default=None, help="where the benches' own JSONs go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "targets.json")
    ap.add_argument("--reuse", action="store_true",
                    help="re-tabulate the JSONs a previous run left in --work instead of running the benches")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="omni-stress-targets-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    previous: dict = {}
    if args.reuse:
        if args.work is None:
            raise SystemExit("bench: --reuse needs --work (the folder of a previous run's JSONs)")
        previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
        load_before = previous.get("load_average_before", load_before)
    bench = (lambda script, bargs, out, flag="--out": json.loads(out.read_text())) if args.reuse else _bench
    sim = bench("sim_vs_vllm.py", [], work / "sim_vs_vllm.json")
    sweep = bench("sweep.py", [], work / "sweep_results.json")
    if args.trace:
        trace, trace_src = bench("trace_cost.py", [], work / "trace_cost.json", "--json"), "measured in this run"
    else:
        trace, trace_src = _stored("trace_cost.json")
    if args.asr:
        asr, asr_src = bench("asr_scale.py", [], work / "asr_scale.json"), "measured in this run"
    else:
        asr, asr_src = _stored("asr_scale.json")
    rows = rows_for(sim, sweep, trace, trace_src, asr, asr_src)
    load_after = [round(x, 2) for x in os.getloadavg()]
    result = {"what": "issue 34's targets beside their floors (bench/targets.py)", "targets": TARGETS,
              "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
              "load_average_before": load_before, "load_average_after": load_after,
              "bench_wall_s": (previous.get("bench_wall_s") if args.reuse else round(time.perf_counter() - t0, 1)),
              "rows": rows, "work": str(work)}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(format_table(rows))
    # the load after includes the benches' own processes (a vLLM server keeps both cores busy): only the
    # load before says whether neighbours shared the machine
    quiet = load_before[0] < 0.5 * (os.cpu_count() or 1)
    print(f"load average before {load_before}, after {load_after} (the benches' own work included; "
          f"{os.cpu_count()} cpus)"
          + ("" if quiet else ": NOT a quiet machine, the wall-time rows are inflated by the neighbours"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
