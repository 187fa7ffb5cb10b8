"""Fish Speech and Gepard (issue 22, item 6) and the report for upstream (item 7): exact expectations."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from harness.conform.check import check_model
from harness.conform.compare import Cell, restart_cell
from harness.conform.driver import Feed
from harness.conform.models import MODELS, UPSTREAM_MODELS
from harness.talkers.release import VENDORED
from harness.conform.upstream_report import ANCHORS, ISSUES, find_line, findings, model_base, schedule_text

torch.set_num_threads(1)
FISH_REACH = ("fish_qwen3_omni.yaml (cuda, npu, xpu), fish_qwen3_omni_2gpu.yaml (cuda), "
              "fish_qwen3_omni_high_concurrency_dual_gpu.yaml (cuda), fish_qwen3_omni_high_concurrency_single_gpu.yaml "
              "(cuda)")


def test_the_default_models_are_eight_distinct_upstream_models() -> None:
    assert UPSTREAM_MODELS == ("qwen2.5-omni", "qwen3-omni", "qwen3-tts", "minicpmo-4.5", "glm-tts", "moss-tts",
                               "fish-speech", "gepard")


# ---------------------------------------------------------------- pure logic: the report for upstream
def test_find_line_is_the_first_occurrence_one_based() -> None:
    text = "a\n  if span_len > 1:\n    x\n  if span_len > 1:\n"
    assert find_line(text, "if span_len > 1:") == 2
    assert find_line(text, "absent") is None


def test_schedule_text_lists_the_earlier_spans_preemptions_and_the_span() -> None:
    assert schedule_text(None) == ""
    assert schedule_text({"P": 70, "c": 74, "n": 3, "replay": 0, "history": [[0, 70, 0]]}) == "P=70: [0,70) -> [74,77)"
    assert schedule_text({"P": 70, "c": 68, "n": 9, "replay": 1, "history": [[0, 70, 0], [0, 68, 1]]}) == (
        "P=70: [0,70) -> preempt -> [0,68) -> [68,77)")
    assert schedule_text({"P": 70, "c": 0, "n": 77, "replay": 1, "history": [[0, 70, 0]]}) == (
        "P=70: [0,70) -> preempt -> [0,77)")


def test_findings_take_the_line_from_the_release_and_the_issue_from_the_table() -> None:
    trig = {"P": 10, "c": 8, "n": 5, "replay": 1, "history": [[0, 10, 0], [0, 8, 1]]}
    result = SimpleNamespace(model="gepard", reach=None, cells={
        "chunk": Cell("conforms", "conforms"),
        "restart": Cell("differs", "restarts @12", trigger=trig),
        "tail": Cell("differs", "differs @9", trigger={"P": 10, "c": 9, "n": 1, "replay": 0}),
    })
    text = "x\ny\n            state.frame_count = 0\n"
    got = findings(result, lambda member: text)
    assert [(f["column"], f["file"], f["line"], f["issue"], f["schedule"]) for f in got] == [
        ("restart", "vllm_omni/model_executor/models/gepard/gepard_talker.py", 3, 6179,
         "P=10: [0,10) -> preempt -> [0,8) -> [8,13)"),
        ("tail", None, None, None, "P=10: [9,10)")]
    assert got[1]["why"] == "not mapped"
    assert findings(result, lambda member: None)[0]["why"].endswith("(anchor not found in this release)")


def test_issue_table_cites_only_5018_and_6179() -> None:
    assert {n for n, _ in ISSUES.values()} == {5018, 6179}
    assert ISSUES[("gepard", "restart")][0] == 6179 and ISSUES[("fish-speech", "tail")][0] == 5018
    assert ("glm-tts", "tail") not in ISSUES and ("qwen3-tts", "cross_replay") not in ISSUES
    assert all(model in UPSTREAM_MODELS for model, _ in ANCHORS)
    assert model_base("qwen3-tts@mrv2") == "qwen3-tts"


@pytest.mark.parametrize("release", VENDORED)
def test_every_anchor_is_found_in_both_releases(release: str) -> None:
    from harness.conform.adapter import read_model_source

    for (model, column), (member, snippet, _why) in ANCHORS.items():
        text = read_model_source(release, member).text
        assert find_line(text, snippet) is not None, (release, model, column)


def test_restart_cell_reads_the_models_own_frame_counter() -> None:
    """A replay after which the model counts fewer frames than the schedule generated: restarted from frame 0."""
    rows = torch.zeros(3, 4)
    feed = Feed("cross-replay", "r", 5, 10, 8, 3, 1, 3, rows, torch.tensor([1, 2, 3]), counter=1)
    cell = restart_cell([("cross-replay", [feed])], {"r": torch.zeros(20, 4)}, lambda ids: torch.zeros(len(ids), 4))
    assert (cell.status, cell.summary) == ("differs", "restarts @10")
    assert "counts 1 generated frame(s) where the schedule has generated 2" in cell.detail
    feed.counter = 2
    cell = restart_cell([("cross-replay", [feed])], {"r": torch.zeros(20, 4)}, lambda ids: torch.zeros(len(ids), 4))
    assert (cell.status, cell.summary) == ("conforms", "no restart")


# ---------------------------------------------------------------- the two models, from each release
@pytest.mark.parametrize("release", VENDORED)
def test_fish_speech_routes_on_span_length_and_pads_a_replay(release: str) -> None:
    r = check_model(MODELS["fish-speech"](), release, (), requests=1, forced_generated=24)
    assert r.error is None
    assert {k: c.summary for k, c in r.cells.items()} == {
        "chunk": "conforms", "tail": "differs @109", "multi_decode": "differs @114", "cross_replay": "differs @110",
        "repeated_replay": "differs @110", "row_count": "conforms", "restart": "no restart"}
    t, m, x = r.cells["tail"].first, r.cells["multi_decode"].first, r.cells["cross_replay"].first
    assert (t.P, t.c, t.n, t.got) == (110, 109, 1, "the bare embedding of its own id")
    assert (m.c, m.n, m.got) == (114, 3, "the reference row of position 0")
    assert (x.c, x.n, x.got) == (108, 9, "the audio-pad embedding (<|audio_pad|>, the hook's padding)")
    assert r.verdict == f"fails under shipped deploy {FISH_REACH}"
    assert r.restart_verdict == "no restart after a preemption"
    assert [(f["column"], f["line"], f["issue"]) for f in r.upstream] == [
        ("tail", 385, 5018), ("multi_decode", 408, 5018), ("cross_replay", 410, 5018), ("repeated_replay", 410, 5018)]
    assert r.reach.cells["tail"].text == "only with chunked prefill"


@pytest.mark.parametrize("release", VENDORED)
def test_gepard_restarts_from_frame_0_after_a_recompute(release: str) -> None:
    r = check_model(MODELS["gepard"](), release, (), requests=1, forced_generated=24)
    assert r.error is None
    assert {k: c.summary for k, c in r.cells.items()} == {
        "chunk": "conforms", "tail": "conforms", "multi_decode": "differs @75", "cross_replay": "differs @70",
        "repeated_replay": "differs @70", "row_count": "2/185 calls", "restart": "restarts @76"}
    assert r.cells["cross_replay"].first.got == "the bare embedding of its own id"
    assert "counts 1 generated frame(s) where the schedule has generated 8" in r.cells["restart"].detail
    assert r.verdict == "fails under shipped deploy gepard.yaml (cuda)"
    assert r.restart_verdict == ("restarts after a preemption: generated position 76 is counted as frame 0 again "
                                 "(the model's own frame count restarted) (the upstream #6179 class); reached by "
                                 "shipped deploy gepard.yaml (cuda)")
    assert [(f["column"], f["line"], f["issue"]) for f in r.upstream] == [
        ("multi_decode", 403, None), ("cross_replay", 393, None), ("repeated_replay", 393, None),
        ("row_count", 403, None), ("restart", 383, 6179)]


def test_cli_writes_the_upstream_report_to_json_and_html(tmp_path: Path) -> None:
    from harness.cli import main as cli_main

    js, page = tmp_path / "m.json", tmp_path / "m.html"
    out = CliRunner().invoke(cli_main, ["conform", "--model", "gepard", "--model", "fish-speech", "--deploy", "none",
                                        "--requests", "1", "--generated", "24", "--source", "vllm-omni:0.32.0rc1",
                                        "--json", str(js), "--html", str(page)], catch_exceptions=False)
    assert out.exit_code == 1, out.output
    data = json.loads(js.read_text())
    gepard = next(m for m in data["models"] if m["model"] == "gepard")
    restart = next(f for f in gepard["upstream"] if f["column"] == "restart")
    assert restart == {
        "column": "restart", "cell": "restarts @76", "schedule": "P=70: [0,70) -> preempt -> [0,68) -> [68,77)",
        "file": "vllm_omni/model_executor/models/gepard/gepard_talker.py", "line": 383,
        "why": "a prefill after frames were committed (a recompute) clears the frames and restarts from frame 0, as "
               "its own comment says",
        "reach": "reached by shipped deploy gepard.yaml (cuda)", "issue": 6179,
        "issue_why": "#6179 names Gepard: a recompute preemption restarts generation from frame 0"}
    html = page.read_text()
    assert "<h2>For upstream</h2>" in html
    assert "vllm_omni/model_executor/models/gepard/gepard_talker.py:383" in html
    assert "vllm_omni/model_executor/models/fish_speech/fish_speech_slow_ar.py:385" in html
