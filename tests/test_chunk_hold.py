"""Issue 45, item 6: the scheduler's hold on a streamed request waiting for its next Thinker chunk
(``WAITING_FOR_CHUNK``, ``harness.sim.chunkhold``, ``OmniRunner.held``). A Talker that outruns its Thinker
(``sim.thinker_steps_per_token`` above 1) now runs, each request held until its next chunk; a deploy whose
connector hands a chunk over one step late (``sim.chunk_ready_lag: 2``, measured on the CPU server) runs each
streamed request every other step until its final chunk, and the hold lets go once that chunk is in. The shipped
GPU-scale deploys (the Thinker ahead, lag 1) hold nothing: their records are unchanged (the golden tests).
"""

from __future__ import annotations

from collections import defaultdict

from conftest import run_cli
from test_qwen3_omni import _deploy_file  # a shipped deploy with one setting changed, under a new name


def _calls(run_dir, arm: str) -> dict[str, list[int]]:
    """Each request's call steps, in order."""
    from harness.spanstore import read_spans

    steps: dict[str, list[int]] = defaultdict(list)
    for s in read_spans(run_dir):
        if s.arm == arm:
            steps[s.request].append(s.step)
    return {rid: sorted(v) for rid, v in steps.items()}


def test_a_thinker_slower_than_the_talker_holds_each_request_until_its_chunk(tmp_path):
    """Two Talker steps per Thinker token on the CPU reference deploy (lag 1): a request reaches the Talker with
    chunk 0 at step ceil(2 * 2) = 4, and every later call merges one chunk, which comes two steps after the one
    before: the calls are two steps apart until every chunk is in (71 after chunk 0), then one (the end region).
    The fix still says each reply exactly (the speaking sim)."""
    path = _deploy_file(tmp_path, "qwen3-omni-cpu-reference",
                        **{"thinker_steps_per_token: 0.5": "thinker_steps_per_token: 2"})
    res = run_cli("run", "--family", "qwen3-omni", "--sim-talker", "speaking", "--deploy", str(path), "--arm",
                  "omni3-fix", "--prompts", "qwen3_omni_cpu", "--asr", "none", "--quiet", "--no-cache", "--out",
                  str(tmp_path), "--run-id", "slow")
    assert res.exit_code == 0, res.stderr[-2000:]
    from harness.records import read_requests

    recs = read_requests(tmp_path / "slow")
    assert len(recs) == 4 and all(r.oracle_wer == 0.0 and r.events.misaligned_positions == 0 for r in recs)
    for rid, steps in _calls(tmp_path / "slow", "omni3-fix").items():
        assert steps[0] == 4 and [b - a for a, b in zip(steps, steps[1:])] == [2] * 71 + [1] * 3, rid


def test_a_chunk_handed_over_a_step_late_runs_each_stream_every_other_step(tmp_path):
    """``chunk_ready_lag: 2``, the CPU reference deploy's (the Thinker ahead, four requests admitted together):
    each request's calls are exactly two steps apart until its final chunk is in, then one; the four stay in
    phase, so they share every step; what each says is unchanged (the speaking sim's fix: its reply)."""
    res = run_cli("run", "--family", "qwen3-omni", "--sim-talker", "speaking", "--deploy", "qwen3-omni-cpu-reference",
                  "--arm", "omni3-fix", "--prompts", "qwen3_omni_cpu", "--asr", "none", "--quiet", "--no-cache",
                  "--out", str(tmp_path), "--run-id", "lag")
    assert res.exit_code == 0, res.stderr[-2000:]
    from harness.records import read_requests

    recs = read_requests(tmp_path / "lag")
    assert len(recs) == 4 and all(r.oracle_wer == 0.0 and r.events.misaligned_positions == 0 for r in recs)
    calls = _calls(tmp_path / "lag", "omni3-fix")
    assert len({tuple(v) for v in calls.values()}) == 1  # in phase: the same steps
    gaps = [b - a for a, b in zip(next(iter(calls.values())), next(iter(calls.values()))[1:])]
    # 75 calls: the prefill (chunk 0), then one chunk merged per call, two steps apart, until the final chunk
    # (71, its finish sentinel) is the next to merge and in: from there one step apart (the last byte, the end region)
    assert gaps == [2] * 70 + [1] * 4


def test_hold_and_restore_move_held_requests_as_the_coordinator_does():
    """Held running requests leave ``running`` for the schedule and come back at its end; held waiting ones leave
    ``waiting`` and come back appended (``restore_queues``)."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.request_queue import FCFSRequestQueue
    from vllm.v1.request import RequestStatus

    from harness.sim import chunkhold

    reqs = {name: SimpleNamespace(request_id=name) for name in "abcdef"}
    waiting = FCFSRequestQueue()
    for name in "def":
        waiting.add_request(reqs[name])
    scheduler = SimpleNamespace(running=[reqs["a"], reqs["b"], reqs["c"]], waiting=waiting, max_num_running_reqs=4)
    runner = SimpleNamespace(held=lambda rid, step, lag: rid in ("b", "d") and (step, lag) == (7, 2))
    running, held_waiting = chunkhold.hold(scheduler, runner, 7, 2)
    assert [r.request_id for r in scheduler.running] == ["a", "c"]
    assert [r.request_id for r in scheduler.waiting] == ["e", "f"]
    chunkhold.restore(scheduler, running, held_waiting)
    assert [r.request_id for r in scheduler.running] == ["a", "c", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["e", "f", "d"]
    assert chunkhold.hold(scheduler, SimpleNamespace(), 7, 2) == ([], [])  # a runner without held holds nothing
    # admitted while others were held, running comes back over max_num_seqs: the last go back to the front of waiting
    scheduler.running += [reqs["e"], reqs["f"]]
    for name in "ef":
        scheduler.waiting.remove_request(reqs[name])
    chunkhold.hold(scheduler, SimpleNamespace(held=lambda rid, step, lag: False), 8, 2)
    assert [r.request_id for r in scheduler.running] == ["a", "c", "b", "e"]
    assert [r.request_id for r in scheduler.waiting] == ["f", "d"] and reqs["f"].status == RequestStatus.WAITING
