"""Stops a real-backend server whose omni-stress died without stopping it (SIGKILL, OOM kill).

Why a separate process: the server runs in its own session (so a terminal's Ctrl-C does not reach
it half-way), and nothing of omni-stress runs after a SIGKILL. The launcher starts one reaper per
server, also in its own session; it polls its parent (omni-stress) and the server's process group.
When the parent is gone it sends the group SIGTERM (vLLM's graceful shutdown), then SIGKILL after a
grace period; when the group is gone (the launcher stopped the server) it exits. Bounded: it never
outlives the server's group by more than the grace period.

Run as ``python -m harness.serve.reaper PARENT_PID PGID [GRACE_S]``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5
GRACE_S = 15.0


def _group_alive(pgid: int) -> bool:
    from harness.serve.launcher import group_members

    return bool(group_members(pgid))


def reap(parent: int, pgid: int, grace_s: float = GRACE_S) -> str:
    """Waits until the parent dies (then stops the group) or the group ends; says which."""
    while os.getppid() == parent:
        if not _group_alive(pgid):
            return "group ended"
        time.sleep(POLL_S)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return "parent died; group already gone"
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.1)
        if not _group_alive(pgid):
            return f"parent died; group stopped by {signal.Signals(sig).name}"
    return "parent died; group did not stop"


def main(argv: list[str]) -> int:
    parent, pgid = int(argv[0]), int(argv[1])
    grace = float(argv[2]) if len(argv) > 2 else GRACE_S
    reap(parent, pgid, grace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
