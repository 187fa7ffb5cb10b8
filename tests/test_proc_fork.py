"""``harness.proc.fork_call``: a value computed in a forked child, or nothing (the caller computes it)."""

from __future__ import annotations

import os
import threading

import pytest

from harness.proc import fork_call

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@pytest.fixture(autouse=True)
def _fork_allowed(monkeypatch):
    monkeypatch.delenv("OMNI_STRESS_NO_FORK", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    if threading.active_count() != 1:
        pytest.skip("the test runner has other threads: fork_call declines, as it should")


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_the_childs_bytes_come_back_whole():
    payload = bytes(range(256)) * 8192  # 2 MiB: more than a pipe holds, so the parent must read as it comes
    child = fork_call(lambda: payload)
    assert child is not None
    pid = child.pid
    assert child.result() == (True, payload)
    assert _reaped(pid)


def test_none_and_empty_values_are_values():
    child = fork_call(lambda: None)
    assert child is not None and child.result() == (True, None)
    child = fork_call(lambda: b"")
    assert child is not None and child.result() == (True, b"")


def test_the_childs_state_is_this_process_state_at_the_fork():
    state = {"n": 41}
    child = fork_call(lambda: str(state["n"] + 1).encode())
    state["n"] = 0  # after the fork: the child does not see it
    assert child is not None and child.result() == (True, b"42")


def test_a_failing_child_gives_nothing_and_is_reaped():
    def boom() -> bytes:
        raise RuntimeError("no")

    child = fork_call(boom)
    assert child is not None
    pid = child.pid
    assert child.result() == (False, None)
    assert _reaped(pid)


def test_a_child_past_the_wait_is_ended_and_reaped():
    import time

    child = fork_call(lambda: time.sleep(120) or b"late")
    assert child is not None
    pid = child.pid
    assert child.result(timeout=0.3) == (False, None)
    assert _reaped(pid)


def test_close_ends_a_child_nobody_waits_for():
    import time

    child = fork_call(lambda: time.sleep(120) or b"late")
    assert child is not None
    pid = child.pid
    child.close()
    assert _reaped(pid)
    child.close()  # twice is harmless


def test_no_fork_with_another_thread_one_cpu_or_the_switch(monkeypatch):
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, args=(60,))
    t.start()
    try:
        assert fork_call(lambda: b"x") is None
    finally:
        stop.set()
        t.join(60)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert fork_call(lambda: b"x") is None
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("OMNI_STRESS_NO_FORK", "1")
    assert fork_call(lambda: b"x") is None
