"""``run_cell``/``describe_cell`` end to end against the fake vLLM-Omni server (real processes, 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fake_vllm"))
from fakekit import EXPECTED_EVENTS, REFERENCE_YAML, STRESS_YAML, deploy, fake_arm

from harness.config import ArmSpec, ServeSettings, load_prompts
from harness.errors import UserError
from harness.records import RequestRecord, SpanRecord
from harness.serve.backend import (
    ServeOptions,
    check_plugin_installed,
    describe_cell,
    run_cell,
    server_argv,
)
from harness.serve.deploy_args import translate_deploy
from harness.serve.launcher import pid_alive

PROMPTS = load_prompts("default")
STRESS_YAML_C4 = STRESS_YAML + "load: {mode: concurrency, concurrency: 4}\n"
OPTIONS = ServeOptions(model="fake/Qwen2.5-Omni-7B", health_timeout_s=30, request_timeout_s=20, retries=1, platform="gpu")


@dataclasses.dataclass
class Sink:
    requests: list[RequestRecord] = dataclasses.field(default_factory=list)
    spans: list[SpanRecord] = dataclasses.field(default_factory=list)
    order: list[str] = dataclasses.field(default_factory=list)

    def on_request(self, r: RequestRecord) -> None:
        self.requests.append(r)
        self.order.append(f"req:{r.prompt_id}")

    def on_spans(self, spans: list[SpanRecord]) -> None:
        self.spans.extend(spans)
        self.order.extend(f"spans:{s.request}" for s in spans[:1])

    def by_id(self) -> dict[str, RequestRecord]:
        return {r.prompt_id: r for r in self.requests}


def run(tmp_path: Path, arm: ArmSpec, dep=None, repeat: int = 1, options: ServeOptions = OPTIONS) -> Sink:
    sink = Sink()
    run_cell(arm, dep or deploy(tmp_path), PROMPTS, repeat, tmp_path / "run", options, sink.on_request, sink.on_spans)
    return sink


pytestmark = pytest.mark.slow


def test_end_to_end_records_spans_and_argv(tmp_path):
    argv_file = tmp_path / "argv.jsonl"
    arm = fake_arm("main", FAKE_VLLM_ARGV_FILE=str(argv_file))
    dep = deploy(tmp_path)
    sink = run(tmp_path, arm, dep, repeat=2)
    run_dir = tmp_path / "run"

    # the server got exactly the deploy's translation
    (launch,) = [json.loads(x) for x in argv_file.read_text().splitlines()]
    argv = launch["argv"]
    port = argv[argv.index("--port") + 1]
    assert argv == server_argv(arm, dep, OPTIONS, port)[2:]  # minus [python, fake_vllm_serve.py]
    assert argv[:7] == ["serve", "fake/Qwen2.5-Omni-7B", "--omni", "--host", "127.0.0.1", "--port", port]
    overrides = json.loads(argv[argv.index("--stage-overrides") + 1])
    assert overrides == {"0": {"max_num_seqs": 1}, "2": {"max_num_seqs": 1},
                         "1": {"max_num_seqs": 4, "enable_chunked_prefill": True, "max_num_batched_tokens": 32,
                               "num_gpu_blocks_override": 128, "block_size": 16, "max_model_len": 1984,
                               "enable_prefix_caching": False}}
    assert argv[-1] == "--no-async-chunk"
    assert launch["OMNI_STRESS_TRACE"] == str(run_dir / "serve" / "main-stress-r2")

    # one record per prompt, each with its audio and its own spans' events
    recs = sink.by_id()
    assert sorted(recs) == sorted(p.id for p in PROMPTS.prompts) and len(sink.requests) == 16
    for p in PROMPTS.prompts:
        r = recs[p.id]
        assert r.error is None, r.error
        assert (r.arm, r.deploy, r.repeat, r.backend) == ("main", "stress", 2, "vllm-omni")
        assert r.thinker_text == r.reference_text == f"You asked: {p.user}"
        assert r.audio_path == f"audio/main-stress-r2-{p.id}.wav"
        assert (run_dir / r.audio_path).read_bytes()[:4] == b"RIFF"
        assert r.audio_seconds == pytest.approx(0.25)
        assert r.wer is None and r.transcript is None
        assert r.talker_prompt_len == 20 and r.preemptions == 1 and r.finish_reason == "stop"
        assert dataclasses.asdict(r.events) == EXPECTED_EVENTS
    # spans: 13 per request, the profile-run line dropped, flags as the contract classifies them
    assert len(sink.spans) == 16 * 13
    assert {s.request for s in sink.spans} == set(recs)
    crossing = [s for s in sink.spans if s.cross_boundary]
    assert len(crossing) == 16 and all((s.P, s.c, s.n, s.rows) == (20, 16, 8, 20) for s in crossing)
    assert all(s.misaligned is None and (s.arm, s.deploy, s.repeat) == ("main", "stress", 2) for s in sink.spans)
    # each request's spans are delivered before the request itself
    for pid in recs:
        assert sink.order.index(f"spans:{pid}") < sink.order.index(f"req:{pid}")
    attempts = [json.loads(x) for x in (run_dir / "serve" / "main-stress-r2" / "attempts.jsonl").read_text().splitlines()]
    assert len(attempts) == 16 and all(a["ok"] and a["attempt"] == 1 for a in attempts)
    log = (run_dir / "server-main-stress.log").read_text()
    assert "fake vllm-omni serving fake/Qwen2.5-Omni-7B" in log and "shutdown complete" in log


def test_per_request_errors_timeouts_and_retries(tmp_path):
    arm = fake_arm("main", FAKE_VLLM_MALFORMED="p03-sleep", FAKE_VLLM_BAD_AUDIO="p04-moon",
                   FAKE_VLLM_NOT_WAV="p05-garden", FAKE_VLLM_FAIL_ONCE="p06-exercise", FAKE_VLLM_HANG="p07-rainbow")
    sink = run(tmp_path, arm, options=dataclasses.replace(OPTIONS, request_timeout_s=1.5))
    recs = sink.by_id()
    assert len(recs) == 16
    assert recs["p03-sleep"].error.startswith("malformed response body (not JSON")
    assert recs["p04-moon"].error.startswith("undecodable audio: choices[].message.audio.data is not base64")
    assert recs["p05-garden"].error.startswith("undecodable audio: not a WAV file")
    assert recs["p07-rainbow"].error == "timed out after 1.5 s (request timeout)"
    for pid in ("p03-sleep", "p04-moon", "p05-garden"):
        assert recs[pid].audio_path is None and recs[pid].thinker_text is None
        assert dataclasses.asdict(recs[pid].events) == EXPECTED_EVENTS  # its spans still count
    assert recs["p06-exercise"].error is None and recs["p06-exercise"].audio_path  # 500 once, then retried
    assert sum(r.error is None for r in recs.values()) == 12
    attempts = [json.loads(x) for x in
                (tmp_path / "run" / "serve" / "main-stress-r1" / "attempts.jsonl").read_text().splitlines()]
    by_prompt: dict[str, list] = {}
    for a in attempts:
        by_prompt.setdefault(a["prompt_id"], []).append(a)
    assert [(a["attempt"], a["ok"]) for a in by_prompt["p06-exercise"]] == [(1, False), (2, True)]
    assert by_prompt["p06-exercise"][1]["request_id"] == by_prompt["p06-exercise"][0]["request_id"] + "-a2"
    assert "HTTP 500: EngineCore encountered an issue" in by_prompt["p06-exercise"][0]["error"]
    for pid in ("p03-sleep", "p04-moon", "p05-garden", "p07-rainbow"):  # deterministic failures: not retried
        assert [(a["attempt"], a["ok"]) for a in by_prompt[pid]] == [(1, False)]


CRASH_LINE = "RuntimeError: talker preprocess: index 37 is out of bounds for dimension 0 with size 32 (fake crash)"


def test_server_crashing_mid_run_keeps_completed_records_and_names_the_crash(tmp_path):
    """Every request in flight at once: the crash takes all that were not answered, nothing is left to resend."""
    arm = fake_arm("pr", FAKE_VLLM_DIE_AFTER="5")
    sink = Sink()
    log = tmp_path / "run" / "server-pr-stress.log"
    times = run_cell(arm, deploy(tmp_path), PROMPTS, 1, tmp_path / "run", OPTIONS, sink.on_request, sink.on_spans)
    assert len(sink.requests) == 16
    done = [r for r in sink.requests if r.error is None]
    failed = [r for r in sink.requests if r.error is not None]
    assert len(done) == 5 and all(dataclasses.asdict(r.events) == EXPECTED_EVENTS for r in done)
    assert {r.error for r in failed} == {f"server crashed (exit code 3): {CRASH_LINE}; log: {log}"}
    assert sink.requests[:5] == done  # the completed ones were emitted first, as they finished
    assert times["crashes"] == [{"server": 1, "exit_code": 3, "error": CRASH_LINE, "requests_in_flight": 11,
                                 "requests_not_sent": 0}]
    assert log.read_text().count("=== omni-stress:") == 1  # nothing was left to send: no second server


def test_an_engine_that_dies_under_a_living_api_server_is_a_crash_named_by_the_workers_line(tmp_path):
    """0.30.0's Qwen3-Omni on CPU: the Talker's engine core raised, the API server lived on and answered every
    request in flight with "EngineCore encountered an issue". That is a crash: the records name the worker's
    traceback line (not the API server's EngineDeadError), and the cell's crashes say so."""
    arm = fake_arm("pr", FAKE_VLLM_DIE_AFTER="5", FAKE_VLLM_ENGINE_DEAD="1")
    sink = Sink()
    log = tmp_path / "run" / "server-pr-stress.log"
    times = run_cell(arm, deploy(tmp_path), PROMPTS, 1, tmp_path / "run", OPTIONS, sink.on_request, sink.on_spans)
    line = "IndexError: index 7 is out of bounds for dimension 0 with size 6 (fake engine death)"
    assert len(sink.requests) == 16 and sum(r.error is None for r in sink.requests) == 5
    assert {r.error for r in sink.requests if r.error is not None} == {
        f"server crashed (its engine core died): {line}; log: {log}"}
    assert times["crashes"] == [{"server": 1, "exit_code": None, "error": line, "requests_in_flight": 11,
                                 "requests_not_sent": 0}]


def test_a_coloured_crash_is_named_by_its_cleaned_traceback_line(tmp_path):
    """Issue 47, case 5: with vLLM's colours on, the crash line and every record's error carried raw ANSI codes
    and the API server's INFO line after the traceback; now the cleaned exception line."""
    arm = fake_arm("pr", FAKE_VLLM_DIE_AFTER="5", FAKE_VLLM_COLOR="1")
    sink = Sink()
    log = tmp_path / "run" / "server-pr-stress.log"
    times = run_cell(arm, deploy(tmp_path), PROMPTS, 1, tmp_path / "run", OPTIONS, sink.on_request, sink.on_spans)
    assert "\x1b[" in log.read_text()  # the log itself is as the server wrote it
    failed = [r for r in sink.requests if r.error is not None]
    assert len(failed) == 11
    assert {r.error for r in failed} == {f"server crashed (exit code 3): {CRASH_LINE}; log: {log}"}
    assert [c["error"] for c in times["crashes"]] == [CRASH_LINE]


def test_crash_line_without_a_traceback_is_the_last_error_message_cleaned():
    from harness.serve.launcher import crash_line_of

    log = ("\x1b[1;36m(EngineCore_DP0 pid=9)\x1b[0;0m \x1b[31mERROR\x1b[0m 12-06 05:21:00 [core.py:700] "
           "EngineCore failed to start.\n"
           "\x1b[1;36m(APIServer pid=8)\x1b[0;0m \x1b[32mINFO\x1b[0m 12-06 05:21:01 [launcher.py:99] Shutting down.")
    assert crash_line_of(log) == "EngineCore failed to start."
    assert crash_line_of("\x1b[32mINFO\x1b[0m 12-06 05:21:01 [x.py:1] only this") == "only this"
    assert crash_line_of("") == "no output"


def test_server_crashing_under_a_paced_load_is_restarted_for_the_requests_not_sent(tmp_path):
    """At most 4 in flight (load: concurrency 4): the first server answers 5 and takes the 4 in flight with
    it; the 7 requests it was never sent go to a second server, which answers 5 and takes the last 2."""
    arm = fake_arm("pr", FAKE_VLLM_DIE_AFTER="5")
    dep = deploy(tmp_path, STRESS_YAML_C4)
    sink = Sink()
    log = tmp_path / "run" / "server-pr-stress.log"
    times = run_cell(arm, dep, PROMPTS, 1, tmp_path / "run", OPTIONS, sink.on_request, sink.on_spans)
    ids = [p.id for p in PROMPTS.prompts]
    assert sorted(r.prompt_id for r in sink.requests) == sorted(ids)  # each request recorded once
    by_id = sink.by_id()
    crashed = f"server crashed (exit code 3): {CRASH_LINE}; log: {log}"
    assert [pid for pid in ids if by_id[pid].error is None] == ids[:5] + ids[9:14]
    assert [pid for pid in ids if by_id[pid].error == crashed] == ids[5:9] + ids[14:]
    assert times["crashes"] == [
        {"server": 1, "exit_code": 3, "error": CRASH_LINE, "requests_in_flight": 4, "requests_not_sent": 7},
        {"server": 2, "exit_code": 3, "error": CRASH_LINE, "requests_in_flight": 2, "requests_not_sent": 0},
    ]
    assert log.read_text().count("=== omni-stress:") == 2
    assert all(dataclasses.asdict(by_id[pid].events) == EXPECTED_EVENTS for pid in ids[:5] + ids[9:14])


def test_a_server_that_keeps_crashing_is_started_at_most_three_times(tmp_path):
    """One answer per server: three servers answer three requests, the rest of the cell is never sent."""
    arm = fake_arm("pr", FAKE_VLLM_DIE_AFTER="1")
    dep = deploy(tmp_path, STRESS_YAML_C4.replace("concurrency: 4", "concurrency: 1"))
    sink = Sink()
    log = tmp_path / "run" / "server-pr-stress.log"
    times = run_cell(arm, dep, PROMPTS, 1, tmp_path / "run", OPTIONS, sink.on_request, sink.on_spans)
    ids = [p.id for p in PROMPTS.prompts]
    by_id = sink.by_id()
    assert len(sink.requests) == 16
    assert [pid for pid in ids if by_id[pid].error is None] == [ids[0], ids[2], ids[4]]
    assert [pid for pid in ids if by_id[pid].error is not None and "(exit code 3)" in by_id[pid].error] == \
        [ids[1], ids[3], ids[5]]
    assert {by_id[pid].error for pid in ids[6:]} == {
        f"server crashed: not sent, the cell's server crashed 3 times (at most 3 starts per cell); log: {log}"}
    assert [c["requests_not_sent"] for c in times["crashes"]] == [14, 12, 10]
    assert log.read_text().count("=== omni-stress:") == 3


def test_reference_deploy_and_no_stale_trace_on_rerun(tmp_path):
    dep = deploy(tmp_path, REFERENCE_YAML, "reference")
    arm = fake_arm("main")
    first = run(tmp_path, arm, dep)
    second = run(tmp_path, arm, dep)  # same cell again: the first server's spans must not be counted twice
    assert len(first.spans) == len(second.spans) == 16 * 13
    assert (tmp_path / "run" / "server-main-reference.log").read_text().count("=== omni-stress:") == 2


def test_arm_without_serve_entry_and_no_real_environment_is_refused(tmp_path, monkeypatch):
    import harness.serve.backend as backend_mod

    monkeypatch.setattr(backend_mod, "DEFAULT_SERVE_PYTHON", ".venv-omni-absent/bin/python")
    monkeypatch.delenv(backend_mod.ENV_SERVE_PYTHON, raising=False)
    arm = ArmSpec(name="plug", talker="x.y:z")
    with pytest.raises(UserError, match=r"arm 'plug' has no 'serve' entry in deploy_configs/arms.yaml and there is "
                                        r"no default real environment \(.venv-omni-absent/bin/python: run scripts/"):
        run(tmp_path, arm)
    # a dry run describes what would run, and says the interpreter is missing (issue 24, case 20)
    text = describe_cell(arm, deploy(tmp_path), tmp_path, OPTIONS)
    assert "# interpreter '" in text and ".venv-omni-absent/bin/python' is not installed here" in text


def test_arm_without_serve_entry_runs_in_the_default_real_environment(tmp_path):
    arm = ArmSpec(name="plug", talker="x.y:z")
    options = ServeOptions(platform="cpu", default_python="/venvs/real/bin/python")
    text = describe_cell(arm, deploy(tmp_path), tmp_path, options)
    assert "/venvs/real/bin/python -m vllm.entrypoints.cli.main serve" in text
    assert "OMNI_STRESS_ARM=x.y:z" in text


def test_health_timeout_is_a_user_error_and_reaps(tmp_path):
    pidfile = tmp_path / "pids.json"
    arm = fake_arm("main", FAKE_VLLM_NEVER_HEALTHY="1", FAKE_VLLM_PIDFILE=str(pidfile))
    with pytest.raises(UserError, match="did not become healthy within 1.5 s"):
        run(tmp_path, arm, options=dataclasses.replace(OPTIONS, health_timeout_s=1.5))
    assert not pid_alive(json.loads(pidfile.read_text())["server"])


def test_describe_cell_prints_the_exact_command(tmp_path):
    arm = ArmSpec(name="pr", talker="x:y", serve=ServeSettings(python="~/venvs/pr/bin/python", env={"HF_HOME": "/hf"}))
    dep = deploy(tmp_path)
    text = describe_cell(arm, dep, tmp_path / "run", ServeOptions(extra_args=("--stage-init-timeout", "900"),
                                                                 platform="gpu"))
    cmd_line = next(ln for ln in text.splitlines() if "serve Qwen/Qwen2.5-Omni-7B" in ln)
    assert shlex.split(cmd_line.strip().replace("$PORT", "8091")) == [
        str(Path.home() / "venvs/pr/bin/python"), "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen2.5-Omni-7B", "--omni",
        "--host", "127.0.0.1", "--port", "8091", "--stage-overrides", translate_deploy(dep).stage_overrides_json,
        "--no-async-chunk", "--stage-init-timeout", "900"]
    assert "OMNI_STRESS_TRACE=" + shlex.quote(str(tmp_path / "run" / "serve" / "pr-stress-r<repeat>")) in text
    assert "HF_HOME=/hf" in text and "PYTHONUNBUFFERED=1" in text
    assert '#   modalities: ["text", "audio"]' in text and "#   sampling_params_list (Thinker, Talker, Code2Wav):" in text
    assert '"max_tokens": 80' in text and '"max_tokens": 1900' in text
    assert str(tmp_path / "run" / "server-pr-stress.log") in text


def test_plugin_preflight():
    assert check_plugin_installed(sys.executable) is None  # this venv has omni-stress installed
    assert "not found" in check_plugin_installed("/nonexistent/python")
