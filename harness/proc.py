"""What every worker process of a run needs: to go away when the run does."""

from __future__ import annotations

import os
import threading
import time

WATCHDOG_S = 0.5  # how often a worker checks that the run that started it is alive


def exit_with_parent(parent_pid: int) -> None:
    """A SIGKILLed run must not leave its workers behind: a ``ProcessPoolExecutor`` worker blocks
    on a queue whose writer ends it holds itself, so it would wait forever. A daemon thread polls
    the parent and ends the worker once the parent is gone."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_S)
        os._exit(0)

    threading.Thread(target=watch, name="omni-stress-parent-watch", daemon=True).start()
