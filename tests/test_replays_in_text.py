"""Issue 45, item 4: replays (and their chunks) that end inside the text region are counted, per request, and
each family's gate requires a candidate's stress run to have some: a stress run whose replays all ended past
the text never tested how the decode after a replay resumes the text, and cannot pass as evidence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SMALL_PROMPTS, run_cli
from harness.contract import count_events, ends_in_text
from harness.records import SpanRecord


def test_ends_in_text_is_a_multi_position_span_whose_next_position_reads_text():
    P, L = 10, 4  # positions 10..14 read the reply's rows up to text-EOS
    assert [ends_in_text(P, c, n, L) for c, n in [(0, 12), (0, 14), (0, 15), (11, 3), (12, 2), (12, 3), (0, 10),
                                                  (13, 1), (5, 4)]] == [
        True, True, False, True, True, False, False, False, False]


def test_count_events_counts_them_only_with_the_text_length():
    spans = [SpanRecord("a", "d", 0, "r", i, 10, c, n, n) for i, (c, n) in enumerate(
        [(0, 8), (8, 2), (10, 1), (11, 1), (0, 12), (12, 1), (0, 13), (13, 2), (15, 1)])]
    assert count_events(spans).replays_ending_in_text == 0  # no text length: not counted
    counted = count_events(spans, 4)
    # (0, 12) and (0, 13); not (8, 2): it ends at P; not (13, 2): it ends at 15, past text-EOS at 14
    assert counted.replays_ending_in_text == 2
    assert counted.cross_boundary_replays == 2 and counted.multi_position_decode_spans == 1


@pytest.mark.slow
def test_a_stress_run_without_them_fails_the_candidates_stress_rule(tmp_path: Path):
    res = run_cli("run", "--asr", "none", "--quiet", "--out", str(tmp_path), "--run-id", "r", "--prompts",
                  str(SMALL_PROMPTS), "--arm", "main", "--arm", "pr", "--deploy", "reference", "--deploy", "stress")
    assert res.exit_code == 0, res.stderr[-2000:]
    requests = tmp_path / "r" / "requests.jsonl"
    rows = [json.loads(line) for line in requests.read_text().splitlines()]
    counts = {(r["arm"], r["deploy"], r["prompt_id"]): r["events"]["replays_ending_in_text"] for r in rows}
    assert {k: v for k, v in counts.items() if k[:2] == ("pr", "stress")} == {
        ("pr", "stress", "p01-weather"): 0, ("pr", "stress", "p03-sleep"): 2, ("pr", "stress", "p05-garden"): 4,
        ("pr", "stress", "p07-rainbow"): 4}
    assert all(v == 0 for k, v in counts.items() if k[1] == "reference")

    def gate_line(rule: str) -> str:
        gate = run_cli("gate", str(tmp_path / "r"))
        lines = gate.stdout.splitlines()
        at = next(i for i, ln in enumerate(lines) if ln.startswith(("PASS ", "FAIL ")) and f"{rule}: pr/stress" in ln)
        return next(ln for ln in lines[at + 1:] if "min_replays_ending_in_text" in ln).strip()

    assert gate_line("candidate-stress-matches-reference") == (
        "PASS  min_replays_ending_in_text: multi-position spans (replays, their chunks, verify spans) ending "
        "inside the text region = 10 >= 1")
    # the same run with every replay ending past the text: the stress run is no evidence
    for r in rows:
        r["events"]["replays_ending_in_text"] = 0
    requests.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert gate_line("candidate-stress-matches-reference") == (
        "FAIL  min_replays_ending_in_text: multi-position spans (replays, their chunks, verify spans) ending "
        "inside the text region = 0 < 1")


def test_the_real_backend_counts_them_from_the_text_length_its_worker_reported(tmp_path: Path):
    """On the real server the worker's contract check reports each request's text region (``text_len`` on its
    trace lines, ``harness.serve.worker_contract``, Qwen3-TTS's ``contract_keys``): the backend files it with the
    request's spans, counts the replays ending inside it, and keeps it on the record. A request whose lines carry
    none (the contract check off) keeps 0 and ``text_len`` None: the gate skips the bound (not measured)."""
    from harness.config import load_arms, load_deploy
    from harness.serve.backend import ServeCell, ServeOptions, TraceCollector
    from harness.serve.client import ChatResult

    trace = tmp_path / "trace"
    trace.mkdir()
    # P = 9, text region up to position 9 + 72: a replay ending at 40 (inside), one ending at 83 (past), decodes
    spans = [(0, 9), (9, 1), (10, 1), (0, 40), (40, 1), (0, 83)]
    lines = [{"request_id": f"speech-{rid}", "tts_text": text, "_omni_prompt_len": 9, "_omni_num_computed_tokens": c,
              "span_len": n, "rows": n, "step": i, "seq": i, "pid": 1, **extra}
             for rid, text, extra in (("a", "Text a.", {"text_len": 72, "misaligned_text": 0, "misaligned_end": 0}),
                                      ("b", "Text b.", {}))
             for i, (c, n) in enumerate(spans)]
    (trace / "trace-1.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    collector = TraceCollector(trace, {}, {"Text a.": "a", "Text b.": "b"})
    collector.poll()
    cell = ServeCell(arm=load_arms()["tts-fix"], deploy=load_deploy("qwen3-tts-cpu-stress"), repeat=1,
                     run_dir=tmp_path, options=ServeOptions(model=str(tmp_path / "model")), trace=trace,
                     log_path=tmp_path / "server.log", env={}, specs=[], collector=collector)
    records = {pid: cell.record(ChatResult(prompt_id=pid, tag=pid), cell.spans_for(pid)) for pid in ("a", "b")}
    assert {pid: (r.text_len, r.events.replays_ending_in_text, r.events.cross_boundary_replays)
            for pid, r in records.items()} == {"a": (72, 1, 2), "b": (None, 0, 2)}
