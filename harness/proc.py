"""What every worker process of a run needs: to go away when the run does; and a computation in a
forked child beside this process's own (``fork_call``)."""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

WATCHDOG_S = 0.5  # how often a worker checks that the run that started it is alive
_exit = os._exit  # bound now: an arm's call swaps os._exit for a guard (harness.sim.armcall)


def exit_with_parent(parent_pid: int) -> None:
    """A SIGKILLed run must not leave its workers behind: a ``ProcessPoolExecutor`` worker blocks
    on a queue whose writer ends it holds itself, so it would wait forever. A daemon thread polls
    the parent and ends the worker once the parent is gone."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_S)
        _exit(0)

    threading.Thread(target=watch, name="omni-stress-parent-watch", daemon=True).start()


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While the run works, whatever prints to stdout (a plugin arm's ``print``, a library's
    banner, in this process or in a worker it forks) goes to stderr, so stdout carries the
    result table alone and can be piped. Both ``sys.stdout`` and file descriptor 1 are moved
    (when stdout is a real file); both come back afterwards."""
    sys.stdout.flush()
    saved = None
    try:
        if sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2:
            saved = os.dup(1)
            os.dup2(2, 1)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        saved = None  # an in-memory stdout (a test runner): sys.stdout alone is enough
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        try:
            sys.stderr.flush()
        finally:
            if saved is not None:
                os.dup2(saved, 1)
                os.close(saved)


def printable_streams() -> None:
    """stdout and stderr print what the terminal can show: a character its encoding lacks (the en
    dash of the tables on a Latin-1 terminal, ``PYTHONIOENCODING=latin-1``; a path of bytes that
    are not UTF-8) becomes ``?`` instead of a ``UnicodeEncodeError`` after the run finished (issue
    24, cases 3 and 5). The files the run wrote are unaffected."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) != "strict":
            continue
        try:
            stream.reconfigure(errors="replace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, io.UnsupportedOperation):
            pass  # not a TextIOWrapper (a test runner's stream): leave it


# A forked call that gives nothing by then is ended and its caller computes the value itself. Source: the
# one forked call, the timeline plot of a 64-request run, takes 0.43 s alone and 0.58 s beside the parent's
# drawing on 2 cores (docs/robustness.md); 300 s is about 500 times that, room for a far larger run.
FORK_WAIT_S = 300.0


class ForkedCall:
    """``fn()`` of ``fork_call``, computed in a forked child: ``result()`` waits for its bytes."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self.fd = pid, fd

    def result(self, timeout: float = FORK_WAIT_S) -> tuple[bool, bytes | None]:
        """(True, the value) when the child gave it; (False, None) when it failed, died or took longer
        than ``timeout`` (it is then ended): the caller computes the value itself, so a child can cost
        time but never a result."""
        chunks: list[bytes] = []
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                    return False, None
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
            _, status = os.waitpid(self.pid, 0)  # the child closed its end: it is exiting
            self.pid = 0
        finally:
            self.close()
        data = b"".join(chunks)
        if os.waitstatus_to_exitcode(status) != 0 or not data or data[:1] not in (b"\0", b"\1"):
            return False, None
        return True, (data[1:] if data[:1] == b"\1" else None)

    def close(self) -> None:
        """Ends and reaps the child if it is still there (the caller failed, or gave up on it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.pid:
            pid, self.pid = self.pid, 0
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)


def fork_call(fn: Callable[[], bytes | None]) -> ForkedCall | None:
    """``fn()`` started in a forked child, so that this process can do other work meanwhile on a
    second core; None (the caller computes it itself) when a fork is not safe or not useful: another
    thread is alive (a lock it holds would stay held in the child), one CPU, no ``os.fork``, or
    ``OMNI_STRESS_NO_FORK=1``. The child shares this process's state at the fork, so what it computes
    is what this process would; it writes the bytes to a pipe and ends with ``os._exit`` (no
    ``atexit`` handler, no second flush of this process's buffers)."""
    if (not hasattr(os, "fork") or threading.active_count() != 1 or (os.cpu_count() or 1) < 2
            or os.environ.get("OMNI_STRESS_NO_FORK") == "1"):
        return None
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(r)
            value = fn()
            view = memoryview(b"\0" if value is None else b"\1" + value)
            while view:
                view = view[os.write(w, view):]
            code = 0
        except BaseException:  # noqa: BLE001 - whatever it is, the parent computes the value itself
            pass
        finally:
            _exit(code)
    os.close(w)
    return ForkedCall(pid, r)
