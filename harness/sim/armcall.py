"""One call of an arm's ``talker_preprocess``, fenced so that the arm can break its own request
but never the run (docs/robustness.md, "Arms that misbehave").

* Whatever the arm raises, including ``SystemExit`` (``sys.exit``), a ``KeyboardInterrupt`` it
  raises itself and a ``MemoryError`` (its frames are dropped and collected at once), fails the
  call. A real Ctrl-C (SIGINT) during the call still stops the run: a
  SIGINT handler counts the signals, so the two are told apart.
* ``os._exit`` called by the arm during the call fails the call instead of ending the process
  (``os._exit`` is swapped for the length of the call; a plugin that bound ``_exit`` before, or
  kills itself with a signal, still ends its process: in a sim worker that is one error line and
  ``--resume``, see ``harness.sim.pool``).
* A call that does not return within the per-call limit (``--arm-timeout``, default
  ``DEFAULT_LIMIT_S``) is interrupted by ``SIGALRM`` and fails. An arm that ignores or replaces
  ``SIGALRM`` does not defeat it: a watchdog thread raises the timeout into the call
  (``PyThreadState_SetAsyncExc``) ``WATCHDOG_GRACE_S`` later, and wakes a sleep with a signal
  when the arm's own handler would run (issue 24, case 8). Python code is interrupted
  wherever it is (a loop, ``time.sleep``, a lock wait); a call stuck inside native code is
  interrupted when it returns to Python. The limit needs the main thread (signals are delivered
  there); elsewhere calls are not limited.
* A call that does not return even then (an arm that ignores ``SIGALRM`` and swallows every exception,
  or blocks in native code) cannot be ended inside its process. In a sim worker (``kill_when_stuck``,
  set by ``harness.sim.pool``) the watchdog then writes which call of the cell is stuck to the pool's
  report file and ends the worker, ``KILL_GRACE_S`` after the timeout was raised; the pool replaces the
  worker and simulates the cell again with that call failed without being made (``set_doomed``): the
  sim is deterministic, so the records are those of a call that timed out (issue 33, case 1).
* The returned rows must be a 2-D tensor as wide as the Talker's hidden size; anything else
  fails the call before the runner copies a row.
* Threads an arm starts and leaves running do not keep the run (or a sim worker) from exiting:
  at exit they get ``ARM_THREAD_GRACE_S`` to end, then the interpreter stops waiting for them, as
  for daemon threads, with one warning line (issue 24, case 7).

Why 10 s: measured over the default prompt set (``main``, ``pr`` and the upstream 0.30.0 arm x
reference and stress, about 107,000 calls, on the shared 2-core machine), a call takes 20-95 µs
(median), 0.1-4.3 ms at the 99th percentile and 12.5 ms at most, so 10 s is about 800 times the
slowest working call (room for a much slower plugin or a loaded machine), while a hung arm costs
at most 10 s per request: a 16-prompt cell whose arm hangs on every request ends, as 16 error
records, in under 3 minutes. ``--arm-timeout 0`` turns the limit off (a debugger session).
"""

from __future__ import annotations

import gc
import os
import signal
import _signal
import sys
import threading
import time
from typing import Any

import torch

DEFAULT_LIMIT_S = 10.0
_limit_s = DEFAULT_LIMIT_S
_real_exit = os._exit


def set_limit(seconds: float) -> None:
    """The per-call limit of this process and of the sim workers it forks later (0: none)."""
    global _limit_s
    _limit_s = float(seconds)


def limit() -> float:
    return _limit_s


class ArmTimeout(BaseException):
    """Raised into an arm's call at its time limit (a BaseException: ``except Exception`` in the
    arm cannot swallow it)."""


class ArmExit(BaseException):
    """Raised instead of ending the process when the arm calls ``os._exit``."""


def _exit_guard(code: int = 0) -> None:
    if threading.current_thread() is threading.main_thread():
        raise ArmExit(code)
    _real_exit(code)  # another thread (a worker's parent watchdog) really exits


_armed = False  # an arm's call is running under the timer
_installed = False
_previous_handler: Any = None


# The limit counts the seconds the call could have run: wall time less the time its thread waited for a CPU
# (the kernel's run-queue delay, /proc/<pid>/task/<tid>/schedstat). On a machine whose cores other
# processes keep busy a correct arm's call is runnable but not running; it must not time out for that
# (issue 47, case 6: a correct arm hit its 1 s limit with two CPU-bound processes beside it). A hang that
# sleeps or blocks waits for no CPU and ends at the limit; one that spins ends once it has had the limit's
# worth of CPU, and never later than ``HARD_LIMIT_FACTOR`` times the limit (``HARD_LIMIT_MIN_S`` at least)
# in wall time, however starved the machine.
HARD_LIMIT_FACTOR = 10.0
HARD_LIMIT_MIN_S = 60.0
_sched_fd = -1  # this process's main thread's schedstat, opened once per process (a forked worker reopens)
_sched_pid = 0
_call_wall0 = 0.0  # monotonic time the timed call started
_call_wait0 = 0  # its thread's run-queue delay (ns) then; -1: not readable (wall time alone)


def _run_queue_ns() -> int:
    """The main thread's time spent waiting for a CPU so far (ns); -1 where the kernel does not say."""
    global _sched_fd, _sched_pid
    if _sched_pid != os.getpid():
        _sched_pid = os.getpid()
        try:
            _sched_fd = os.open(f"/proc/{_sched_pid}/task/{threading.main_thread().native_id}/schedstat",
                                os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, AttributeError):
            _sched_fd = -1
    if _sched_fd < 0:
        return -1
    try:
        return int(os.pread(_sched_fd, 96, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _left_s(now: float) -> float:
    """Seconds the running call may still take: the limit less the seconds it could have run, or 0 once
    the hard wall-clock bound is reached."""
    wall = now - _call_wall0
    if wall >= max(_limit_s * HARD_LIMIT_FACTOR, HARD_LIMIT_MIN_S):
        return 0.0
    waited = 0.0
    if _call_wait0 >= 0:
        current = _run_queue_ns()
        if current >= 0:
            waited = (current - _call_wait0) / 1e9
    return max(0.0, _limit_s - (wall - waited))


EXTEND_MIN_S = 0.01  # shorter than this left: the call is over its limit


def _on_alarm(signum: int, frame: Any) -> None:
    if _armed:
        left = _left_s(time.monotonic())
        if left >= EXTEND_MIN_S:  # the call waited for a CPU: it gets that time back
            signal.setitimer(signal.ITIMER_REAL, left)
            _push_watchdog(left)
            return
        raise ArmTimeout()
    if callable(_previous_handler):  # not ours: whoever handled SIGALRM before still does
        _previous_handler(signum, frame)


def _install() -> None:
    """The SIGALRM handler, installed once per cell (``prepare``) rather than per call
    (``signal.signal`` costs ~10 µs, more than most arm calls; ``setitimer`` per call ~2 µs). It
    passes alarms it did not arm to the handler that was there before."""
    global _installed, _previous_handler
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    if previous is not _on_alarm:
        _previous_handler = previous
    _installed = True


_sigints = 0  # SIGINTs delivered to this process since the handler went in
_previous_sigint: Any = None


def _on_sigint(signum: int, frame: Any) -> None:
    global _sigints
    _sigints += 1
    previous = _previous_sigint
    if callable(previous):
        previous(signum, frame)  # the default: raises KeyboardInterrupt
    elif previous != signal.SIG_IGN:
        raise KeyboardInterrupt


def _install_sigint() -> None:
    """Counts SIGINTs, then does what the handler before did: an arm that raises KeyboardInterrupt
    itself fails its call, a real Ctrl-C still ends the run (issue 24, case 11)."""
    global _previous_sigint
    previous = signal.signal(signal.SIGINT, _on_sigint)
    if previous is not _on_sigint:
        _previous_sigint = previous


ARM_THREAD_GRACE_S = 2.0
_ACTIVE: dict[int, threading.Thread] | None = getattr(threading, "_active", None)  # CPython's running threads
_arm_threads: list[threading.Thread] = []  # non-daemon threads started during an arm's call
_atexit_registered = False


def _note_new_threads(before: set[int]) -> None:
    global _atexit_registered
    for t in threading.enumerate():
        if t.ident not in before and not t.daemon and t is not threading.current_thread():
            _arm_threads.append(t)
    if _arm_threads and not _atexit_registered and hasattr(threading, "_register_atexit"):
        threading._register_atexit(_abandon_arm_threads)  # runs before the interpreter joins threads
        _atexit_registered = True


def _abandon_arm_threads() -> None:
    """At exit: the arm's threads that are still running after a grace period are not waited for
    (taken off the list of threads the interpreter joins at shutdown, as a daemon thread is)."""
    alive = [t for t in _arm_threads if t.is_alive()]
    deadline = time.monotonic() + ARM_THREAD_GRACE_S
    for t in alive:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t for t in alive if t.is_alive()]
    locks, guard = getattr(threading, "_shutdown_locks", None), getattr(threading, "_shutdown_locks_lock", None)
    if not alive or locks is None or guard is None:
        return
    with guard:
        for t in alive:
            locks.discard(getattr(t, "_tstate_lock", None))
    names = ", ".join(repr(t.name) for t in alive[:3]) + (", ..." if len(alive) > 3 else "")
    try:
        sys.stderr.write(f"omni-stress: warning: an arm left {len(alive)} thread{'s' if len(alive) > 1 else ''} "
                         f"running ({names}); exiting without waiting for {'them' if len(alive) > 1 else 'it'}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


WATCHDOG_GRACE_S = 1.0  # past the limit, before the watchdog steps in (SIGALRM normally fires first)
WATCHDOG_POLL_S = 0.25
_watch_lock = threading.Lock()
_watch_deadline = 0.0  # monotonic time past which the running call is failed; 0: no call is timed
_watch_fired = False
_watchdog_pid = 0  # the process whose watchdog thread runs (a forked worker starts its own)


KILL_GRACE_S = 2.0  # after the watchdog raised the timeout into a call that still runs: the worker is ended
_cell_calls = 0  # calls made in this cell (reset by ``prepare``): a call's index, the same in a replay
_doomed: dict[int, str] = {}  # call index -> error: calls of this cell failed without being made
_kill_report: str | None = None  # a sim worker: where to say which call was stuck before ending the process
_cell_tag = ""  # the cell this worker simulates (the pool's key), written with a stuck call's index
_stuck_since = 0.0  # monotonic time the watchdog raised the timeout into a call that has not returned; 0: none
_stuck_call = 0


def kill_when_stuck(report_path: str | None) -> None:
    """In a sim worker: a call that stays stuck ``KILL_GRACE_S`` after its timeout was raised ends this
    process, after appending ``TAG<TAB>CALL_INDEX`` to ``report_path`` (the pool then replaces it)."""
    global _kill_report
    _kill_report = report_path


def set_cell(tag: str, doomed: dict[int, str] | None = None) -> None:
    """The cell this process simulates next, and the calls of it to fail without making them."""
    global _cell_tag, _doomed, _cell_calls
    _cell_tag, _doomed, _cell_calls = tag, dict(doomed or {}), 0


def stuck_message(limit_s: float) -> str:
    return (f"ArmTimeout: talker_preprocess did not return within {limit_s:g} s (the per-call limit, --arm-timeout) "
            f"and ignored the interruption; its sim worker was replaced")


def _end_stuck_worker() -> None:
    """Called by the watchdog, under ``_watch_lock``, when a call ignores its timeout in a sim worker."""
    try:
        fd = os.open(_kill_report or "", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, f"{_cell_tag}\t{_stuck_call}\n".encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # the pool then reports a dead worker, as before
    _real_exit(70)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc is not None else None)


def _watchdog(main_id: int) -> None:
    global _watch_deadline, _watch_fired, _stuck_since
    while True:
        time.sleep(WATCHDOG_POLL_S)
        with _watch_lock:
            if _stuck_since and _kill_report and time.monotonic() >= _stuck_since + KILL_GRACE_S:
                _end_stuck_worker()  # the call ignored the timeout: only ending the process ends it
            if not _watch_deadline or time.monotonic() < _watch_deadline:
                continue
            left = _left_s(time.monotonic())
            if left >= EXTEND_MIN_S:  # starved, not stuck (the arm's own SIGALRM handler may have run instead)
                _watch_deadline = time.monotonic() + left + WATCHDOG_GRACE_S
                continue
            _watch_deadline, _watch_fired = 0.0, True
            _stuck_since = time.monotonic()
            _set_async_exc(main_id, ArmTimeout)  # raised at the call's next Python instruction
            if callable(signal.getsignal(signal.SIGALRM)):  # a Python handler (the arm's): wake a sleep
                try:
                    signal.pthread_kill(main_id, signal.SIGALRM)
                except (OSError, ValueError):
                    pass


def _arm_watchdog(seconds: float) -> None:
    global _watchdog_pid, _watch_deadline
    if _watchdog_pid != os.getpid():
        _watchdog_pid = os.getpid()
        main_id = threading.main_thread().ident
        assert main_id is not None
        threading.Thread(target=_watchdog, args=(main_id,), name="omni-stress-arm-watchdog", daemon=True).start()
    _watch_deadline = time.monotonic() + seconds + WATCHDOG_GRACE_S


def _push_watchdog(left: float) -> None:
    """The watchdog waits as long as the timer does (a float store: no lock in a signal handler)."""
    global _watch_deadline
    if _watch_deadline:
        _watch_deadline = time.monotonic() + left + WATCHDOG_GRACE_S


def _disarm_watchdog() -> None:
    global _watch_deadline, _watch_fired, _stuck_since
    with _watch_lock:
        _watch_deadline = 0.0
        _stuck_since = 0.0
        if _watch_fired:  # the timeout may still be pending: it must not land outside the call
            _watch_fired = False
            _set_async_exc(threading.main_thread().ident or 0, None)
            raise ArmTimeout()


def prepare() -> None:
    """Called as a cell starts: (re)installs the handler, in case someone replaced it since; counts the
    cell's calls from 0."""
    global _cell_calls
    _cell_calls = 0
    if _limit_s > 0 and threading.current_thread() is threading.main_thread():
        _install()


def call(fn: Any, /, **kwargs: Any) -> Any:
    """``fn(**kwargs)`` under the guards above; arm failures come out as ``ArmFailure``."""
    global _armed, _cell_calls, _stuck_call, _call_wall0, _call_wait0
    index = _cell_calls
    _cell_calls = index + 1
    if _doomed and index in _doomed:  # this call hung its worker before: it fails without being made
        raise ArmFailure(_doomed[index])
    main = threading.current_thread() is threading.main_thread()
    timed = _limit_s > 0 and main
    # ``_signal.getsignal``: the raw handler, without ``signal.getsignal``'s enum conversion (~10x its cost).
    if main and _signal.getsignal(signal.SIGINT) is not _on_sigint:  # someone may have replaced it
        _install_sigint()
    sigints = _sigints
    before = set(_ACTIVE) if _ACTIVE is not None else None  # idents of the running threads (~0.2 µs)
    previous_delay = 0.0
    t0 = 0.0
    os._exit = _exit_guard  # type: ignore[assignment]
    try:
        if timed:
            if _signal.getsignal(signal.SIGALRM) is not _on_alarm:  # an arm may have replaced it
                _install()
            _call_wall0, _call_wait0 = time.monotonic(), _run_queue_ns()
            _stuck_call = index
            _arm_watchdog(_limit_s)
            _armed = True
            previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, _limit_s)
            if previous_delay > 0:
                t0 = time.monotonic()
        try:
            return fn(**kwargs)
        finally:
            if timed:
                signal.setitimer(signal.ITIMER_REAL, 0)
                _armed = False
                _disarm_watchdog()
            if before is not None and len(_ACTIVE) > len(before):  # the arm started a thread
                _note_new_threads(before)
    except ArmTimeout:
        raise ArmFailure(f"ArmTimeout: talker_preprocess did not return within {_limit_s:g} s "
                         f"(the per-call limit, --arm-timeout)") from None
    except ArmExit as exc:
        raise ArmFailure(f"ArmExit: talker_preprocess called os._exit({exc.args[0]!r})") from None
    except SystemExit as exc:
        raise ArmFailure(f"SystemExit: talker_preprocess called sys.exit({exc.code!r})") from None
    except KeyboardInterrupt:
        if not main or _sigints != sigints:
            raise  # a real Ctrl-C (or a thread we cannot tell about): the run stops
        raise ArmFailure("KeyboardInterrupt: talker_preprocess raised KeyboardInterrupt (not a Ctrl-C)") from None
    except MemoryError as exc:  # under a memory limit (ulimit -v, RLIMIT_AS) or a huge request (issue 24 case 10)
        exc.__traceback__ = None  # the arm's frames, and what their locals hold, go now
        gc.collect()  # so what the arm let go of is free again before the next request
        raise ArmFailure("MemoryError: talker_preprocess ran out of memory (the process's memory limit, "
                         "e.g. ulimit -v)") from None
    except Exception as exc:
        raise ArmFailure(f"{type(exc).__name__}: {exc}") from None
    finally:
        os._exit = _real_exit
        if previous_delay > 0:  # someone else's timer (a test runner's timeout): give it back
            signal.setitimer(signal.ITIMER_REAL, max(previous_delay - (time.monotonic() - t0), 1e-3))


class ArmFailure(Exception):
    """The arm's call failed; ``str()`` is the request's error text."""


def check_rows(rows: Any, width: int) -> int:
    """The number of rows an arm returned, after checking they are rows the runner can copy."""
    if not isinstance(rows, torch.Tensor):
        raise ArmFailure(f"TypeError: talker_preprocess returned {type(rows).__name__} rows, not a torch.Tensor")
    if rows.dim() != 2 or rows.shape[1] != width:
        raise ArmFailure(f"ValueError: talker_preprocess returned rows of shape {tuple(rows.shape)}; "
                         f"expected (rows, {width}), {width} being the Talker's hidden size")
    return int(rows.shape[0])
