"""The scheduler's hold on streamed requests waiting for their next Thinker chunk (``WAITING_FOR_CHUNK``).

vLLM-Omni's scheduling coordinator (``core/sched/omni_scheduling_coordinator.py``, ``process_pending_chunks`` and
``restore_queues``), run before each schedule of a stage fed by ``async_chunk``: a request that may not run now
(no chunk arrived since its last call, and its final chunk not received) leaves the running or waiting queue for
this schedule and comes back after it: a held running request at the end of ``running`` (its place in the order
is lost), a held waiting one at the end of ``waiting``. While running requests are held the scheduler may admit
waiting ones in their place, so ``running`` can come back over ``max_num_seqs``; the next hold then moves the last
running ones back to the front of ``waiting`` (status WAITING, their KV kept, as the coordinator does: not a
preemption). Which requests may not run is the family runner's
``held(request_id, step, lag)`` (``harness.families.qwen3_omni.sim.OmniRunner``); a runner without it holds none.
"""

from __future__ import annotations

from typing import Any


def hold(scheduler: Any, runner: Any, step: int, lag: int) -> tuple[list[Any], list[Any]]:
    """Take the requests ``runner`` holds at ``step`` out of the scheduler's queues: (running, waiting) held."""
    held = getattr(runner, "held", None)
    if held is None:
        return [], []
    waiting = [r for r in scheduler.waiting if held(r.request_id, step, lag)]
    for r in waiting:
        scheduler.waiting.remove_request(r)
    running = [r for r in scheduler.running if held(r.request_id, step, lag)]
    for r in running:
        scheduler.running.remove(r)
    while len(scheduler.running) > scheduler.max_num_running_reqs:
        from vllm.v1.request import RequestStatus

        request = scheduler.running.pop()
        request.status = RequestStatus.WAITING
        scheduler.waiting.prepend_requests([request])
    return running, waiting


def restore(scheduler: Any, running: list[Any], waiting: list[Any]) -> None:
    """Back after the schedule, as ``restore_queues`` puts them: waiting ones appended, running ones at the end."""
    for r in waiting:
        scheduler.waiting.add_request(r)
    scheduler.running.extend(running)
