"""SIGINT that always lands: every Ctrl-C (or ``kill -INT``) stops the command with exit 130 and one
line saying what is on disk, even where a library or a guard swallowed the ``KeyboardInterrupt``.

Why a module of its own (issue 47, case 2): of 11 SIGINTs sent to a running ``run``, 2 did nothing:
the run wrote its records and exited 0. Two ways lose a SIGINT. A process started with SIGINT
ignored (the background job of a non-interactive shell script: POSIX shells set SIG_IGN there)
never gets Python's ``KeyboardInterrupt`` at all; and a ``KeyboardInterrupt`` raised inside code
that catches everything (a forked child's guard, a callback, an ``atexit`` handler) ends there. So
the console script installs a handler that *counts* every SIGINT before raising, and asks at the
very end, with SIGINT blocked, whether one arrived (``finish``): a counted or pending SIGINT makes
the exit 130 whatever happened to its exception. The command that knows its run directory says
what to do next (``describe``)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process ended by Ctrl-C

_received = 0
_describe: Callable[[], str] | None = None


def _on_sigint(signum: int, frame: Any) -> None:
    global _received
    _received += 1
    raise KeyboardInterrupt


def install() -> None:
    """Our handler, even over an inherited SIG_IGN (see the module's docstring). Main thread only."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)


def received() -> int:
    """SIGINTs delivered to this process since ``install`` (a swallowed one included)."""
    return _received


def describe(what: Callable[[], str] | None) -> None:
    """What the interrupted command leaves behind, asked when the line is printed (a run: how many
    records its directory holds and how to resume it); None: nothing to say."""
    global _describe
    _describe = what


def message() -> str:
    """The line printed for an interrupted command (without the ``omni-stress:`` prefix)."""
    detail = ""
    if _describe is not None:
        try:
            detail = _describe()
        except Exception:  # noqa: BLE001 - the line must be printed whatever the directory looks like
            detail = ""
    return "interrupted (SIGINT)" + (f": {detail}" if detail else "")


def finish() -> bool:
    """True when a SIGINT arrived: counted by the handler, or still pending. SIGINT is blocked from
    here on, so none can arrive between this answer and the exit."""
    pending = False
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        pending = signal.SIGINT in signal.sigpending()
    return _received > 0 or pending


def release() -> None:
    """Unblocks SIGINT after ``finish`` (the status is decided; a slow teardown stays interruptible)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def check() -> None:
    """Raises ``KeyboardInterrupt`` when a SIGINT was counted: called between cells, so a SIGINT whose
    exception something swallowed still stops the run at the next cell (the records so far kept)."""
    if _received:
        raise KeyboardInterrupt
