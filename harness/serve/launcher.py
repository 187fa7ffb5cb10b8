"""Start a ``vllm serve --omni`` server on 127.0.0.1, wait until it is healthy, and always stop it.

Why a process group: vLLM-Omni's API server forks one engine process per stage plus GPU workers;
the server runs in its own session (``start_new_session=True``) so that a Ctrl-C on the terminal does
not reach it half-way, and so that stopping it can signal every process it started at once
(``os.killpg``). Stop escalates SIGINT (vLLM's graceful shutdown, ``entrypoints/cli/serve.py``
installs handlers for SIGINT and SIGTERM) -> SIGTERM -> SIGKILL, each with a timeout, then sweeps the
group for leftovers (orphaned workers would otherwise keep GPU memory). Every exit path stops it:
``with ServerLauncher(...)``, exceptions, KeyboardInterrupt and (while the launcher is active in the
main thread) SIGTERM to this process.

The health check is vLLM-Omni's ``GET /health`` (``entrypoints/openai/api_server.py``: 200
``{"status": "healthy"}`` once the engine client exists, 503 otherwise). Never ``shell=True``.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

from harness.errors import UserError

HOST = "127.0.0.1"
TAIL_LINES = 25
_ADDRESS_IN_USE = ("address already in use", "errno 98", "eaddrinuse")


def progress(msg: str) -> None:
    """Phase messages for a human watching a long run (model load takes minutes)."""
    sys.stderr.write(f"omni-stress: {msg}\n")
    sys.stderr.flush()


def port_is_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_free_port(host: str = HOST) -> int:
    """A port the kernel considers free now (the server binds it a moment later; a race is retried)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = _proc_state(pid)
    return state is not None and state != "Z"


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            data = fh.read()
    except OSError:
        return "?" if sys.platform != "linux" else None
    return data[data.rfind(")") + 2 :].split(" ", 1)[0]


def _package_root() -> str:
    """The folder that holds ``harness``, so the reaper imports this very checkout."""
    root = str(Path(__file__).resolve().parents[2])
    extra = os.environ.get("PYTHONPATH")
    return root if not extra else os.pathsep.join([root, extra])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                data = fh.read()
        except OSError:
            continue
        fields = data[data.rfind(")") + 2 :].split(" ")
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(entry))
    return members


def read_tail(path: Path, start: int = 0, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of ``path`` written after byte ``start`` (this launch's part of the log)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            end = fh.tell()
            fh.seek(max(start, end - 256 * 1024))
            data = fh.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


_LOG_PREFIX = re.compile(r"^\([^)]*pid=\d+[^)]*\) ")  # vLLM's prefix on its workers' lines: "(EngineCore pid=12) "
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Fault|Failure)\b")
# Terminal colour (vLLM colours its process prefix, ``\x1b[1;36m(EngineCore pid=12)\x1b[0;0m``, and its log
# levels when it thinks it writes to a terminal) and vLLM's logger header (``ERROR 12-06 05:20:00 [core.py:700] ``).
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_LOG_HEADER = re.compile(r"^(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ")


def _log_line(line: str) -> tuple[str | None, str]:
    """(the logger level of vLLM's header, or None; the line as a person reads it: no colour codes, no
    vLLM process prefix, no logger header)."""
    line = _LOG_PREFIX.sub("", _ANSI.sub("", line).replace("\r", ""))
    m = _LOG_HEADER.match(line)
    return (m.group(1), line[m.end():]) if m else (None, line)


def clean_log_line(line: str) -> str:
    return _log_line(line)[1]


def last_traceback_line(text: str) -> str | None:
    """The exception line that ends the last Python traceback in ``text`` (a server log: a worker's
    crash is the last thing it printed), e.g. ``RuntimeError: shape mismatch``; None if the text
    holds no traceback. Colour codes, vLLM's per-process prefix (``(EngineCore pid=12) ``) and its
    logger header are dropped (``clean_log_line``)."""
    lines = [clean_log_line(line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    found = []
    for start, end in zip(starts, [*starts[1:], len(lines)]):
        for line in lines[start + 1:end]:
            if not line[:1].isspace() and _EXCEPTION_LINE.match(line):
                found.append(line.strip()[:300])
                break
    causes = [line for line in found if ENGINE_DEAD not in line]  # the API server's report of a dead engine
    return (causes or found or [None])[-1]                          # is a consequence: the worker's line is why


# vLLM's exception when an engine core died while the API server lives on (``vllm.v1.engine.exceptions``)
ENGINE_DEAD = "EngineDeadError"


def crash_line_of(text: str) -> str:
    """The one line a crash is reported with: the last traceback's exception line, else the last ERROR or
    CRITICAL message, else the last line; cleaned (``clean_log_line``). Never a later INFO line of a
    process that outlived the crash, never colour codes."""
    line = last_traceback_line(text)
    if line is not None:
        return line
    lines = [_log_line(ln) for ln in text.splitlines() if ln.strip()]
    errors = [clean for level, clean in lines if level in ("ERROR", "CRITICAL")]
    pick = errors[-1] if errors else lines[-1][1] if lines else ""
    return pick.strip()[:300] or "no output"


class ServerLauncher:
    """One server process: ``start()`` blocks until ``/health`` answers 200, ``stop()`` always reaps it.

    ``argv_for_port(port)`` builds the command line (the port is part of it). The log file is
    appended to, with a header per launch, so repeats of a cell keep one log.
    """

    def __init__(
        self,
        argv_for_port: Callable[[int], Sequence[str]],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        label: str = "vllm-omni server",
        health_timeout_s: float = 1800.0,
        port: int | None = None,
        cwd: Path | None = None,
        stop_timeouts_s: tuple[float, float, float] = (30.0, 15.0, 10.0),
        port_attempts: int = 3,
        poll_interval_s: float = 1.0,
        progress_every_s: float = 60.0,
        announce: Callable[[str], None] | None = progress,
    ) -> None:
        self.argv_for_port = argv_for_port
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.label = label
        self.health_timeout_s = health_timeout_s
        self.fixed_port = port
        self.cwd = cwd
        self.stop_timeouts_s = stop_timeouts_s
        self.port_attempts = max(1, port_attempts)
        self.poll_interval_s = poll_interval_s
        self.progress_every_s = progress_every_s
        self.announce = announce or (lambda _msg: None)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.argv: list[str] = []
        self.returncode: int | None = None
        self._log_start = 0
        self._dead_scan = 0  # how far engine_dead has read the log
        self._engine_dead = False
        self._prev_sigterm: object = None
        self._sigterm_installed = False
        self._reaper: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ properties

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        """The process runs and its engine has not died (``engine_dead``)."""
        return self.proc is not None and self.proc.poll() is None and not self.engine_dead()

    def engine_dead(self) -> bool:
        """vLLM-Omni's API server outlives a stage's engine core (0.30.0's Qwen3-Omni Talker raising in its
        runner): its log says ``EngineDeadError`` and it answers every request with an error from then on,
        so it is as crashed as an exited server. The log is read from where it was last read, once dead
        always dead."""
        if self._engine_dead:
            return True
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(max(self._log_start, self._dead_scan - len(ENGINE_DEAD)))
                data = fh.read()
                self._dead_scan = fh.tell()
        except OSError:
            return False
        self._engine_dead = ENGINE_DEAD.encode() in data
        return self._engine_dead

    def tail(self, lines: int = TAIL_LINES) -> str:
        return read_tail(self.log_path, self._log_start, lines)

    def crash_line(self) -> str:
        """What the crash said (``crash_line_of`` this launch's log)."""
        return crash_line_of(read_tail(self.log_path, self._log_start, 400))

    def death_message(self, when: str) -> str:
        code = self.proc.returncode if self.proc is not None else None
        tail = self.tail()
        return (
            f"{self.label} exited with code {code} {when}; log: {self.log_path}"
            + (f"\n--- last lines of {self.log_path.name} ---\n{tail}" if tail else "")
        )

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> ServerLauncher:  # noqa: PYI034
        self._install_sigterm()
        try:
            self.start()
        except BaseException:
            self._restore_sigterm()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self._restore_sigterm()

    def start(self) -> None:
        """Launch and wait for health; on any failure the process group is stopped before raising."""
        try:
            for attempt in range(1, self.port_attempts + 1):
                port = self._choose_port()
                self._spawn(port)
                outcome = self._wait_healthy()
                if outcome == "healthy":
                    return
                # died before becoming healthy
                tail = self.tail().lower()
                self.stop()
                if self.fixed_port is None and attempt < self.port_attempts and any(s in tail for s in _ADDRESS_IN_USE):
                    self.announce(f"port {port} was taken before the server could bind it; retrying on another port")
                    continue
                raise UserError(self.death_message("before becoming healthy"))
            raise UserError(self.death_message("before becoming healthy"))  # pragma: no cover - loop always returns/raises
        except BaseException:
            self.stop()
            raise

    def _choose_port(self) -> int:
        if self.fixed_port is not None:
            if not port_is_free(self.fixed_port):
                raise UserError(f"{self.label}: port {self.fixed_port} on {HOST} is already in use")
            return self.fixed_port
        for _ in range(20):
            port = pick_free_port()
            if port_is_free(port):
                return port
        raise UserError(f"{self.label}: no free port on {HOST}")  # pragma: no cover

    def _spawn(self, port: int) -> None:
        self.port = port
        self.argv = [str(a) for a in self.argv_for_port(port)]
        self.returncode = None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(self.env) if self.env is not None else dict(os.environ)
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            header = f"=== omni-stress: {time.strftime('%Y-%m-%d %H:%M:%S')} starting {self.label}: {shlex.join(self.argv)}\n"
            log.write(header.encode("utf-8"))
            log.flush()
            self._log_start = self._dead_scan = log.tell()
            self._engine_dead = False
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=str(self.cwd) if self.cwd else None,
                    start_new_session=True,
                )
            except OSError as exc:
                self.proc = None
                why = "not found" if exc.errno == errno.ENOENT else (exc.strerror or str(exc))
                raise UserError(f"{self.label}: cannot start {self.argv[0]!r}: {why}") from None
        self._start_reaper(self.proc.pid)
        self.announce(f"started {self.label} (pid {self.proc.pid}, port {port}); log: {self.log_path}")

    def _start_reaper(self, pgid: int) -> None:
        """``harness.serve.reaper``: stops the server's group if this process dies without doing it."""
        try:
            self._reaper = subprocess.Popen(
                [sys.executable, "-m", "harness.serve.reaper", str(os.getpid()), str(pgid)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, "PYTHONPATH": _package_root()},
            )
        except OSError:
            self._reaper = None  # the in-process stop paths still apply

    def _stop_reaper(self) -> None:
        reaper, self._reaper = self._reaper, None
        if reaper is not None and reaper.poll() is None:
            reaper.terminate()
            try:
                reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait(timeout=5)

    def _wait_healthy(self) -> str:
        assert self.proc is not None
        url = f"http://{HOST}:{self.port}/health"
        start = time.monotonic()
        deadline = start + self.health_timeout_s
        next_note = start + self.progress_every_s
        interval = min(0.1, self.poll_interval_s)
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(2.0, connect=1.0)) as client:
            while True:
                if self.proc.poll() is not None:
                    return "died"
                try:
                    if client.get(url).status_code == 200:
                        if self.proc.poll() is not None:  # someone else answered on our port
                            return "died"
                        self.announce(f"{self.label} healthy after {time.monotonic() - start:.0f} s")
                        return "healthy"
                except httpx.HTTPError:
                    pass
                now = time.monotonic()
                if now >= deadline:
                    tail = self.tail()
                    self.stop()
                    raise UserError(
                        f"{self.label} did not become healthy within {self.health_timeout_s:g} s "
                        f"(health timeout); stopped it; log: {self.log_path}"
                        + (f"\n--- last lines of {self.log_path.name} ---\n{tail}" if tail else "")
                    )
                if now >= next_note:
                    self.announce(f"waiting for {self.label} to load ({now - start:.0f} s so far)")
                    next_note = now + self.progress_every_s
                time.sleep(min(interval, max(0.0, deadline - now)))
                interval = min(self.poll_interval_s, interval * 1.5)

    def stop(self) -> int | None:
        """SIGINT -> SIGTERM -> SIGKILL to the whole group, each bounded; then kill leftovers. Idempotent."""
        proc = self.proc
        if proc is None:
            return self.returncode
        pgid = proc.pid  # start_new_session: the server leads its own group
        try:
            if proc.poll() is None:
                for sig, timeout in zip((signal.SIGINT, signal.SIGTERM, signal.SIGKILL), self.stop_timeouts_s):
                    try:
                        os.killpg(pgid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=timeout)
                        break
                    except subprocess.TimeoutExpired:
                        continue
            self._sweep_group(pgid)
        except KeyboardInterrupt:
            self._kill_now(proc, pgid)
            raise
        finally:
            if proc.poll() is None:
                self._kill_now(proc, pgid)
            self.returncode = proc.returncode
            self._stop_reaper()
        return self.returncode

    def _sweep_group(self, pgid: int, grace_s: float = 5.0) -> None:
        """Give the group's leftovers (orphaned workers) a short grace after SIGTERM, then SIGKILL them."""
        if not group_members(pgid):
            return
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_members(pgid):
            time.sleep(0.1)
        if group_members(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    @staticmethod
    def _kill_now(proc: subprocess.Popen[bytes], pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
            pass

    # ------------------------------------------------------------------ SIGTERM -> clean exit

    def _install_sigterm(self) -> None:
        """While active, SIGTERM to this process exits through ``finally`` (and so stops the server)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous not in (signal.SIG_DFL, None):
            return

        def on_sigterm(signum: int, _frame: object) -> None:
            raise SystemExit(128 + signum)

        self._prev_sigterm = previous
        signal.signal(signal.SIGTERM, on_sigterm)
        self._sigterm_installed = True

    def _restore_sigterm(self) -> None:
        if self._sigterm_installed:
            signal.signal(signal.SIGTERM, self._prev_sigterm)  # type: ignore[arg-type]
            self._sigterm_installed = False
