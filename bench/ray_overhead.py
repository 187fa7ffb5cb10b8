"""Ray's overhead on a sim matrix: the same run with ``--executor local`` and on a 2-node local Ray
cluster (a head and a worker, one CPU each), side by side; per-cell scheduling overhead in ms.

    sudo .venv/bin/python bench/ray_overhead.py [--repeat N] [--json bench/ray_overhead.json]

The cluster runs in a network namespace this script creates (a veth pair with an address of its
own, nothing routed out: Ray replaces 127.0.0.1 with the machine's interface address), so it needs
root and ``ip netns``; it is torn down on every path. Figures:

* wall: the whole ``omni-stress run`` (process start to exit), local vs Ray, and their ratio;
* per cell, from the executor's own clocks (one machine, one clock): dispatch = task start minus
  the later of its submission and the end of the previous task on its node (each node has one CPU),
  return = result seen by the driver minus task end (cells the driver was already waiting for),
  plus fetching and writing the result; scheduling overhead = dispatch + return;
* the in-task time of each cell: a worker process's first cell also imports vLLM (the local run
  pays that import once, before it forks its sim workers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
RAY_BIN = str(Path(PY).with_name("ray"))
PROMPTS = REPO / "tests" / "fixtures" / "prompts_small.yaml"
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
ENV.pop("RAY_ADDRESS", None)
NODE_ARGS = ["--num-cpus", "1", "--object-store-memory", "100000000", "--disable-usage-stats"]


def run_args(out: Path, run_id: str, repeat: int) -> list[str]:
    return ["run", "--asr", "none", "--quiet", "--prompts", str(PROMPTS), "--repeat", str(repeat),
            "--out", str(out), "--run-id", run_id]


def driver_main(argv: list[str], timings_out: Path) -> int:
    """Inside the namespace: the CLI in this process, keeping the Ray executor's timings."""
    from harness.executors import ray as rayexec

    original = rayexec.RayExecutor.close

    def close(self, cancel: bool = False) -> None:
        timings_out.write_text(json.dumps(self.timings))
        original(self, cancel)

    rayexec.RayExecutor.close = close
    from harness.cli import main

    try:
        main(argv, standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


class Node:
    def __init__(self, ns: str, args: list[str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, RAY_BIN, "start", "--block", *args], env=ENV,
                                     cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_started(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"ray start failed: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        pids = {self.proc.pid}
        rows = [line.split(None, 2) for line in subprocess.run(["ps", "-eo", "pid=,ppid=,pgid="], text=True,
                                                                capture_output=True).stdout.splitlines()]
        rows = [(int(a), int(b), int(c)) for a, b, c in rows]
        pids |= {p for p, _, g in rows if g == self.proc.pid}
        while True:
            more = {p for p, pp, _ in rows if pp in pids and p not in pids}
            if not more:
                break
            pids |= more
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in pids:
                try:
                    os.kill(p, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overheads(timings: list[dict]) -> list[dict]:
    rows = []
    by_node: dict[str, list[dict]] = {}
    for t in timings:
        by_node.setdefault(t["node"], []).append(t)
    for ts in by_node.values():
        ts.sort(key=lambda t: t["started"])
        prev_end = None
        for t in ts:
            free_at = max(t["submitted"], prev_end) if prev_end is not None else t["submitted"]
            dispatch = t["started"] - free_at
            waited = t["waiting_since"] <= t["ended"]
            ret = (t["ready"] - t["ended"] if waited else 0.0) + t["fetch_s"] + t["write_s"]
            rows.append({"cell": t["key"], "node": t["node"][:8], "task_s": round(t["ended"] - t["started"], 3),
                         "dispatch_ms": round(1000 * dispatch, 1), "return_ms": round(1000 * ret, 1),
                         "overhead_ms": round(1000 * (dispatch + ret), 1), "driver_was_waiting": waited})
            prev_end = t["ended"]
    return sorted(rows, key=lambda r: r["cell"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="repeats of the 4-cell matrix (cells = 4 x N)")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "ray_overhead.json")
    ap.add_argument("--driver", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.driver:
        return driver_main(args.driver[1:], Path(args.driver[0]))
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise SystemExit("bench/ray_overhead.py: needs root and ip netns (the cluster runs in a namespace)")
    work = Path(tempfile.mkdtemp(prefix="osbench-", dir="/tmp"))
    ns, addr = f"osbench{os.getpid()}", f"10.214.{random.randint(1, 250)}.1"
    nodes: list[Node] = []
    try:
        t0 = time.perf_counter()
        subprocess.run([PY, "-m", "harness.cli", *run_args(work, "local", args.repeat)], cwd=REPO, env=ENV,
                       check=True, stdout=subprocess.DEVNULL, timeout=3600)
        local_wall = time.perf_counter() - t0

        subprocess.run(["ip", "netns", "add", ns], check=True)
        for cmd in (["link", "set", "lo", "up"], ["link", "add", "ob0", "type", "veth", "peer", "name", "ob1"],
                    ["addr", "add", f"{addr}/24", "dev", "ob0"], ["link", "set", "ob0", "up"],
                    ["link", "set", "ob1", "up"], ["route", "add", "default", "dev", "ob0"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)
        port = free_port()
        nodes.append(Node(ns, ["--head", "--node-ip-address", addr, "--port", str(port), "--include-dashboard",
                               "false", "--temp-dir", str(work / "raytmp"), *NODE_ARGS], work / "head.log"))
        nodes[0].wait_started()
        nodes.append(Node(ns, ["--address", f"{addr}:{port}", "--node-ip-address", addr, *NODE_ARGS],
                          work / "worker.log"))
        nodes[1].wait_started()
        timings_file = work / "timings.json"
        t0 = time.perf_counter()
        subprocess.run(["ip", "netns", "exec", ns, PY, __file__, "--driver", str(timings_file),
                        *run_args(work, "ray", args.repeat), "--executor", "ray", "--ray-address", f"{addr}:{port}"],
                       cwd=REPO, env=ENV, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        ray_wall = time.perf_counter() - t0
        rows = overheads(json.loads(timings_file.read_text()))
    finally:
        for node in reversed(nodes):
            node.stop()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    steady = [r["overhead_ms"] for r in rows]
    result = {"cells": len(rows), "local_wall_s": round(local_wall, 1), "ray_wall_s": round(ray_wall, 1),
              "ratio": round(ray_wall / local_wall, 2), "overhead_ms_median": round(statistics.median(steady), 1),
              "overhead_ms_mean": round(statistics.mean(steady), 1), "per_cell": rows,
              "setup": "sim, --asr none, tests/fixtures/prompts_small.yaml, main,pr x reference,stress; "
                       "local: default sim workers; ray: head + worker node, 1 CPU each, in a network namespace"}
    print(f"{'cell':<24}{'node':<10}{'task s':>8}{'dispatch ms':>13}{'return ms':>11}{'overhead ms':>13}")
    for r in rows:
        print(f"{r['cell']:<24}{r['node']:<10}{r['task_s']:>8.2f}{r['dispatch_ms']:>13.1f}{r['return_ms']:>11.1f}"
              f"{r['overhead_ms']:>13.1f}")
    print(f"\nwall: local {local_wall:.1f} s, ray (2 nodes) {ray_wall:.1f} s, ratio {ray_wall / local_wall:.2f}; "
          f"scheduling overhead per cell: median {result['overhead_ms_median']:.1f} ms, "
          f"mean {result['overhead_ms_mean']:.1f} ms")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"json: {args.json}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
