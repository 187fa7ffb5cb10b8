"""``--executor ray`` (issue 21): cells as Ray tasks, the driver the run directory's one writer.

A Ray cluster of our own in a network namespace this module creates (a veth pair with an address
of its own, the default route into it: nothing leaves the namespace), because Ray replaces a
``--node-ip-address 127.0.0.1`` with the machine's interface address and refuses a second node on
forced loopback. Nodes are ``ray start --block`` processes in sessions of their own, stopped by
process group (never ``ray stop``, which would stop every Ray on the machine). Every wait is bounded.

* a sim matrix on Ray gives the records (every field but the times) and spans of a local run with
  the same seed, and the same audio; every cell's node is recorded with the namespace's address;
* a driver killed mid-run: ``--resume --executor ray`` finishes with every record once;
* the worker node killed while it runs a cell: Ray retries the cell on the head, the run completes,
  nothing lost or written twice;
* Ray missing, an address that does not answer: one line, exit 2, no run directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMALL_PROMPTS

from harness.records import read_manifest, read_requests
from harness.spanstore import read_spans

pytestmark = pytest.mark.slow

PY = str(Path(sys.executable))
RAY_BIN = str(Path(sys.executable).with_name("ray"))
TIMING_FIELDS = {"wall_s", "asr_seconds"}
RUN_ARGS = ("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS))
N_CELLS, N_PROMPTS = 4, 4
NODE_ARGS = ("--num-cpus", "1", "--object-store-memory", "100000000", "--disable-usage-stats")
# RAY_AUTH_MODE=disabled: a token in ~/.ray (Ray 2.60's local ray.init() writes one) would turn on token
# auth for the head these tests start, and the nodes and drivers would then be refused (issue 34).
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
ENV.pop("RAY_ADDRESS", None)


def _ray_installed() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return Path(RAY_BIN).is_file()


needs_ray = pytest.mark.skipif(not _ray_installed(), reason="ray not installed (pip install omni-stress[ray])")


# ---------------------------------------------------------------- the namespace and the nodes


def _sh(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def netns():
    """(name, address): a namespace with lo and a veth pair (both ends inside), the address on one
    end and the default route through it, so Ray's own address lookup finds that address."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("ip netns needs root and iproute2: the Ray cluster tests run inside a namespace they create")
    name = f"osray{os.getpid()}"
    addr = f"10.213.{random.randint(1, 250)}.1"
    made = _sh("ip", "netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"ip netns add is not usable here ({made.stderr.strip()}): no Ray cluster without it")
    try:
        for cmd in (("link", "set", "lo", "up"), ("link", "add", "os0", "type", "veth", "peer", "name", "os1"),
                    ("addr", "add", f"{addr}/24", "dev", "os0"), ("link", "set", "os0", "up"),
                    ("link", "set", "os1", "up"), ("route", "add", "default", "dev", "os0")):
            res = _sh("ip", "-n", name, *cmd)
            if res.returncode != 0:
                pytest.skip(f"ip -n {name} {' '.join(cmd)}: {res.stderr.strip()}")
        yield name, addr
    finally:
        _sh("ip", "netns", "del", name)


def _in_ns(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


class Node:
    """One ``ray start --block`` in a session of its own; ``stop`` ends its process group."""

    def __init__(self, ns: str, args: list[str], log: Path) -> None:
        self.log = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(_in_ns(ns, RAY_BIN, "start", "--block", *args), cwd=REPO, env=ENV,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pgid = self.proc.pid  # the session leader's id is the group's id

    def wait_started(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in self.log.read_text(errors="replace"):
            assert self.proc.poll() is None, f"ray start ended: {self.log.read_text(errors='replace')[-2000:]}"
            assert time.monotonic() < deadline, f"ray start: not up in {timeout:.0f} s"
            time.sleep(0.5)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """The node's process group and every process under it (Ray's task workers run in groups of
        their own, children of the node's raylet)."""
        pids = [pid for pid, _ in self.processes() if pid != self.proc.pid]
        for target in (lambda: os.killpg(self.pgid, sig), *[lambda p=p: os.kill(p, sig) for p in pids]):
            try:
                target()
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)  # what SIGTERM left (raylet, gcs_server) goes too
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of this node's processes: its group and their descendants."""
        rows = []
        for line in _sh("ps", "-eo", "pid=,ppid=,pgid=,args=").stdout.splitlines():
            parts = line.split(None, 3)
            if len(parts) == 4:
                rows.append((int(parts[0]), int(parts[1]), int(parts[2]), parts[3]))
        mine = {pid for pid, _, pgid, _ in rows if pgid == self.pgid}
        grew = True
        while grew:
            more = {pid for pid, ppid, _, _ in rows if ppid in mine and pid not in mine}
            mine |= more
            grew = bool(more)
        return [(pid, args) for pid, _, _, args in rows if pid in mine]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head(netns):
    """(ns, address, 'IP:PORT'): the head node, one CPU."""
    ns, addr = netns
    if not _ray_installed():
        pytest.skip("ray not installed (pip install omni-stress[ray])")
    temp = Path(tempfile.mkdtemp(prefix="osray-", dir="/tmp"))
    port = _free_port()
    node = Node(ns, ["--head", "--node-ip-address", addr, "--port", str(port), "--include-dashboard", "false",
                     "--temp-dir", str(temp), *NODE_ARGS], temp.parent / f"{temp.name}-head.log")
    try:
        node.wait_started()
        yield ns, addr, f"{addr}:{port}"
    finally:
        node.stop()
        shutil.rmtree(temp, ignore_errors=True)
        node.log.unlink(missing_ok=True)


def _driver(ns: str, *args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(_in_ns(ns, PY, "-m", "harness.cli", *args), cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"run not done in {timeout:.0f} s: {log.read_text(errors='replace')[-3000:]}") from None
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


# ---------------------------------------------------------------- comparing run directories


def _records(run_dir: Path) -> dict[tuple, dict]:
    records = read_requests(run_dir)
    keys = Counter(r.key for r in records)
    assert max(keys.values()) == 1, [k for k, n in keys.items() if n > 1]
    return {r.key: {k: v for k, v in dataclasses.asdict(r).items() if k not in TIMING_FIELDS} for r in records}


def _spans(run_dir: Path) -> list[tuple]:
    spans = [tuple(dataclasses.asdict(s).values()) for s in read_spans(run_dir)]
    assert max(Counter(s[:5] for s in spans).values()) == 1, "duplicated spans"
    return sorted(spans)


def assert_same_run(got: Path, want: Path, n_records: int) -> None:
    a, b = _records(got), _records(want)
    assert len(a) == n_records
    assert sorted(a) == sorted(b)
    for key in b:
        assert a[key] == b[key], key
    assert _spans(got) == _spans(want)
    for line in (got / "requests.jsonl").read_text().splitlines():
        json.loads(line)
    assert read_manifest(got)["finished"] is not None


def _nodes(run_dir: Path) -> list[dict]:
    cells = read_manifest(run_dir)["cells"]
    assert all("node" in c for c in cells), cells
    return [c["node"] for c in cells]


# ---------------------------------------------------------------- the tests


@needs_ray
def test_ray_run_has_the_local_records_spans_and_nodes(head, small_run, tmp_path):
    ns, addr, address = head
    log = tmp_path / "stderr.txt"
    _finish(_driver(ns, *RUN_ARGS, "--out", str(tmp_path), "--run-id", "ray", "--executor", "ray",
                    "--ray-address", address, log=log), log)
    assert_same_run(tmp_path / "ray", small_run, N_CELLS * N_PROMPTS)
    nodes = _nodes(tmp_path / "ray")
    assert len(nodes) == N_CELLS and {n["ip"] for n in nodes} == {addr}
    assert all(n["id"] for n in nodes)
    # The same files as the local run: the manifest differs in the node and the times only.
    assert sorted(p.name for p in (tmp_path / "ray").iterdir()) == sorted(p.name for p in small_run.iterdir())


@needs_ray
def test_ray_run_ships_the_audio_back(head, tmp_path):
    """With speech and Whisper: the WAVs the worker spoke land at the local run's paths, byte for byte,
    and the transcripts scored on the driver are the local run's. Two of the small set's prompts: the speech
    and Whisper work of each run halves, and two clips show as well as four that each lands at its own path."""
    ns, addr, address = head
    small = yaml.safe_load(SMALL_PROMPTS.read_text())
    prompts = tmp_path / "two.yaml"
    prompts.write_text(yaml.safe_dump({**small, "prompts": small["prompts"][:2]}, sort_keys=False))
    args = ("run", "--asr-model", "tiny.en", "--asr-workers", "0", "--no-cache", "--quiet", "--prompts",
            str(prompts), "--arm", "main", "--deploy", "reference", "--out", str(tmp_path))
    local = subprocess.run([PY, "-m", "harness.cli", *args, "--run-id", "local"], cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=900)
    assert local.returncode == 0, local.stderr[-3000:]
    log = tmp_path / "stderr.txt"
    _finish(_driver(ns, *args, "--run-id", "ray", "--executor", "ray", "--ray-address", address, log=log), log)
    assert_same_run(tmp_path / "ray", tmp_path / "local", 2)
    wavs = sorted(p.name for p in (tmp_path / "local" / "audio").glob("*.wav"))
    assert len(wavs) == 2
    assert sorted(p.name for p in (tmp_path / "ray" / "audio").iterdir()) == wavs  # no scratch left behind
    for name in wavs:
        assert (tmp_path / "ray" / "audio" / name).read_bytes() == (tmp_path / "local" / "audio" / name).read_bytes()
    assert {n["ip"] for n in _nodes(tmp_path / "ray")} == {addr}


@needs_ray
def test_driver_killed_then_resume_on_ray(head, small_run, tmp_path):
    ns, addr, address = head
    run_dir = tmp_path / "killed"
    log = tmp_path / "stderr.txt"
    proc = _driver(ns, *RUN_ARGS, "--out", str(tmp_path), "--run-id", "killed", "--executor", "ray",
                   "--ray-address", address, log=log)
    requests = run_dir / "requests.jsonl"
    deadline = time.monotonic() + 600
    try:
        while not (requests.exists() and requests.read_bytes().count(b"\n") >= 1):
            assert proc.poll() is None, f"run ended before it could be killed: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no record within 600 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert len(read_requests(run_dir)) < N_CELLS * N_PROMPTS
    log2 = tmp_path / "stderr2.txt"
    _finish(_driver(ns, "run", "--resume", str(run_dir), "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS),
                    "--executor", "ray", "--ray-address", address, log=log2), log2)
    assert_same_run(run_dir, small_run, N_CELLS * N_PROMPTS)


@needs_ray
def test_worker_node_killed_mid_cell(head, small_run, tmp_path):
    """A second node (one CPU) joins; once one of its workers runs a cell, the node is SIGKILLed. Ray
    retries that cell on the head; the run completes with every record once, as the local run."""
    ns, addr, address = head
    worker = Node(ns, ["--address", address, "--node-ip-address", addr, *NODE_ARGS], tmp_path / "worker.log")
    proc = None
    try:
        worker.wait_started()
        log = tmp_path / "stderr.txt"
        proc = _driver(ns, *RUN_ARGS, "--out", str(tmp_path), "--run-id", "ray", "--executor", "ray",
                       "--ray-address", address, log=log)
        deadline = time.monotonic() + 600
        seen: set[str] = set()
        while not any(_runs_a_cell(args) for _, args in worker.processes()):
            seen.update(args for _, args in worker.processes())
            assert proc.poll() is None, (f"run ended before a cell ran on the worker node (its processes: "
                                         f"{sorted(seen)}; cells' nodes: {_nodes(tmp_path / 'ray')})")
            assert time.monotonic() < deadline, "no cell on the worker node within 600 s"
            time.sleep(0.2)
        worker.kill(signal.SIGKILL)
        assert not (tmp_path / "ray" / "requests.jsonl").exists() or \
            len(read_requests(tmp_path / "ray")) < N_CELLS * N_PROMPTS
        _finish(proc, log)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        worker.stop()
    assert_same_run(tmp_path / "ray", small_run, N_CELLS * N_PROMPTS)
    nodes = _nodes(tmp_path / "ray")
    assert {n["ip"] for n in nodes} == {addr}
    assert len({n["id"] for n in nodes}) >= 1


def _runs_a_cell(args: str) -> bool:
    """A Ray worker process busy with a task (Ray titles it ``ray::<task>``; idle ones ``ray::IDLE``)."""
    return args.startswith("ray::") and not any(w in args for w in ("IDLE", "Agent"))


def _run_cli(*args: str, env: dict | None = None, pre: str = "") -> subprocess.CompletedProcess:
    code = f"import sys; {pre}sys.argv = ['omni-stress', *sys.argv[1:]]; from harness.cli import main; main()"
    return subprocess.run([PY, "-c", code, *args], cwd=REPO, env=env or ENV, capture_output=True, text=True,
                          timeout=900)


def test_ray_missing_is_one_line_exit_2(tmp_path):
    res = _run_cli(*RUN_ARGS, "--out", str(tmp_path), "--executor", "ray", pre="sys.modules['ray'] = None; ")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install omni-stress[ray]" in lines[0], res.stderr
    assert list(tmp_path.iterdir()) == []


@needs_ray
@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}", "127.0.0.1", "nohost:port"])
def test_address_that_does_not_answer_is_one_line_exit_2(tmp_path, address):
    address = address.format(port=_free_port())
    t0 = time.monotonic()
    res = _run_cli(*RUN_ARGS, "--out", str(tmp_path), "--executor", "ray", "--ray-address", address)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--ray-address {address}" in lines[0], res.stderr
    assert time.monotonic() - t0 < 60
    assert list(tmp_path.iterdir()) == []


def test_ray_address_without_ray_executor_is_refused(tmp_path):
    res = _run_cli(*RUN_ARGS, "--out", str(tmp_path), "--ray-address", "auto")
    assert res.returncode == 2 and "applies to --executor ray" in res.stderr, res.stderr


@needs_ray
def test_a_returned_file_outside_the_run_directory_is_refused(tmp_path):
    from harness.backends import RunOptions
    from harness.errors import UserError
    from harness.executors.ray import RayExecutor

    ex = RayExecutor(tmp_path, RunOptions(executor="ray"))
    assert ex._target("audio/x.wav") == (tmp_path / "audio" / "x.wav").resolve()
    for bad in ("../x.wav", "/etc/passwd", "audio/../../x"):
        with pytest.raises(UserError):
            ex._target(bad)


@needs_ray
def test_address_where_another_grpc_server_answers_is_one_line_exit_2(tmp_path):
    """Issue 47, case 7: a server that speaks HTTP/2 (gRPC, or a proxy) but is no Ray GCS passed the probe, and
    ray.init then printed 20 lines of its C++ client's errors over 20 s before the refusal."""
    import concurrent.futures

    import grpc

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        res = _run_cli(*RUN_ARGS, "--out", str(tmp_path), "--executor", "ray", "--ray-address", f"127.0.0.1:{port}")
    finally:
        server.stop(None)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        f"omni-stress: error: --ray-address 127.0.0.1:{port}: no Ray cluster answers at 127.0.0.1:{port} (something "
        "answers, but not a Ray GCS: UNIMPLEMENTED: Method not found!)"]
    assert list(tmp_path.iterdir()) == []
