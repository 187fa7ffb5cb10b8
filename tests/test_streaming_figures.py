"""The streaming figures users compare (harness/streaming_figures.py), the SLO's parsing, the gate's streaming
metrics and streaming.json: hand-built records with exact binary-fraction times, exact results."""

from __future__ import annotations

import pytest

from harness.config import ConfigError, StreamingSlo, parse_slo, slo_option
from harness.gate.evaluate import evaluate
from harness.gate.rules import parse_rules
from harness.records import EventCounts, RequestRecord
from harness.report.summary import CellSummary
from harness.report.tables import streaming_json, streaming_table
from harness.streaming_figures import bench_fields, figures, metric, spread, violations_beyond_replays


def _rec(pid: str, ttfp: float | None = 0.5, gaps: tuple[float, ...] = (0.25, 0.25), stalls: tuple[float, ...] = (),
         frames: tuple[int, ...] = (1920, 48000, 48000), error: str | None = None, failed: str | None = None,
         violations: int | None = 0, preemptions: int = 0, sent: float = 100.0, end: float = 4.0) -> RequestRecord:
    r = RequestRecord(arm="a", deploy="d", repeat=1, prompt_id=pid, backend="vllm-omni", reference_text="x",
                      error=error, preemptions=preemptions, rtf=end / (sum(frames) / 24000))
    if error is None:
        r.stream_ttfa_s, r.stream_end_s, r.stream_chunks = ttfp, end, len(frames)
        r.stream_chunk_frames, r.stream_sample_rate, r.stream_gaps_s = list(frames), 24000, list(gaps)
        r.stream_underruns = [[1.0, s] for s in stalls]
        r.stream_underrun_s = sum(stalls)
        r.stream_sent_at, r.stream_failed = sent, failed
        r.chunk_violations, r.chunk_windows = violations, len(frames)
    return r


def test_percentiles_interpolate_as_numpy_does():
    sp = spread([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (sp.p50, sp.p90, sp.p99, sp.worst, sp.mean) == (3.0, 4.6, pytest.approx(4.96), 5.0, 3.0)
    assert spread([]) is None and spread([0.25]).p99 == 0.25


def test_a_cells_figures_count_failed_requests_against_every_rate():
    recs = [_rec("p1"), _rec("p2", ttfp=1.5, stalls=(0.0625, 0.125)), _rec("p3", failed="truncated audio: ..."),
            _rec("p4", error="HTTP 500")]
    f = figures(recs, StreamingSlo(ttfp_s=1.0, max_stall_s=0.1))
    assert (f.requests, f.streamed, f.failed) == (4, 3, 2)  # p3 streamed (truncated), p4 did not answer
    assert (f.ttfp.p50, f.ttfp.worst) == (0.5, 1.5) and f.gaps.worst == 0.25
    assert (f.worst_stall_s, f.stall.worst) == (0.125, 0.1875)
    # continuity over all 4 requests: p1 has no stall, p2 a 125 ms one, p3 failed, p4 errored
    assert f.continuity == {0.05: 0.25, 0.1: 0.25, 0.2: 0.5}
    assert f.goodput == 0.25  # only p1: p2's TTFP is over 1 s, p3 and p4 failed
    assert f.audio_s == 3 * 97920 / 24000 == 12.24 and f.window_s == 4.0 and f.throughput == 12.24 / 4.0
    assert f.chunk_violations == 0 and f.chunk_windows.p50 == 3
    assert figures([_rec("p1", error="x")]) is None  # nothing streamed: nothing to measure
    assert figures([_rec("p1", violations=None)]).chunk_violations is None  # windows not traced


def test_bench_fields_use_upstreams_names():
    out = bench_fields(figures([_rec("p1", ttfp=0.25), _rec("p2", ttfp=0.75)]))
    assert (out["completed"], out["failed"]) == (2, 0)
    assert (out["mean_audio_ttfp_ms"], out["median_audio_ttfp_ms"], out["max_audio_ttfp_ms"]) == (500.0, 500.0, 750.0)
    assert out["p99_audio_ttfp_ms"] == 745.0 and out["audio_continuity_ok_rate"] == 1.0
    assert out["request_goodput_rate"] == 1.0 and out["slo_text"] == "no stall over 100 ms"
    assert out["continuity_200ms_rate"] == 1.0 and out["chunk_violations"] == 0


def test_violations_beyond_replays_allow_one_window_per_preempted_request():
    recs = [_rec("p1", violations=1, preemptions=1), _rec("p2", violations=2, preemptions=2), _rec("p3", violations=1)]
    assert violations_beyond_replays(recs) == 2  # p2: one beyond its one window; p3: never preempted
    assert violations_beyond_replays([_rec("p1", violations=None)]) is None
    assert metric(recs, "chunk_violations") == 4.0 and metric(recs, "chunk_violations_beyond_replays") == 2.0


def test_the_slo_is_parsed_from_a_deploy_and_the_command_line():
    assert parse_slo({"ttfp_s": 2, "max_stall_s": None}, "d.yaml: slo") == StreamingSlo(2.0, None)
    assert slo_option("ttfp_s=1.5") == StreamingSlo(1.5, None)
    assert slo_option("ttfp_s=1.5,max_stall_s=none") == StreamingSlo(1.5, None)
    assert StreamingSlo(1.5, 0.05).describe() == "TTFP <= 1.5 s and no stall over 50 ms"
    with pytest.raises(ConfigError, match=r"^d.yaml: slo.ttfp_s: must be seconds in \[0, 3600\] or null, got -1$"):
        parse_slo({"ttfp_s": -1}, "d.yaml: slo")
    with pytest.raises(ConfigError, match=r"^d.yaml: slo.ttfa: unknown key \(allowed: ttfp_s, max_stall_s\)$"):
        parse_slo({"ttfa": 1}, "d.yaml: slo")
    with pytest.raises(ConfigError, match=r"^--slo 'fast': expected KEY=SECONDS pairs"):
        slo_option("fast")


def _cell(deploy: str, recs: list[RequestRecord], role: str = "candidate", slo: StreamingSlo | None = None,
          deploy_role: str = "", pair: str | None = None) -> CellSummary:
    return CellSummary(arm="a", deploy=deploy, repeat=1, requests=len(recs), scores=[0.0] * len(recs),
                       oracle_scores=[], events=EventCounts(), event_source="spans", misaligned_known=True,
                       preemptions=sum(r.preemptions for r in recs), errors=sum(r.error is not None for r in recs),
                       wall_s=1.0, wer_source="oracle", run_number=1, role=role, records=recs,
                       deploy_role=deploy_role or ("stress" if "stress" in deploy else "reference"), pair=pair,
                       slo=slo)


def test_the_gate_bounds_streaming_metrics_and_skips_cells_that_did_not_stream():
    rules = parse_rules({"rules": [
        {"name": "whole", "role": "candidate", "deploy": "*", "max_failed_streams": 0, "max_chunk_violations": 0},
        {"name": "ttfp", "role": "candidate", "deploy": "*stress", "max_ttfp_p99_ratio": 2.0},
        {"name": "goodput", "role": "candidate", "deploy": "*", "min_goodput": 1.0, "min_continuity_rate": 1.0},
    ]})
    ref = _cell("x-reference", [_rec("p1", ttfp=0.5), _rec("p2", ttfp=0.5)])
    stress = _cell("x-stress", [_rec("p1", ttfp=1.25), _rec("p2", ttfp=0.5, violations=1, failed="truncated")],
                   pair="x-reference", slo=StreamingSlo(ttfp_s=1.0, max_stall_s=None))
    result = evaluate(rules, [ref, stress])
    messages = {(c.rule.name, c.cell.deploy): c.message for c in result.cases}
    assert messages[("whole", "x-stress")] == (
        "max_failed_streams: streamed requests that failed (errors, audio shorter than its codec stream) = 1 > 0; "
        "max_chunk_violations: Code2Wav windows that broke the chunk contract = 1 > 0")
    assert messages[("ttfp", "x-stress")] == ("max_ttfp_p99_ratio: TTFP p99 over the reference deploy's = 2.485 > "
                                              "2.000 (p99 1.242 s vs 0.500 s in a/x-reference run 1)")
    assert messages[("goodput", "x-stress")] == (
        "min_goodput: share of requests meeting the streaming SLO = 0% < 100%; "
        "min_continuity_rate: share of requests with no stall over 100 ms = 50% < 100%")
    assert result.exit_code == 1
    plain = _cell("x-reference", [RequestRecord(arm="a", deploy="x-reference", repeat=1, prompt_id="p1",
                                                 backend="sim", reference_text="x")])
    skipped = evaluate(parse_rules({"rules": [{"name": "whole", "role": "candidate", "deploy": "*",
                                                "max_failed_streams": 0}]}), [plain])
    assert [c.status for c in skipped.cases] == ["skip"] and skipped.exit_code == 0
    assert "nothing streamed in this cell or its connector's windows were not traced or modelled (skipped)" in \
        skipped.cases[0].message


def test_the_streaming_table_and_json_show_each_cell():
    cell = _cell("x-stress", [_rec("p1", ttfp=0.5), _rec("p2", ttfp=1.0, stalls=(0.25,))], pair="x-reference")
    table = streaming_table([cell])
    assert table.iloc[0].tolist() == ["a", "x-stress", "1", "2/2", "0", "0.750 / 0.950 / 0.995 / 1.000",
                                      "0.250 / 0.250 / 0.250", "0.250 / 0.250", "50% / 50% / 50%", "50%",
                                      "0.98 / 0.98", "2.04", "3 / 0"]
    data = streaming_json([cell])["cells"][0]
    assert (data["arm"], data["slo"], data["failed"]) == ("a", {"ttfp_s": None, "max_stall_s": 0.1}, 0)
    assert [q["meets_slo"] for q in data["requests"]] == [True, False]
    assert streaming_json([_cell("y", [RequestRecord(arm="a", deploy="y", repeat=1, prompt_id="p", backend="sim",
                                                      reference_text="x")])]) is None


def test_the_sims_modelled_windows_are_their_own_table_in_steps():
    def sim(pid: str, steps: list[int], sent: int | None = None) -> RequestRecord:
        r = RequestRecord(arm="a", deploy="d", repeat=1, prompt_id=pid, backend="sim", reference_text="x",
                          sent_step=sent)
        r.chunk_windows, r.chunk_frames_sent, r.chunk_window_steps = 4, [1, 25, 25, 23], steps
        r.chunk_violations = 0
        return r

    from harness.report.tables import modelled_table
    from harness.streaming_figures import modelled_fields, modelled_figures

    cell = _cell("d-stress", [sim("p1", [1, 26, 51, 74]), sim("p2", [5, 111, 136, 159], sent=1)])
    f = modelled_figures(cell.records)
    assert (f.ttfp_steps.p50, f.ttfp_steps.worst, f.gap_steps.worst, f.chunk_violations) == (2.5, 4.0, 106.0, 0)
    assert modelled_table([cell]).iloc[0].tolist() == ["a", "d-stress", "1", "2/2", "2.5 / 3.7 / 3.97 / 4",
                                                       "25 / 101.95 / 106", "4 / 0"]
    assert modelled_fields(f)["max_gap_steps"] == 106.0 and modelled_fields(f)["modelled"] is True
    assert streaming_json([cell])["cells"][0]["requests"][1]["chunk_window_steps"] == [5, 111, 136, 159]
    assert figures(cell.records) is None  # nothing measured: the streamed table stays empty
