"""How the cost of a sim run, and of ``report`` and ``gate`` on it, grows with the number of requests
(issue 48): wall time, CPU time, peak RSS and bytes on disk against requests, with the slope per request.

    .venv/bin/python bench/scaling.py [--sizes 64,1000,10000] [--shapes one-cell,cells]
                                      [--synthetic 10000] [--main-job-baseline /path/to/old/checkout]

Shapes (all ``omni-stress run --asr none``, seed 42):

* ``one-cell``: every request in one cell (``--arm main --deploy stress``, its ``sim.max_steps`` raised,
  a generated prompt set of N prompts: the 16 default prompts, copied under new ids);
* ``cells``: main, pr x reference, stress, 25 prompts (the default 16 and 9 copies) and ``--repeat
  N / 100``: N requests across 4 x repeat cells.

Each measured command runs in a process of its own; wall is its elapsed time, CPU its user + system
seconds and those of every process it waited for (the sim's forked workers), peak RSS the largest
single process's (GNU time's ``%M``). Bytes: the span store (``spans/``), what the same spans
took as ``spans.jsonl`` before the store (the size of ``omni-stress export-spans``, byte-identical to
that file), and ``requests.jsonl``. ``report`` (tables, plots, HTML) and ``gate`` then run on each run,
and ``report`` once more on the run as an old run (its spans as ``spans.jsonl``, the reader before the
store) up to 1,000 requests.

``--synthetic N``: a run directory of N requests built by copying the largest run's records under new
cell numbers (``cells``) or prompt ids (``one-cell``), spans and records alike, for ``report`` and
``gate`` at a size the sim would take hours to run on a small machine; its rows say ``synthetic``.

The slope of each figure is the least-squares line through the measured sizes (per request); ``marginal``
is the slope between the two largest sizes, and a marginal slope above 1.5 times the first segment's
flags growth faster than linear. Writes bench/scaling.json beside this script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PY = sys.executable
DEFAULT_PROMPTS = REPO / "prompts" / "default.yaml"
CELL_PROMPTS = 25  # the cells shape: 4 cells x 25 prompts x repeat
SUPERLINEAR = 1.5
TIME = "/usr/bin/time"  # GNU time


def measure(argv: list[str], env: dict[str, str] | None = None, cwd: Path = REPO,
            ok: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """Runs ``argv`` under GNU time: its wall, CPU (itself and its waited-for children: the sim's forked
    workers) and peak RSS (the largest process's). Not ``wait4`` here: Linux carries a process's peak
    RSS across exec, so a child of this (large) process would report this process's peak."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        proc = subprocess.run([TIME, "-f", "%e %U %S %M", "-o", out.name, *argv], cwd=cwd, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env={**os.environ, **(env or {})}, check=False)
        wall, user, system, rss_kb = out.read().split()[-4:]
    if proc.returncode not in ok or b"omni-stress: error:" in proc.stderr:
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.decode()[-2000:]}")
    return {"wall_s": float(wall), "cpu_s": round(float(user) + float(system), 2), "rss_mb": round(int(rss_kb) / 1024, 1),
            "exit": proc.returncode}


def prompt_set(path: Path, count: int) -> Path:
    """The default prompts, copied under new ids to ``count`` prompts."""
    import yaml

    base = yaml.safe_load(DEFAULT_PROMPTS.read_text())
    prompts = []
    for i in range(count):
        p = dict(base["prompts"][i % len(base["prompts"])])
        if i >= len(base["prompts"]):
            p["id"] = f"{p['id']}-c{i // len(base['prompts'])}"
        prompts.append(p)
    path.write_text(yaml.safe_dump({**base, "name": f"scaling{count}", "prompts": prompts}, sort_keys=False))
    return path


def stress_deploy(work: Path) -> Path:
    """deploy_configs/stress.yaml with the sim's step bound raised: one cell of 1,000 requests takes
    more than the default 200,000 scheduler steps (the stress deploy runs one request at a time)."""
    path = work / "stress.yaml"
    text = (REPO / "deploy_configs" / "stress.yaml").read_text()
    assert "\nsim:" not in text
    path.write_text(text + "\nsim:\n  max_steps: 10000000\n")
    return path


def run_argv(shape: str, n: int, work: Path, run_id: str) -> tuple[list[str], int]:
    """The ``omni-stress run`` command line of one shape and size, and its number of requests."""
    cli = [PY, "-m", "harness.cli", "run", "--asr", "none", "--quiet", "--no-cache", "--seed", "42",
           "--out", str(work), "--run-id", run_id]
    if shape == "one-cell":
        prompts = prompt_set(work / f"prompts-{n}.yaml", n)
        return [*cli, "--arm", "main", "--deploy", str(stress_deploy(work)), "--prompts", str(prompts)], n
    prompts = prompt_set(work / f"prompts-{CELL_PROMPTS}.yaml", CELL_PROMPTS)
    if n < 4 * CELL_PROMPTS:
        prompts = prompt_set(work / f"prompts-{n // 4}.yaml", n // 4)
        return [*cli, "--arm", "main", "--arm", "pr", "--prompts", str(prompts)], 4 * (n // 4)
    repeat = max(1, round(n / (4 * CELL_PROMPTS)))
    return [*cli, "--arm", "main", "--arm", "pr", "--prompts", str(prompts), "--repeat", str(repeat)], \
        4 * CELL_PROMPTS * repeat


def disk(run_dir: Path) -> dict[str, int]:
    from harness.spanstore import export_lines, store_bytes

    jsonl = sum(len(text.encode()) for text in export_lines(run_dir))
    return {"spans_store_bytes": store_bytes(run_dir), "spans_jsonl_bytes": jsonl,
            "requests_bytes": (run_dir / "requests.jsonl").stat().st_size}


def readers(run_dir: Path, work: Path, legacy: bool) -> dict[str, Any]:
    """``report`` (full: tables, plots, HTML) and ``gate`` on the run; ``report`` on its old-run copy."""
    out: dict[str, Any] = {}
    out["report"] = measure([PY, "-m", "harness.cli", "report", str(run_dir)])
    # gate: 1 a rule failed, 2 a rule could not be evaluated (the one-cell run has no reference deploy):
    # every cell is read and judged all the same
    out["gate"] = measure([PY, "-m", "harness.cli", "gate", str(run_dir)], ok=(0, 1, 2))
    if legacy:
        old = work / f"{run_dir.name}-jsonl"
        shutil.copytree(run_dir, old)
        subprocess.run([PY, "-m", "harness.cli", "export-spans", str(old), "-o", str(old / "spans.jsonl")],
                       cwd=REPO, check=True)
        shutil.rmtree(old / "spans")
        out["report_jsonl"] = measure([PY, "-m", "harness.cli", "report", str(old)])
        shutil.rmtree(old)
    return out


def synthesize(src: Path, dst: Path, shape: str, target: int) -> int:
    """``src``'s records copied under new cell numbers (cells) or prompt ids (one-cell) to >= target
    requests, span files too (their columns rewritten); returns the requests written."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from harness.records import read_manifest, write_manifest
    from harness.spanstore import SPANS_DIR, read_span_file, span_files

    (dst / SPANS_DIR).mkdir(parents=True)
    manifest = read_manifest(src)
    lines = (src / "requests.jsonl").read_text().splitlines()
    copies = -(-target // len(lines))
    max_repeat = max(c["repeat"] for c in manifest["cells"])
    tables = [read_span_file(p) for p in span_files(src)]
    cells, prompt_ids, seq = [], [], 0
    with open(dst / "requests.jsonl", "w") as fh:
        for k in range(copies):
            for line in lines:
                rec = json.loads(line)
                if shape == "cells":
                    rec["repeat"] += k * max_repeat
                elif k:
                    rec["prompt_id"] = f"{rec['prompt_id']}-s{k}"
                fh.write(json.dumps(rec, sort_keys=True) + "\n")
            for table in tables:
                meta = dict(table.schema.metadata or {})
                if shape == "cells":
                    i = table.column_names.index("repeat")
                    table = table.set_column(i, "repeat", pc.add(table.column("repeat"), k * max_repeat))
                    meta[b"repeat"] = str(int(meta[b"repeat"]) + k * max_repeat).encode()
                elif k:
                    i = table.column_names.index("request")
                    col = table.column("request").combine_chunks()
                    renamed = pa.array([f"{v}-s{k}" for v in col.dictionary.to_pylist()], pa.string())
                    table = table.set_column(i, "request", pa.DictionaryArray.from_arrays(col.indices, renamed))
                seq += 1
                with pa.OSFile(str(dst / SPANS_DIR / f"{seq:06d}.arrow"), "wb") as out, pa.ipc.new_file(
                        out, table.schema.with_metadata(meta), options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
                    w.write_table(table.replace_schema_metadata(meta))
            if shape == "cells":
                cells += [{**c, "repeat": c["repeat"] + k * max_repeat} for c in manifest["cells"]]
            else:
                prompt_ids += [p if not k else f"{p}-s{k}" for p in manifest["prompt_ids"]]
    if shape == "cells":
        manifest["cells"] = cells
        manifest["repeat"] = max_repeat * copies
        manifest["cell_wall_s"] = {}
    else:
        manifest["prompt_ids"] = prompt_ids
    manifest["run_id"] = dst.name
    write_manifest(dst, manifest)
    return copies * len(lines)


def slope(points: list[tuple[int, float]]) -> tuple[float | None, float | None, bool]:
    """(least-squares slope, marginal slope of the two largest, faster than linear?)"""
    if len(points) < 2:
        return None, None, False
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    fit = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None
    segs = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1) if xs[i + 1] != xs[i]]
    marginal = segs[-1] if segs else None
    superlinear = len(segs) >= 2 and segs[0] > 0 and segs[-1] > SUPERLINEAR * segs[0]
    return fit, marginal, superlinear


def main_job(baseline: Path | None, runs: int, work: Path) -> dict[str, Any]:
    """``omni-stress run --arm main --arm pr --asr none``: this checkout, and ``baseline``'s code, alternately."""
    out: dict[str, Any] = {}
    sides = [("after", REPO)] + ([("before", baseline)] if baseline else [])
    for i in range(runs):
        for name, src in sides:
            argv = [PY, "-m", "harness.cli", "run", "--arm", "main", "--arm", "pr", "--asr", "none", "--quiet",
                    "--out", str(work), "--run-id", f"main-{name}-{i}"]
            m = measure(argv, env={"PYTHONPATH": str(src)}, cwd=src)
            out.setdefault(name, []).append(m)
            shutil.rmtree(work / f"main-{name}-{i}")
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = ("shape", "requests", "run wall s", "run cpu s", "run RSS MB", "spans B/req", "jsonl B/req",
            "report s", "report MB", "gate s", "gate MB", "report (jsonl) s", "report (jsonl) MB")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        run = r.get("run") or {}
        rj = r.get("report_jsonl") or {}
        n = r["requests"]
        lines.append(" | ".join(str(v) for v in (
            r["shape"] + (" (synthetic)" if r.get("synthetic") else ""), n, run.get("wall_s", "–"),
            run.get("cpu_s", "–"), run.get("rss_mb", "–"), round(r["spans_store_bytes"] / n),
            round(r["spans_jsonl_bytes"] / n), r["report"]["wall_s"], r["report"]["rss_mb"], r["gate"]["wall_s"],
            r["gate"]["rss_mb"], rj.get("wall_s", "–"), rj.get("rss_mb", "–"))))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,1000", help="requests per run, comma-separated (default 64,1000)")
    ap.add_argument("--shapes", default="one-cell,cells")
    ap.add_argument("--synthetic", type=int, default=10000, help="requests of the synthetic run (0: none)")
    ap.add_argument("--legacy-max", type=int, default=1000, help="largest run also reported as an old jsonl run")
    ap.add_argument("--main-job-runs", type=int, default=0, help="time the main job this many times")
    ap.add_argument("--main-job-baseline", type=Path, default=None, help="a checkout of the code before the store")
    ap.add_argument("--json", type=Path, default=Path(__file__).with_name("scaling.json"))
    ap.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = args.work or Path(tempfile.mkdtemp(prefix="scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_at_start": os.getloadavg()},
                              "argv": sys.argv, "rows": rows}
    try:
        for shape in args.shapes.split(","):
            largest = None
            for n in sizes:
                run_id = f"{shape}-{n}"
                argv, requests = run_argv(shape, n, work, run_id)
                print(f"[scaling] {shape}: {requests} requests ...", file=sys.stderr, flush=True)
                row: dict[str, Any] = {"shape": shape, "requests": requests, "run": measure(argv)}
                row.update(disk(work / run_id))
                row.update(readers(work / run_id, work, legacy=requests <= args.legacy_max))
                rows.append(row)
                print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)
                if largest is not None:
                    shutil.rmtree(largest)
                largest = work / run_id
            if args.synthetic and largest is not None:
                dst = work / f"{shape}-synthetic-{args.synthetic}"
                print(f"[scaling] {shape}: synthetic {args.synthetic} requests ...", file=sys.stderr, flush=True)
                requests = synthesize(largest, dst, shape, args.synthetic)
                row = {"shape": shape, "requests": requests, "synthetic": True, "run": None}
                row.update(disk(dst))
                row.update(readers(dst, work, legacy=False))
                rows.append(row)
                print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)
                shutil.rmtree(dst)
        slopes: dict[str, Any] = {}
        for shape in args.shapes.split(","):
            mine = [r for r in rows if r["shape"] == shape]
            real = [r for r in mine if not r.get("synthetic")]
            figures = {
                "run_wall_s": [(r["requests"], r["run"]["wall_s"]) for r in real],
                "run_cpu_s": [(r["requests"], r["run"]["cpu_s"]) for r in real],
                "run_rss_mb": [(r["requests"], r["run"]["rss_mb"]) for r in real],
                "spans_store_bytes": [(r["requests"], r["spans_store_bytes"]) for r in mine],
                "spans_jsonl_bytes": [(r["requests"], r["spans_jsonl_bytes"]) for r in mine],
                "requests_bytes": [(r["requests"], r["requests_bytes"]) for r in mine],
                "report_wall_s": [(r["requests"], r["report"]["wall_s"]) for r in mine],
                "report_rss_mb": [(r["requests"], r["report"]["rss_mb"]) for r in mine],
                "gate_wall_s": [(r["requests"], r["gate"]["wall_s"]) for r in mine],
                "gate_rss_mb": [(r["requests"], r["gate"]["rss_mb"]) for r in mine],
            }
            slopes[shape] = {}
            for name, pts in figures.items():
                fit, marginal, superlinear = slope(pts)
                slopes[shape][name] = {"per_request": fit, "marginal": marginal, "faster_than_linear": superlinear}
        result["slopes"] = slopes
        if args.main_job_runs:
            result["main_job"] = main_job(args.main_job_baseline, args.main_job_runs, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    print()
    for shape, figs in result["slopes"].items():
        print(f"{shape}: per request (least squares; marginal between the two largest sizes)")
        for name, s in figs.items():
            if s["per_request"] is not None:
                flag = "  FASTER THAN LINEAR" if s["faster_than_linear"] else ""
                print(f"  {name:<18} {s['per_request']:.6g}  (marginal {s['marginal']:.6g}){flag}")
    if "main_job" in result:
        for name, ms in result["main_job"].items():
            print(f"main job ({name}): wall {[m['wall_s'] for m in ms]} s, cpu {[m['cpu_s'] for m in ms]} s")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
