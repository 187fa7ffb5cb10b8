"""Sim cells in forked worker processes: the same records and spans as one process, and a worker
that dies is one clear error, with the cells already recorded kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.sim.pool import default_workers
from harness.spanstore import export_lines
from tests.conftest import run_cli

SMALL = "tests/fixtures/prompts_small.yaml"


@pytest.mark.parametrize(("cells", "cpus", "expected"), [(4, 2, 2), (1, 2, 1), (4, 1, 1), (4, 16, 2), (0, 2, 1)])
def test_default_workers(cells: int, cpus: int, expected: int) -> None:
    assert default_workers(cells, cpus) == expected


def _lines(path: Path, drop: tuple[str, ...] = ()) -> list[str]:
    return [json.dumps({k: v for k, v in json.loads(line).items() if k not in drop}, sort_keys=True)
            for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_forked_cells_record_exactly_what_one_process_records(tmp_path: Path) -> None:
    for workers in ("2", "0"):  # 0: in the run's own process (1 is one forked worker)
        res = run_cli("run", "--asr", "none", "--prompts", SMALL, "--out", str(tmp_path), "--run-id", f"w{workers}",
                      "--sim-workers", workers, "-q")
        assert res.exit_code == 0, res.stderr
    assert "".join(export_lines(tmp_path / "w2")) == "".join(export_lines(tmp_path / "w0"))
    assert _lines(tmp_path / "w2" / "requests.jsonl", ("wall_s",)) == \
        _lines(tmp_path / "w0" / "requests.jsonl", ("wall_s",))
    assert len(_lines(tmp_path / "w2" / "requests.jsonl")) == 16


@pytest.mark.slow
def test_a_sim_worker_that_dies_is_one_error_and_the_run_dir_stays_valid(tmp_path: Path) -> None:
    res = run_cli("run", "--asr", "none", "--prompts", SMALL, "--out", str(tmp_path), "--run-id", "r",
                  "--arm", "pr", "--arm", "dies=tests.fixtures.plugins:killed_talker", "--deploy", "reference",
                  "--sim-workers", "2", "-q")
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        "omni-stress: error: a sim worker process died (killed, out of memory, or a crash in an arm's native code) "
        "while cell pr x reference (run 1) was in flight; the records written so far are kept: rerun with --resume, "
        "with --sim-workers 1 to see the cell that dies"]
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert [c["arm"] for c in manifest["cells"]] == ["pr", "dies"] and manifest["finished"] is None
    for line in (tmp_path / "r" / "requests.jsonl").read_text().splitlines():
        assert json.loads(line)["arm"] == "pr"  # whatever finished before the break is whole


def test_waiting_for_a_cell_keeps_writing_finished_records() -> None:
    """While a cell simulates in a worker, the run keeps calling ``idle`` (which writes the records
    whose transcripts are in), and returns the cell's result once it is there."""
    import threading
    from concurrent.futures import Future

    from harness.sim.pool import IDLE_S, SimPool

    fut: Future = Future()
    calls: list[int] = []
    timer = threading.Timer(4.5 * IDLE_S, fut.set_result, args=(("stats", ["r1"]),))
    timer.start()
    try:
        assert SimPool.result(fut, "pr x stress (run 1)", lambda: calls.append(1)) == ("stats", ["r1"])
    finally:
        timer.cancel()
    assert len(calls) >= 2  # called again and again while the cell runs (about 5 times here)
