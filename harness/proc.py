"""What every worker process of a run needs: to go away when the run does."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
from collections.abc import Iterator

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
