"""The Ray executor: each cell one Ray task on a cluster; the driver alone writes the run directory.

``open`` connects (``ray.init``) and submits every cell at once, each with the resources its
backend needs (a sim cell one CPU; a real-backend cell the two GPUs today's GPU recipe places
its stages on), so Ray packs cells onto nodes. The task runs the cell with the local backend in
a scratch directory on its node, and returns the cell's records, spans, the files the cell wrote
(its audio; a real cell's server log and trace) and the node it ran on. ``run_cell`` waits for
the cell's result in plan order, writes those files under the run directory at the same relative
paths, then hands spans and records to the pipeline in the order the backend emitted them: the
run directory is the same as a local run's, plus the node in the manifest's ``cells[]``.

Faults. A node that dies mid-cell: Ray retries the task elsewhere (``max_retries``, Ray's own
system-failure retries); nothing of the cell reached the run directory before its result did,
so nothing is lost or written twice. A cell that fails for its own reasons (an exception in the
backend) is not retried: its error reaches the run as a local run's would. A driver killed
mid-run: the tasks it owned end with it; ``--resume`` runs the cells with records missing.

Scoring (``make_asr_pool``): Whisper runs on Ray actors, each loading the model once when it
starts. The driver streams each clip's WAV bytes to an actor as the clip's record comes in (or N
at a time under ``--asr-batch N``, batched by faster-whisper's pipeline), at most two calls in
flight per actor (one, batched, so batches fill while actors are busy); the transcripts come back
and the driver alone caches and writes them. The actors reserve no Ray CPU: queued cells wait for
CPUs, and actors holding them could starve the cells on a cluster no larger than the actors.
A node that dies takes its actor: Ray restarts it elsewhere and retries its calls.

Ray is optional (``pip install omni-stress[ray]``); this module is imported only for
``--executor ray``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.backends import get_backend
from harness.errors import UserError

if TYPE_CHECKING:
    from concurrent.futures import Future

    from harness.audio.pool import PoolSpec
    from harness.backends import CellJob, CellOutcome, EmitRecord, EmitSpans, RunOptions

#: Ray's own retries of a task whose worker or node died (not of a task that raised).
MAX_RETRIES = 3
CONNECT_TIMEOUT_S = float(os.environ.get("OMNI_STRESS_RAY_CONNECT_TIMEOUT", "60"))
#: Seconds an address that accepts a connection has to answer the gRPC greeting (a Ray cluster answers at once).
PROBE_TIMEOUT_S = float(os.environ.get("OMNI_STRESS_RAY_PROBE_TIMEOUT", "5"))
_HTTP2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # preface + SETTINGS
IDLE_S = 0.25
INSTALL_HINT = "pip install omni-stress[ray]"


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UserError(f"--executor ray: Ray is not installed ({INSTALL_HINT})") from None
    return ray


def _probe(address: str, shown: str | None = None) -> None:
    """A HOST:PORT (or ray://HOST:PORT) that does not accept a TCP connection is refused in seconds,
    before ``ray.init`` (which may retry for minutes)."""
    shown = shown or address
    hostport = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise UserError(f"--ray-address {shown}: not HOST:PORT, ray://HOST:PORT or 'auto'")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=min(10.0, CONNECT_TIMEOUT_S)) as sock:
            # Ray's GCS and client server speak gRPC (HTTP/2), whose server sends its SETTINGS as soon as a
            # client greets it. Something that accepts the connection and stays silent is not a Ray cluster:
            # ray.init would retry for its own minute and log its GCS client's warnings (issue 33, case 7).
            sock.sendall(_HTTP2_GREETING)
            sock.settimeout(PROBE_TIMEOUT_S)
            try:
                sock.recv(1)
            except socket.timeout:
                raise UserError(f"--ray-address {shown}: no Ray cluster answers at {host}:{port} (a connection "
                                f"opens, but nothing answers in {PROBE_TIMEOUT_S:g} s; "
                                f"$OMNI_STRESS_RAY_PROBE_TIMEOUT sets the wait)") from None
    except OSError as exc:
        raise UserError(f"--ray-address {shown}: no Ray cluster answers at {host}:{port} "
                        f"({exc.strerror or exc})") from None
    if "://" not in address:
        _probe_gcs(host, int(port), shown)


# A Ray cluster's address (HOST:PORT, not ray://) is its GCS: a gRPC server with ray.rpc's services. Ray's own
# connect retries a server that answers HTTP/2 but is not a GCS (a proxy, another gRPC service) for 20 s and
# writes a line to stderr per try from its C++ client (issue 47, case 7). One call of the GCS's cheapest
# method tells first: a GCS answers it, anything else answers UNIMPLEMENTED, an HTTP error or nothing.
_GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # ray/src/ray/protobuf/gcs_service.proto


def _probe_gcs(host: str, port: int, shown: str) -> None:
    try:
        import grpc
    except ImportError:  # Ray brings grpcio; without it, ray.init says what it says
        return
    # No such method (another gRPC server, or an HTTP/2 proxy's 404), no gRPC at all, or silence.
    not_a_gcs = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    channel = grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)])
    try:
        call = channel.unary_unary(_GCS_METHOD, request_serializer=None, response_deserializer=None)
        call(b"", timeout=PROBE_TIMEOUT_S)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        if code not in not_a_gcs:  # a GCS's own answer (e.g. UNAUTHENTICATED: a cluster with token auth)
            return
        detail = (exc.details() if hasattr(exc, "details") else "") or str(code)
        detail = " ".join(str(detail).split())[:160]
        raise UserError(f"--ray-address {shown}: no Ray cluster answers at {host}:{port} (something answers, but "
                        f"not a Ray GCS: {code.name if code is not None else 'error'}: {detail})") from None
    finally:
        channel.close()


def preflight(address: str | None, dry_run: bool = False) -> None:
    """Before a run directory exists: Ray importable, and this process connected to the cluster
    named (``address``, else $RAY_ADDRESS, else a one-machine Ray started for the run); one line and
    exit 2 otherwise. The executor then uses this connection. ``--dry-run`` runs no cell: no cluster."""
    if not dry_run:
        connect(address)


_owned = False  # this process connected to Ray (preflight or open), so the executor disconnects


def connect(address: str | None) -> None:
    """Connects this process to Ray (``address``: HOST:PORT, ray://..., 'auto', or None: $RAY_ADDRESS,
    else a one-machine Ray started for the run, never a cluster found by chance). Bounded by
    ``CONNECT_TIMEOUT_S``; an address that refuses TCP connections is refused in seconds."""
    global _owned
    ray = import_ray()
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS") or None
    shown = f"--ray-address {address}" if address else (f"$RAY_ADDRESS={target}" if target else "a local Ray")
    if target and target != "auto":
        _probe(target)
    kwargs: dict[str, Any] = {"logging_level": "WARNING", "log_to_driver": True}
    if target is None:  # a one-machine cluster of our own: no dashboard, no usage report
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs.update(address="local", include_dashboard=False)
    else:
        kwargs["address"] = target
    result: dict[str, BaseException | None] = {"error": None}

    def init() -> None:
        import logging

        quiet = _DropLine("SIGTERM handler is not set")
        logging.getLogger("ray").addFilter(quiet)
        for handler in logging.getLogger("ray").handlers:
            handler.addFilter(quiet)
        try:
            ray.init(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    if target is None:
        # A Ray started here runs in this thread: Linux ends a child whose parent-death signal is set
        # when the *thread* that started it exits, so a local Ray started in a helper thread loses its
        # GCS and raylet as soon as ray.init returns (the run then dies a minute later, "Failed to
        # connect to GCS"). Nothing remote to wait for, so no timeout thread is needed.
        init()
    else:
        thread = threading.Thread(target=init, name="ray-connect", daemon=True)
        thread.start()
        thread.join(CONNECT_TIMEOUT_S)
        if thread.is_alive():
            raise UserError(f"--executor ray: {shown} did not answer in {CONNECT_TIMEOUT_S:.0f} s")
    exc = result["error"]
    if exc is not None:
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--executor ray: cannot connect to {shown}: {line}")
    _owned = True


class _DropLine:
    """A logging filter dropping one known, harmless line (``ray.init`` outside the main thread)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def filter(self, record: Any) -> bool:
        return self.text not in record.getMessage()


def cell_resources(options: RunOptions) -> dict[str, float]:
    """What one cell asks Ray for: its backend's entry says (a CPU for a sim cell, the deploy's GPUs
    for a real one)."""
    return get_backend(options.backend).ray_resources(options)


def cell_timeout(job: CellJob, options: RunOptions) -> float:
    """How long the driver waits for one cell once it is the next in order (queueing included)."""
    env = os.environ.get("OMNI_STRESS_RAY_CELL_TIMEOUT")
    if env:
        return float(env)
    return get_backend(options.backend).ray_cell_timeout(job, options)


def run_cell_here(job: CellJob, options: RunOptions, payload: Any) -> dict[str, Any]:
    """The Ray task's body (on a worker): the cell with the local backend in a scratch directory;
    returns everything the driver writes, and where it ran."""
    import dataclasses
    import shutil
    import tempfile

    from harness.executors.local import make_backend

    get_backend(options.backend).ray_worker_setup(payload)  # the sim: the driver's per-call arm limit
    local = dataclasses.replace(options, executor="local", ray_address=None, sim_workers=0, quiet=True)
    events: list[tuple[str, Any]] = []
    started = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="omni-stress-ray-"))
    try:
        (scratch / "audio").mkdir()
        backend = make_backend(local.backend, scratch, local)
        ok = False
        try:
            backend.open([job])
            outcome = backend.run_cell(job, lambda rec: events.append(("record", rec)),
                                       lambda spans: events.append(("spans", list(spans))), idle=lambda: None)
            ok = True
        finally:
            backend.close(cancel=not ok)
        files: dict[str, bytes] = {}
        for path in sorted(scratch.rglob("*")):
            if path.is_file() and not path.is_symlink():
                files[path.relative_to(scratch).as_posix()] = path.read_bytes()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"events": events, "files": files, "outcome": outcome, "node": node_here(),
            "timing": {"started": started, "ended": time.time()}}


def node_here() -> dict[str, str]:
    import ray

    ctx = ray.get_runtime_context()
    return {"id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "host": socket.gethostname()}


class RayExecutor:
    """``harness.backends.Backend`` over a Ray cluster (see the module docstring)."""

    name = "ray"

    def __init__(self, run_dir: Path, options: RunOptions) -> None:
        self.run_dir = Path(run_dir)
        self.options = options
        self.refs: dict[str, Any] = {}
        self.submitted: dict[str, float] = {}
        #: per cell, where the time went (bench/ray_overhead.py): submitted, started, ended (the task's
        #: clock), ready (when this process saw the result), fetch_s, write_s, node
        self.timings: list[dict[str, Any]] = []
        self.ray: Any = None

    def open(self, jobs: list[CellJob]) -> None:
        self.ray = ray = import_ray()
        if not jobs:
            return
        connect(self.options.ray_address)
        resources = cell_resources(self.options)
        self._warn_infeasible(resources)
        payload = get_backend(self.options.backend).ray_payload()
        task = ray.remote(run_cell_here).options(max_retries=MAX_RETRIES, retry_exceptions=False,
                                                 name="omni-stress-cell", **resources)
        for job in jobs:
            self.submitted[job.key] = time.time()
            self.refs[job.key] = task.remote(job, self.options, payload)

    def _warn_infeasible(self, resources: dict[str, float]) -> None:
        """A cell no node can hold waits for a node to join (an autoscaler may add one): say so once."""
        try:
            total = self.ray.cluster_resources()
        except Exception:  # noqa: BLE001 - informational only
            return
        gpus = resources.get("num_gpus", 0)
        if gpus and total.get("GPU", 0) < gpus:
            print(f"omni-stress: warning: the Ray cluster has {total.get('GPU', 0):g} GPUs; a {self.options.backend} "
                  f"cell needs {gpus:g}: cells wait until a node with them joins", file=sys.stderr)

    def run_cell(self, job: CellJob, emit: EmitRecord, emit_spans: EmitSpans,
                 idle: Callable[[], None]) -> CellOutcome:
        ray = self.ray
        ref = self.refs.pop(job.key)
        t0 = time.perf_counter()
        waiting_since = time.time()
        limit = cell_timeout(job, self.options)
        deadline = time.monotonic() + limit
        while True:
            ready, _ = ray.wait([ref], timeout=IDLE_S)
            if ready:
                break
            idle()
            if time.monotonic() > deadline:
                ray.cancel(ref, force=True)
                raise UserError(f"cell {job.label}: no result from its Ray task in {limit:.0f} s; the records "
                                f"written so far are kept: rerun with --resume")
        ready = time.time()
        result = self._result(ref, job)
        fetched = time.time()
        for rel, data in result["files"].items():
            target = self._target(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.part")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        waited = time.perf_counter() - t0
        self.timings.append({"key": job.key, "node": result["node"]["id"], "submitted": self.submitted.get(job.key),
                             "waiting_since": waiting_since, "ready": ready, "fetch_s": fetched - ready,
                             "write_s": time.time() - fetched, **result.get("timing", {})})
        for kind, payload in result["events"]:
            if kind == "spans":
                emit_spans(payload)
            else:
                emit(payload)
        outcome = result["outcome"]
        outcome.sim_wall = waited  # this process's time on the cell: waiting for its task
        outcome.extra = {**outcome.extra, "node": result["node"]}
        return outcome

    def _result(self, ref: Any, job: CellJob) -> dict[str, Any]:
        ray = self.ray
        from ray import exceptions as rex

        try:
            return ray.get(ref, timeout=60)
        except rex.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else None
            if isinstance(cause, UserError):
                raise UserError(str(cause)) from None
            if cause is not None:
                raise cause from None
            raise
        except (rex.WorkerCrashedError, rex.NodeDiedError, rex.OwnerDiedError, rex.ObjectLostError,
                rex.TaskCancelledError, rex.GetTimeoutError) as exc:
            line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"cell {job.label}: its Ray task failed after {MAX_RETRIES} retries ({line}); the "
                            f"records written so far are kept: rerun with --resume") from None

    def _target(self, rel: str) -> Path:
        """A file the task returned, under the run directory (never outside it)."""
        root = self.run_dir.resolve()
        target = (root / rel).resolve()
        if rel.startswith("/") or root not in target.parents:
            raise UserError(f"--executor ray: a cell returned a file outside the run directory: {rel!r}")
        return target

    def close(self, cancel: bool = False) -> None:
        global _owned
        ray = self.ray
        if ray is None:
            return
        try:
            for ref in self.refs.values():
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 - a task already done or gone
                    pass
            self.refs = {}
        finally:
            if _owned:
                _owned = False
                ray.shutdown()


def make_executor(run_dir: Path, options: RunOptions) -> RayExecutor:
    return RayExecutor(run_dir, options)


# ---------------------------------------------------------------------------------- scoring on actors


class WhisperActor:
    """One Whisper model per actor, loaded as the actor starts; ``transcribe`` takes clips as
    (name, WAV bytes) and returns (transcripts, wall seconds, CPU seconds, this actor's stats)."""

    def __init__(self, spec: PoolSpec) -> None:
        import tempfile

        self.transcriber = spec.make()
        self.transcriber._load()  # type: ignore[attr-defined]  # the one load, before any clip
        self.loads, self.calls, self.clips = 1, 0, 0
        self.scratch = Path(tempfile.mkdtemp(prefix="omni-stress-asr-"))

    def transcribe(self, clips: list[tuple[str, bytes]]) -> tuple[list[str], float, float, dict[str, Any]]:
        from harness.audio.pool import transcribe_clips

        t0, c0 = time.perf_counter(), time.process_time()
        paths = []
        for i, (name, data) in enumerate(clips):
            path = self.scratch / f"{self.calls}-{i}-{Path(name).name}"
            path.write_bytes(data)
            paths.append(path)
        try:
            texts = transcribe_clips(self.transcriber, paths)
        finally:
            for path in paths:
                path.unlink(missing_ok=True)
        self.calls += 1
        self.clips += len(clips)
        return texts, time.perf_counter() - t0, time.process_time() - c0, self.stats()

    def stats(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "loads": self.loads, "calls": self.calls, "clips": self.clips,
                "node": node_here()["id"]}


def actor_count(spec: PoolSpec, options: RunOptions, cluster_cpus: float) -> tuple[int, int]:
    """(actors, threads each): ``--asr-workers N`` actors, else the local rule over the cluster's CPUs
    (two on two or more); the cluster's CPUs split between them."""
    from harness.audio.pool import default_workers

    cpus = max(1, int(cluster_cpus))
    if options.asr_workers > 0:
        return options.asr_workers, max(1, cpus // options.asr_workers)
    return default_workers(cpus)


class RayAsrPool:
    """``harness.audio.pool``'s interface (submit, pump, forget, close) over Whisper actors."""

    def __init__(self, spec: PoolSpec, options: RunOptions) -> None:
        from harness.audio.pool import QueuedPool

        self.spec, self.options = spec, options
        self.actors: list[Any] = []
        self.load: list[int] = []  # calls in flight per actor
        self._load_lock = threading.Lock()
        self.stats: dict[int, dict[str, Any]] = {}  # per actor, its latest stats
        self.ray: Any = None
        pool = self

        class _Queue(QueuedPool):
            def _dispatch(self, paths: list[Path]) -> Future:
                return pool._dispatch(paths)

            def _error(self, exc: BaseException) -> BaseException:
                return pool._error(exc)

        per_actor = 1 if spec.batch else 2
        self._queue = _Queue(per_call=spec.batch, capacity=0)
        self._per_actor = per_actor

    @property
    def batches(self) -> list[int]:
        return self._queue.batches

    def _start(self) -> None:
        import dataclasses

        self.ray = ray = import_ray()
        connect(self.options.ray_address)
        workers, threads = actor_count(self.spec, self.options, ray.cluster_resources().get("CPU", 1))
        spec = dataclasses.replace(self.spec, workers=workers, threads_per_worker=threads)
        cls = ray.remote(WhisperActor).options(num_cpus=0, scheduling_strategy="SPREAD", max_restarts=MAX_RETRIES,
                                               max_task_retries=MAX_RETRIES, name=None)
        self.actors = [cls.remote(spec) for _ in range(workers)]
        self.load = [0] * workers
        self._queue.capacity = workers * self._per_actor

    def submit(self, digest: str, wav_path: Path) -> tuple[Future, bool]:
        if self.ray is None:
            self._start()
        return self._queue.submit(digest, wav_path)

    def pump(self) -> None:
        if self.ray is not None:
            self._queue.pump()

    def forget(self, digest: str) -> None:
        self._queue.forget(digest)

    def _dispatch(self, paths: list[Path]) -> Future:
        """One actor call: the least busy actor gets the clips' bytes; a Future of (texts, wall, cpu)."""
        from concurrent.futures import Future as PlainFuture

        with self._load_lock:
            index = min(range(len(self.actors)), key=lambda i: self.load[i])
            self.load[index] += 1
        ref = self.actors[index].transcribe.remote([(p.name, p.read_bytes()) for p in paths])
        out: PlainFuture = PlainFuture()

        def done(fut: Future, index: int = index) -> None:
            with self._load_lock:
                self.load[index] -= 1
            try:
                texts, wall, cpu, stats = fut.result()
            except BaseException as exc:  # noqa: BLE001 - the clips' Futures carry it
                out.set_exception(exc)
                return
            self.stats[index] = stats
            out.set_result((texts, wall, cpu))

        ref.future().add_done_callback(done)
        return out

    def _error(self, exc: BaseException) -> BaseException:
        """A failed actor call as one line: the actor's own UserError, or what Ray says happened."""
        cause = getattr(exc, "cause", None)
        if isinstance(cause, UserError):
            return UserError(str(cause))
        if isinstance(exc, UserError):
            return exc
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return UserError(f"ASR actor failed ({line}); the records written so far are kept, rerun with --resume")

    def actor_stats(self, timeout: float = 60) -> list[dict[str, Any]]:
        """Each actor's stats, asked now (pid, loads, calls, clips, node)."""
        if self.ray is None:
            return []
        return self.ray.get([a.stats.remote() for a in self.actors], timeout=timeout)

    def close(self, cancel: bool = False) -> None:
        self._queue._cancel_queued()
        ray, actors, self.actors = self.ray, self.actors, []
        if ray is None or not ray.is_initialized():
            return
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - an actor already gone
                pass


def make_asr_pool(spec: PoolSpec, options: RunOptions) -> RayAsrPool:
    """Whisper on Ray actors (see the module docstring)."""
    return RayAsrPool(spec, options)
