"""Issue 42 item 5: the sim models Code2Wav's windows for Qwen3-TTS (``harness.sim.windows``), and
``omni-stress fidelity`` compares them with the real server's, request by request.

A streaming deploy (``async_chunk: true``) of a family whose connector sends windows (Qwen3-TTS's serve
module names a ``CHUNKER``) gets each request's windows modelled from its codec stream and the step each
frame was first produced: window 0 frame 0 alone, then 25 frames a window, the remainder last, each sent at
the step of its last new frame. Hand-built requests pin the arithmetic (a replay included); one sim cell
pins it through vLLM's scheduler; the full-payload twin and the other families write no window field.
"""

from __future__ import annotations

import json

import pytest

from harness.chunk_contract import SHIPPED, ChunkRule, Window
from harness.config import load_arms, load_deploy, load_prompts
from harness.family import get_family
from harness.records import CHUNK_FIELDS, RequestRecord, to_json
from harness.report import fidelity
from harness.sim.windows import connector_rule, frame_steps, model_windows, record_windows

CODES = [100 + g for g in range(53)]  # frame g's code: 100 + g


def _record(codes: list[int], **fields) -> RequestRecord:
    return RequestRecord(arm="tts-fix", deploy="qwen3-tts-cpu-stress", repeat=1, prompt_id="t01-tea", backend="sim",
                         reference_text="tea", codec_tokens=list(codes), num_codec_tokens=len(codes), **fields)


# --------------------------------------------------------------------------- the model, by hand


def test_a_request_sends_frame_0_alone_then_25_a_window_each_at_its_last_frames_step():
    # the first codec token at step 10, then one a step: frame g at step 10 + g
    progress = [(10 + g, g + 1) for g in range(53)]
    assert frame_steps(progress) == [10 + g for g in range(53)]
    m = model_windows(CODES, frame_steps(progress), SHIPPED)
    assert m.windows == (Window((100,)), Window(tuple(range(101, 126))), Window(tuple(range(126, 151))),
                         Window((151, 152), finished=True))
    assert m.steps == (10, 35, 60, 62)
    rec = _record(CODES)
    record_windows(rec, progress, SHIPPED)
    assert (rec.chunk_windows, rec.chunk_frames_sent, rec.chunk_window_steps, rec.chunk_violations,
            rec.chunk_violation) == (4, [1, 25, 25, 2], [10, 35, 60, 62], 0, None)


def test_a_stream_that_ends_on_a_boundary_gets_an_empty_finished_window_not_listed_in_the_steps():
    m = model_windows(CODES[:26], list(range(26)), SHIPPED)
    assert m.windows == (Window((100,)), Window(tuple(range(101, 126))), Window((), finished=True))
    assert m.steps == (0, 25)
    rec = _record(CODES[:26])
    record_windows(rec, [(g, g + 1) for g in range(26)], SHIPPED)
    assert (rec.chunk_windows, rec.chunk_frames_sent, rec.chunk_window_steps, rec.chunk_violations) == (
        2, [1, 25], [0, 25], 0)
    empty = _record([])  # a Talker that said codec EOS at once: one empty finished window, nothing listed
    record_windows(empty, [(7, 0)], SHIPPED)
    assert (empty.chunk_windows, empty.chunk_frames_sent, empty.chunk_window_steps, empty.chunk_violations) == (
        0, [], [], 0)


def test_a_replayed_request_counts_each_frame_at_its_first_production_only():
    """Frames 0-29 at steps 5-34, then a preemption by recompute: the replay's steps recompute positions (the
    count holds at 30, or falls back to 12 and grows to 30 again) and produce no frame; frames 30-51 follow
    at steps 50-71."""
    progress = [(5 + g, g + 1) for g in range(30)] + [(40, 30), (41, 12), (42, 30)]
    progress += [(50 + k, 31 + k) for k in range(22)]
    steps = frame_steps(progress)
    assert steps == [5 + g for g in range(30)] + [50 + k for k in range(22)]
    rec = _record(CODES[:52], preemptions=1)
    record_windows(rec, progress, SHIPPED)
    # window 1 (frames 1-25) left at frame 25's step 30; window 2 (frames 26-50) at frame 50's: 50 + 20
    assert (rec.chunk_windows, rec.chunk_frames_sent, rec.chunk_window_steps, rec.chunk_violations,
            rec.chunk_violation) == (4, [1, 25, 25, 1], [5, 30, 70, 71], 0, None)


def test_a_rule_with_left_context_resends_it_and_the_check_finds_nothing():
    rule = ChunkRule(chunk_frames=4, initial_frames=2, left_context=3)
    m = model_windows(CODES[:9], list(range(9)), rule)
    assert m.windows == (Window((100, 101)), Window((100, 101, 102, 103, 104, 105), 2),
                         Window((103, 104, 105, 106, 107, 108), 3, finished=True))
    assert m.steps == (1, 5, 8)
    rec = _record(CODES[:9])
    record_windows(rec, [(g, g + 1) for g in range(9)], rule)
    assert (rec.chunk_frames_sent, rec.chunk_violations) == ([2, 4, 3], 0)


def test_more_frames_than_steps_is_refused():
    with pytest.raises(ValueError, match="3 frames but the steps of only 2"):
        model_windows([1, 2, 3], [0, 1], SHIPPED)


# --------------------------------------------------------------------------- which deploys get windows


def test_only_a_streaming_deploy_of_a_family_with_a_connector_chunker_is_modelled():
    assert connector_rule(get_family("qwen3-tts"), load_deploy("qwen3-tts-cpu-stress")) == SHIPPED
    assert connector_rule(get_family("qwen3-tts"), load_deploy("qwen3-tts-cpu-reference")) == SHIPPED
    assert connector_rule(get_family("qwen3-tts"), load_deploy("qwen3-tts-stress")) == SHIPPED
    for name in ("qwen3-tts-cpu-full-stress", "qwen3-tts-full-stress", "qwen3-tts-full-reference"):  # async: false
        assert connector_rule(get_family("qwen3-tts"), load_deploy(name)) is None, name
    # Qwen3-Omni's connector (issue 44): 4 frames, then 25, each after the first resending up to 25 frames of
    # left context; its full payload sends none. Qwen2.5-Omni does not stream
    omni = ChunkRule(chunk_frames=25, initial_frames=4, left_context=25)
    assert connector_rule(get_family("qwen3-omni"), load_deploy("qwen3-omni-stress")) == omni
    assert connector_rule(get_family("qwen3-omni"), load_deploy("qwen3-omni-cpu-reference")) == omni
    assert connector_rule(get_family("qwen3-omni"), load_deploy("qwen3-omni-full-stress")) is None
    assert connector_rule(get_family("qwen2.5-omni"), load_deploy("cpu-stress")) is None


# --------------------------------------------------------------------------- through the sim's step loop


def _cell(deploy: str) -> tuple[dict[str, RequestRecord], list]:
    from harness.sim.steploop import run_cell

    got = []
    stats = run_cell(load_arms()["tts-fix"], load_deploy(deploy), load_prompts("qwen3_tts_cpu_smoke"), 1, 42,
                     got.append, talker_mode="speaking", latency=True)
    return {g.record.prompt_id: g.record for g in got}, stats.spans


@pytest.fixture(scope="module")
def stress_cells() -> tuple[dict[str, RequestRecord], list, dict[str, RequestRecord]]:
    streamed, spans = _cell("qwen3-tts-cpu-stress")
    full, _ = _cell("qwen3-tts-cpu-full-stress")
    return streamed, spans, full


def test_the_stress_cells_windows_follow_the_scheduler_steps_replays_included(stress_cells):
    """The fix under ``qwen3-tts-cpu-stress`` says 74 codes per text; three requests are preempted and
    replayed. Window 0 leaves at the first codec token's step; every window at the step whose span sampled
    its last frame (the span ending at position ``P + g`` samples frame ``g``), never at a replay's
    recomputing span; the last a step before the request finishes (codec EOS, no frame)."""
    recs, spans, _ = stress_cells
    assert {p: (r.preemptions, r.chunk_windows, r.chunk_frames_sent, r.chunk_window_steps, r.chunk_violations,
                r.chunk_violation) for p, r in recs.items()} == {
        "t01-tea": (0, 4, [1, 25, 25, 23], [1, 26, 51, 74], 0, None),
        "t02-plants": (1, 4, [1, 25, 25, 23], [2, 27, 52, 101], 0, None),
        "t03-run": (1, 4, [1, 25, 25, 23], [3, 89, 114, 137], 0, None),
        "t04-stars": (1, 4, [1, 25, 25, 23], [5, 111, 136, 159], 0, None)}
    for pid, r in recs.items():
        assert r.chunk_window_steps[0] == r.first_token_step and r.chunk_window_steps[-1] == r.finish_step - 1
        last_frames = [sum(r.chunk_frames_sent[:i + 1]) - 1 for i in range(r.chunk_windows)]
        mine = {s.step: s for s in spans if s.request == pid}
        assert [mine[step].c + mine[step].n - mine[step].P for step in r.chunk_window_steps] == last_frames, pid


def test_a_full_payload_deploy_writes_no_chunk_field_and_is_otherwise_the_same(stress_cells):
    streamed, _, full = stress_cells
    for pid, r in full.items():
        line = json.loads(to_json(r))
        assert not set(CHUNK_FIELDS) & set(line), pid
        twin = json.loads(to_json(streamed[pid]))
        assert {k: v for k, v in twin.items() if k not in (*CHUNK_FIELDS, "deploy", "wall_s")} == {
            k: v for k, v in line.items() if k not in ("deploy", "wall_s")}, pid


# --------------------------------------------------------------------------- fidelity


def _side(label: str, backend: str, records: list[RequestRecord]) -> fidelity.Side:
    return fidelity.Side(label=label, backend=backend, talker="speaking" if backend == "sim" else None,
                         records=records)


def _pair(sim_windows: list[int] | None, real_windows: list[int] | None, pid: str = "t01-tea"):
    codes = CODES[:74]
    sim = _record(codes, chunk_frames_sent=sim_windows)
    real = _record(codes, chunk_frames_sent=real_windows)
    sim.prompt_id = real.prompt_id = pid
    real.backend = "vllm-omni"
    return sim, real


def _compare(pairs: list[tuple[RequestRecord, RequestRecord]]) -> fidelity.Fidelity:
    return fidelity.compare(_side("sim", "sim", [s for s, _ in pairs]), _side("real", "vllm-omni", [r for _, r in pairs]))


def test_fidelity_says_the_windows_agree():
    fid = _compare([_pair([1, 25, 25, 23], [1, 25, 25, 23])])
    text = fidelity.render_text(fid).splitlines()
    assert text[2] == ("1 requests in both runs, 1 identical (same codec tokens, Code2Wav windows and every metric); "
                       "ratio = sim / real (two zeros: 1.00)")
    table = text[text.index("Per request:") + 1:]
    assert table[0] == ("Arm      Deploy                Run  Prompt   Same codes  Same windows  Metric                  "
                        "     Sim  Real  Sim/Real")
    assert table[2] == ("tts-fix  qwen3-tts-cpu-stress  1    t01-tea  yes         yes           oracle WER              "
                        "       -     -         -")
    assert "Where they differ" not in "\n".join(text)
    req = fidelity.as_json(fid)["requests"][0]
    assert (req["windows"], req["first_window_difference"], req["chunk_frames_sent"]) == (
        "same", None, {"sim": [1, 25, 25, 23], "real": [1, 25, 25, 23]})


def test_fidelity_says_where_the_windows_part_and_what_is_not_measured():
    """t01: the real connector lost a frame of window 1 (24 new frames, the rest shifted); t02: the real run has
    no windows (not traced); t03: no windows on either side."""
    t01 = _pair([1, 25, 25, 23], [1, 24, 25, 24])
    t02 = _pair([1, 25, 25, 23], None, "t02-plants")
    t03 = _pair(None, None, "t03-run")
    fid = _compare([t01, t02, t03])
    text = fidelity.render_text(fid)
    lines = text.splitlines()
    assert lines[2].startswith("3 requests in both runs, 2 identical (same codec tokens, Code2Wav windows and every "
                               "metric)")
    table = lines[lines.index("Per request:") + 1:]
    assert table[0].startswith("Arm      Deploy                Run  Prompt      Same codes  Same windows   Metric ")
    ident = [line[:85] for line in table if line.startswith("tts-fix")]
    assert ident == ["tts-fix  qwen3-tts-cpu-stress  1    t01-tea     yes         no (window 1)  oracle WER",
                     "tts-fix  qwen3-tts-cpu-stress  1    t02-plants  yes         not measured   oracle WER",
                     "tts-fix  qwen3-tts-cpu-stress  1    t03-run     yes         not measured   oracle WER"]
    tail = text[text.index("Where they differ"):].splitlines()
    assert tail[:2] == ["Where they differ, per request (1):",
                        "  tts-fix/qwen3-tts-cpu-stress/1/t01-tea: spans unknown; identical codec tokens; Code2Wav "
                        "windows differ from window 1 (sim 25 frames, real 24 frames)"]
    data = fidelity.as_json(fid)
    got = {r["prompt_id"]: (r["windows"], r["first_window_difference"], r["chunk_frames_sent"])
           for r in data["requests"]}
    assert got == {"t01-tea": ("differ", 1, {"sim": [1, 25, 25, 23], "real": [1, 24, 25, 24]}),
                   "t02-plants": ("not measured", None, {"sim": [1, 25, 25, 23], "real": None}),
                   "t03-run": ("not measured", None, {"sim": None, "real": None})}
    assert data["identical_requests"] == 2
    # a side that ends early parts at its end
    short = _compare([_pair([1, 25, 25, 23], [1, 25])])
    assert short.requests[0].difference_line().endswith("Code2Wav windows differ from window 2 (sim 25 frames, "
                                                        "real none)")


def test_fidelity_without_windows_prints_and_writes_what_it_did_before():
    fid = _compare([_pair(None, None)])
    text = fidelity.render_text(fid)
    assert "Same windows" not in text and "Code2Wav" not in text
    assert text.splitlines()[2] == ("1 requests in both runs, 1 identical (same codec tokens and every metric); "
                                    "ratio = sim / real (two zeros: 1.00)")
    table = text.splitlines()[text.splitlines().index("Per request:") + 1]
    assert table == "Arm      Deploy                Run  Prompt   Same codes  Metric                       Sim  Real  Sim/Real"
    assert list(fidelity.as_json(fid)["requests"][0]) == [
        "arm", "deploy", "repeat", "prompt_id", "same_codec_tokens", "same_schedule", "schedule",
        "first_code_difference", "said", "metrics", "talker_overlap"]
