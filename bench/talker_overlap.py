"""How requests interleave in the Talker, sim beside real, per family and deploy (issue 45, item 6).

    .venv/bin/python bench/talker_overlap.py [--family qwen3-tts ...] [--model FAMILY=DIR ...] [--out FILE]

For each family (default: all three), the runs a user makes: its release arm and its fix over its CPU reference and
stress deploys and its CPU prompt set, once on the real server (``omni-stress run --backend vllm-omni --platform cpu
--stream``, on the speaking tiny checkpoint, built with ``omni-stress tiny-model`` unless ``--model`` gives one) and
once on the sim with the speaking Talker (``--sim-talker speaking``, the same cells); then ``omni-stress fidelity
--json`` of the pair. From it, per cell: each request's *Talker overlap* (the runner steps in which another request
of its cell also ran, ``harness.report.fidelity.talker_overlap``) on both sides, the mean per request, and the mean
steps a request ran in (its own), so a reader sees whether the sim's stage pipeline (``harness.sim.load.Arrivals``:
the Thinker's pace and sequences, or all at once for Qwen3-TTS) lets requests overlap as long as the real server's.

Prints a table and writes ``bench/talker_overlap.json`` (``--out``). Needs the real environment (``.venv-omni``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
REAL_PY = ROOT / ".venv-omni" / "bin" / "python"
CLI = [sys.executable, "-m", "harness.cli"]
# family: (arms, deploys, prompt set), as its real CPU end-to-end test runs it
CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "qwen2.5-omni": (("main", "pr"), ("cpu-reference", "cpu-stress"), "cpu_smoke"),
    "qwen3-tts": (("tts-0.30.0", "tts-fix"), ("qwen3-tts-cpu-reference", "qwen3-tts-cpu-stress"), "qwen3_tts_cpu_smoke"),
    "qwen3-omni": (("omni3-0.30.0", "omni3-fix"), ("qwen3-omni-cpu-reference", "qwen3-omni-cpu-stress"),
                   "qwen3_omni_cpu"),
}


def _run(argv: list[str], timeout: float) -> None:
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[2:5])}...: exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")


def _steps_per_request(run_dir: Path) -> dict[tuple[str, str], float]:
    """The mean number of runner steps a request ran in, per (arm, deploy), from the run's spans."""
    from harness.spanstore import read_spans

    steps: dict[tuple[str, str, str], set[int]] = defaultdict(set)
    for s in read_spans(run_dir):
        steps[(s.arm, s.deploy, s.request)].add(s.step)
    cells: dict[tuple[str, str], list[int]] = defaultdict(list)
    for (arm, deploy, _request), v in steps.items():
        cells[(arm, deploy)].append(len(v))
    return {k: statistics.mean(v) for k, v in cells.items()}


def measure(family: str, model: Path | None, work: Path) -> list[dict[str, Any]]:
    arms, deploys, prompts = CASES[family]
    if model is None:
        model = work / f"tiny-{family}"
        _run([*CLI, "tiny-model", str(model), "--family", family, "--python", str(REAL_PY)], 900)
    cells = [a for arm in arms for a in ("--arm", arm)] + [a for d in deploys for a in ("--deploy", d)]
    common = ["--family", family, *cells, "--prompts", prompts, "--asr", "none", "--out", str(work), "--quiet"]
    t0 = time.monotonic()
    _run([*CLI, "run", "--backend", "vllm-omni", "--platform", "cpu", "--serve-python", str(REAL_PY), "--model",
          str(model), *common, "--stream", "--run-id", f"{family}-real", "--health-timeout", "900",
          "--request-timeout", "900"], 3600)
    real_s = time.monotonic() - t0
    _run([*CLI, "run", "--sim-talker", "speaking", *common, "--run-id", f"{family}-sim"], 900)
    out_json = work / f"{family}-fidelity.json"
    _run([*CLI, "fidelity", str(work / f"{family}-sim"), str(work / f"{family}-real"), "--json", str(out_json)], 600)
    fid = json.loads(out_json.read_text())
    sim_steps, real_steps = (_steps_per_request(work / f"{family}-{side}") for side in ("sim", "real"))
    rows = []
    for cell in fid["cells"]:
        key = (cell["arm"], cell["deploy"])
        overlap = cell["talker_overlap"]
        rows.append({"family": family, "arm": key[0], "deploy": key[1], "requests": cell["requests"],
                     "sim_overlap": overlap["sim"], "real_overlap": overlap["real"],
                     "sim_steps": sim_steps.get(key), "real_steps": real_steps.get(key), "real_run_s": round(real_s, 1)})
    return rows


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(v)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=sorted(CASES), help="default: every family")
    parser.add_argument("--model", action="append", default=[], metavar="FAMILY=DIR",
                        help="a family's tiny checkpoint already built (else built here)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "talker_overlap.json")
    args = parser.parse_args()
    if not REAL_PY.exists():
        raise SystemExit(f"no real environment ({REAL_PY}): run scripts/install-real-cpu.sh")
    models = dict(m.split("=", 1) for m in args.model)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="talker-overlap-") as tmp:
        for family in args.family or list(CASES):
            model = Path(models[family]) if family in models else None
            rows += measure(family, model, Path(tmp))
    header = ("family", "arm", "deploy", "requests", "sim_overlap", "real_overlap", "sim_steps", "real_steps")
    table = [header] + [tuple(_fmt(r[h]) for h in header) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    args.out.write_text(json.dumps({"rows": rows, "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                    "what": "mean Talker overlap and steps per request, sim (speaking) and real (CPU)"},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
