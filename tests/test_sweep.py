"""Issue 20: ``omni-stress sweep``: sweep files, load on the sim, latency and duration, the map, its gate.

The end-to-end test runs a tiny sweep (2 chunk budgets x 2 loads around ``stress``, 3 prompts, main
and pr) on the sim through the CLI, as CI does; the rest are unit tests of the pieces.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.config import ConfigError, LoadSettings, load_deploy, parse_deploy
from harness.records import RequestRecord, read_manifest, read_requests, to_json
from harness.sweep.grid import load_sweep, parse_sweep
from conftest import REPO, invoke_cli
from clikit import assert_one_line_error

DATA = REPO / "tests" / "data"
TINY = DATA / "sweep_tiny.yaml"
PROMPTS = DATA / "prompts_e2e.yaml"
TINY_ARGS = ("sweep", str(TINY), "--prompts", str(PROMPTS), "--quiet", "--no-cache")
POINTS = ["stress@mnbt=16,load=all", "stress@mnbt=16,load=c1", "stress@mnbt=4096,load=all",
          "stress@mnbt=4096,load=c1"]


# ----------------------------------------------------------------------------- sweep files


def test_default_sweep_has_24_points_each_an_ordinary_deploy() -> None:
    sweep = load_sweep("default")
    assert len(sweep.points) == 24
    assert [d.name for d in sweep.deploys[:4]] == ["reference", "stress@mnbt=256,kv=192,load=all",
                                                   "stress@mnbt=256,kv=192,load=c2", "stress@mnbt=256,kv=192,load=p0.02"]
    assert sweep.deploys[-1].name == "stress@mnbt=16,kv=128,load=p0.02"
    point = sweep.points[4].deploy  # mnbt=256, kv=128, c2
    assert point.name == "stress@mnbt=256,kv=128,load=c2"
    assert (point.talker.max_num_batched_tokens, point.talker.num_gpu_blocks_override) == (256, 128)
    assert point.load == LoadSettings(mode="concurrency", concurrency=2, rate=None, jitter=4)
    assert point.talker.max_num_seqs == 4 and point.talker.max_model_len == 1984  # the rest is the base's
    hashes = {p.deploy.config_hash for p in sweep.points}
    assert len(hashes) == 24 and load_deploy("stress").config_hash not in hashes
    assert sweep.points[0].coords == (("mnbt", "256"), ("kv", "192"), ("load", "all"))


def test_shipped_deploys_load_all_at_once_and_keep_their_hash() -> None:
    from harness.config import file_hash

    for name in ("reference", "stress", "specdec", "cpu-reference", "cpu-stress"):
        deploy = load_deploy(name)
        assert deploy.load == LoadSettings() and deploy.overrides == ()
        assert deploy.config_hash == file_hash(deploy.path)


def test_a_point_is_named_by_its_axes_and_speculative_zero_removes_specdec(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    sweep = parse_sweep({"base": "specdec", "reference": None, "axes": {
        "speculative.num_speculative_tokens": [0, 3], "talker.max_num_seqs": [2],
        "load": ["p0.5", {"mode": "concurrency", "concurrency": 3, "jitter": 2}]}}, path)
    assert [p.name for p in sweep.points] == [
        "specdec@spec=0,seqs=2,load=p0.5", "specdec@spec=0,seqs=2,load=c3+j2",
        "specdec@spec=3,seqs=2,load=p0.5", "specdec@spec=3,seqs=2,load=c3+j2"]
    assert sweep.points[0].deploy.speculative is None
    assert sweep.points[2].deploy.speculative.num_speculative_tokens == 3
    assert sweep.points[1].deploy.load == LoadSettings("concurrency", 3, None, 2)
    assert sweep.points[0].deploy.load == LoadSettings("poisson", None, 0.5, 0)
    assert sweep.deploys == [p.deploy for p in sweep.points]  # reference: null


BAD_SWEEPS = [
    ("unknown-key", "base: stress\naxis: {}\n", "s.yaml: axis: unknown key (allowed: axes, base, description, jitter, "
                                                "name, reference)"),
    ("no-axes", "base: stress\n", "s.yaml: axes: must be a mapping of deploy keys to lists of values"),
    ("unknown-base", "base: nope\naxes: {load: [all]}\n", "s.yaml: base: unknown deploy 'nope' (known: "),
    ("not-a-list", "base: stress\naxes: {talker.max_num_seqs: 4}\n",
     "s.yaml: axes.talker.max_num_seqs: must be a non-empty list of values, got 4"),
    ("unknown-field", "base: stress\naxes: {talker.max_num_seq: [4]}\n",
     "s.yaml: axes (talker.max_num_seq=4): talker.max_num_seq: unknown key (allowed: "),
    ("not-a-deploy-key", "base: stress\naxes: {name: [a]}\n",
     "s.yaml: axes.name: not a deploy key that a sweep can vary"),
    ("bad-value", "base: stress\naxes: {talker.max_num_batched_tokens: [16, -1]}\n",
     "s.yaml: axes (talker.max_num_batched_tokens=-1): talker.max_num_batched_tokens: must be a positive integer, got -1"),
    ("kv-too-small", "base: stress\naxes: {talker.num_gpu_blocks_override: [64]}\n",
     "s.yaml: axes (talker.num_gpu_blocks_override=64): talker.num_gpu_blocks_override: 64 blocks (63 usable"),
    ("bad-load", "base: stress\naxes: {load: [all, x3]}\n",
     "s.yaml: axes.load[1]: a load is all, cN (N requests in flight), pX (Poisson, X requests per step) or a "
     "mapping {mode, concurrency, rate, jitter}, got 'x3'"),
    ("load-mapping-wrong", "base: stress\naxes: {load: [{mode: poisson}]}\n",
     "s.yaml: axes (load=poisson): load.rate: missing or 0 (load mode poisson needs a rate > 0: requests per step)"),
    ("duplicate-value", "base: stress\naxes: {talker.max_num_seqs: [4, 4]}\n",
     "s.yaml: axes.talker.max_num_seqs: value 4 given twice"),
    ("too-many-points", "base: stress\naxes: {sampling.seed: [" + ", ".join(map(str, range(33))) + "], "
     "sampling.top_k: [" + ", ".join(map(str, range(1, 33))) + "]}\n",
     "s.yaml: axes: 1056 grid points, over the limit of 1024; sweep fewer values"),
    ("bad-jitter", "base: stress\njitter: -1\naxes: {load: [all]}\n",
     "s.yaml: jitter: must be an integer in [0, 100000] (steps), got -1"),
    ("malformed", "base: [stress\n", "s.yaml: line 2 column 1: malformed YAML"),
]


@pytest.mark.parametrize("name,text,message", BAD_SWEEPS, ids=[c[0] for c in BAD_SWEEPS])
def test_bad_sweep_file_is_one_line_exit_2(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    res = invoke_cli("sweep", str(path), "--out", str(tmp_path / "out"), "--quiet")
    line = assert_one_line_error(res, message)
    assert line.startswith(f"omni-stress: error: {path}"), line
    assert not (tmp_path / "out").exists()


def test_unknown_sweep_name_lists_the_shipped_ones(tmp_path: Path) -> None:
    res = invoke_cli("sweep", "nope", "--out", str(tmp_path / "out"))
    assert_one_line_error(res, "unknown sweep 'nope' (known: cpu, default, quick, qwen3-omni, qwen3-tts, qwen3-tts-streaming; or give a .yaml path)")


def test_scheduler_rules_are_checked_per_point(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("base: stress\naxes: {talker.max_num_batched_tokens: [16, 2]}\n")
    res = invoke_cli("sweep", str(path), "--out", str(tmp_path / "out"))
    assert_one_line_error(res, f"{path}: axes (talker.max_num_batched_tokens=2): talker.max_num_batched_tokens: "
                               "2 is below talker.max_num_seqs 4")


@pytest.mark.parametrize("load,message", [
    ({"mode": "burst"}, "load.mode: must be one of all, concurrency, poisson, got 'burst'"),
    ({"mode": "concurrency"}, "load.concurrency: missing (load mode concurrency needs the number of requests in flight)"),
    ({"mode": "all", "rate": 0.5}, "load.rate: applies to mode poisson only (mode is all)"),
    ({"mode": "poisson", "rate": 0.5, "concurrency": 2}, "load.concurrency: applies to mode concurrency only"),
    ({"mode": "all", "jitter": -2}, "load.jitter: must be an integer >= 0, got -2"),
    ({"mode": "all", "burst": 1}, "load.burst: unknown key (allowed: concurrency, jitter, mode, rate)"),
])
def test_deploy_load_section_is_validated(tmp_path: Path, load: dict, message: str) -> None:
    path = tmp_path / "d.yaml"
    with pytest.raises(ConfigError) as err:
        parse_deploy(path, {"name": "d", "load": load})
    assert str(err.value).startswith(f"{path}: {message}")


# ----------------------------------------------------------------------------- load on the sim


def _outputs(replies: list[int]) -> list:
    from types import SimpleNamespace

    return [SimpleNamespace(request_id=f"p{i}", reply_tokens=["w"] * k, arrival_step=0) for i, k in enumerate(replies)]


def _arrivals(load: LoadSettings, seed: int = 42, replies=(9, 4, 19, 9), finish_after: int = 50) -> list[tuple]:
    """(request, sent, arrived) of a cell whose requests each take ``finish_after`` Talker steps."""
    from harness.sim.load import Arrivals

    outs = _outputs(list(replies))
    arrivals = Arrivals(outs, load, 1.0, 1, seed)
    live: dict[str, int] = {}
    seen = []
    for step in range(10_000):
        for o in arrivals.due(step):
            live[o.request_id] = step
            seen.append((o.request_id, arrivals.sent[o.request_id], step))
        for rid, at in list(live.items()):
            if step - at == finish_after:
                del live[rid]
                arrivals.finished(rid, step)
        if not live and not arrivals.pending():
            break
    return seen


def test_load_all_is_the_thinker_schedule() -> None:
    from harness.config import PromptSet, load_prompts
    from harness.sim.load import Arrivals
    from harness.sim.rows import RowSpace
    from harness.families.qwen2_5_omni.thinker import run_thinker

    prompts: PromptSet = load_prompts(str(PROMPTS))
    outs = run_thinker(prompts, RowSpace(42), 1.0)
    want = [(o.request_id, o.arrival_step) for o in outs]
    arrivals = Arrivals(outs, LoadSettings(), 1.0, 1, 42)
    got = [(o.request_id, step) for step in range(200) for o in arrivals.due(step)]
    assert got == want == [("p01-weather", 35), ("p03-sleep", 67), ("p05-garden", 97)]
    # the generic path (every request sent at step 0: concurrency above the prompt count) queues the same
    assert _arrivals(LoadSettings("concurrency", 16), replies=(31, 30, 29)) == [
        ("p0", 0, 32), ("p1", 0, 63), ("p2", 0, 93)]


def test_concurrency_sends_the_next_request_when_one_finishes() -> None:
    assert _arrivals(LoadSettings("concurrency", 1)) == [
        ("p0", 0, 10), ("p1", 61, 66), ("p2", 117, 137), ("p3", 188, 198)]
    assert _arrivals(LoadSettings("concurrency", 2)) == [
        ("p0", 0, 10), ("p1", 0, 15), ("p2", 61, 81), ("p3", 66, 91)]


def test_poisson_and_jitter_are_drawn_from_the_seed() -> None:
    poisson = LoadSettings("poisson", rate=0.05)
    assert _arrivals(poisson, seed=42) == _arrivals(poisson, seed=42)
    assert _arrivals(poisson, seed=42) != _arrivals(poisson, seed=43)
    assert [sent for _, sent, _ in _arrivals(poisson, seed=42)] == [0, 1, 30, 48]
    jitter = LoadSettings(jitter=4)
    assert [sent for _, sent, _ in _arrivals(jitter, seed=42)] == [0, 2, 4, 4]
    assert [sent for _, sent, _ in _arrivals(jitter, seed=7)] == [0, 1, 1, 1]


# ----------------------------------------------------------------------------- records and metrics


def test_latency_fields_are_written_only_when_measured() -> None:
    rec = RequestRecord(arm="a", deploy="d", repeat=1, prompt_id="p", backend="sim", reference_text="x")
    assert "sent_step" not in json.loads(to_json(rec)) and "rtf" not in json.loads(to_json(rec))
    rec.sent_step, rec.finish_step = 3, 40
    data = json.loads(to_json(rec))
    assert (data["sent_step"], data["finish_step"]) == (3, 40) and "first_token_step" not in data


def test_percentiles_are_nearest_rank() -> None:
    from harness.sweep.metrics import percentile

    values = [float(v) for v in range(1, 11)]
    assert [percentile(values, q) for q in (50, 90, 99)] == [5.0, 9.0, 10.0]
    assert percentile([], 50) is None and percentile([7.0], 99) == 7.0


def test_duration_flags_truncation_and_overrun() -> None:
    from harness.report.summary import CellSummary
    from harness.records import EventCounts
    from harness.sweep.metrics import duration

    def cell(deploy: str, tokens: list[int]) -> CellSummary:
        recs = [RequestRecord(arm="a", deploy=deploy, repeat=1, prompt_id=f"p{i}", backend="sim", reference_text="x",
                              num_codec_tokens=n) for i, n in enumerate(tokens)]
        return CellSummary("a", deploy, 1, len(recs), [], [], EventCounts(), "requests", True, 0, 0, 0.0, "oracle", 1,
                           records=recs)

    d = duration(cell("s", [100, 50, 120, 111]), cell("reference", [100, 100, 100, 100]))
    assert (d.compared, d.truncated, d.overrun, d.ratios) == (4, 1, 2, (1.0, 0.5, 1.2, 1.11))


# ----------------------------------------------------------------------------- end to end (CI)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("sweep")
    res = invoke_cli(*TINY_ARGS, "--out", str(out), "--run-id", "tiny")
    assert res.exit_code == 0, res.stderr
    return out / "tiny", res.stdout


def test_tiny_sweep_end_to_end(tiny_sweep: tuple[Path, str]) -> None:
    run_dir, stdout = tiny_sweep
    manifest = read_manifest(run_dir)
    assert manifest["deploys"] == ["reference", *POINTS]
    assert manifest["sweep"]["points"][0] == {"deploy": POINTS[0], "coords": {"mnbt": "16", "load": "all"}}
    assert len(manifest["cells"]) == 10 and manifest["finished"]
    records = read_requests(run_dir)
    assert len(records) == 30
    assert all(r.sent_step is not None and r.first_token_step is not None and r.finish_step is not None
               for r in records)
    sweep = json.loads((run_dir / "sweep.json").read_text())
    rows = [(r["arm"], r["deploy"], r["status"], r["knee"], r["mean_wer"], r["requests_over"],
             r["nonzero_offset_chunks"], r["duration"]["truncated"]) for r in sweep["rows"]]
    assert rows == [
        ("main", "reference", "reference", False, 0.0, 0, 0, 0),
        ("main", POINTS[0], "bug", True, 1.0, 3, 10, 2),
        ("main", POINTS[1], "bug", False, 1.0, 3, 9, 2),
        ("main", POINTS[2], "unstressed", False, 0.0, 0, 0, 0),
        ("main", POINTS[3], "unstressed", False, 0.0, 0, 0, 0),
        ("pr", "reference", "reference", False, 0.0, 0, 0, 0),
        ("pr", POINTS[0], "pass", False, 0.0, 0, 10, 0),
        ("pr", POINTS[1], "pass", False, 0.0, 0, 9, 0),
        ("pr", POINTS[2], "unstressed", False, 0.0, 0, 0, 0),
        ("pr", POINTS[3], "unstressed", False, 0.0, 0, 0, 0),
    ]
    latency = {(r["arm"], r["deploy"]): r["latency"]["e2e"] for r in sweep["rows"]}
    assert latency[("pr", POINTS[0])] == {"50": 657.0, "90": 684.0, "99": 684.0}
    assert latency[("pr", POINTS[1])] == {"50": 624.0, "90": 684.0, "99": 684.0}
    assert sweep["schedules"] == {"requests": 30, "distinct": 21, "per_arm": {"main": 15, "pr": 15},
                                  "per_deploy": {"reference": 3, POINTS[0]: 6, POINTS[1]: 6, POINTS[2]: 3,
                                                 POINTS[3]: 3}}
    assert [(a["arm"], a["status"], a["knee"]) for a in sweep["verdict"]["arms"]] == [
        ("main", "pass", POINTS[0]), ("pr", "pass", None)]
    assert "distinct schedules explored: 21 distinct (deploy, prompt, (P, c, n) span sequence) over 30 request " \
           "runs (seed 42, 1 repeat; per arm: main 15, pr 15)" in stdout
    assert "map gate: 2 of 2 arms pass -> pass (exit 0)" in stdout
    for name in ("sweep.md", "sweep.html", "sweep.json"):
        assert (run_dir / name).stat().st_size > 0
    assert sorted(p.name for p in (run_dir / "sweep_plots").iterdir()) == sorted(
        f"{arm}-{m}.png" for arm in ("main", "pr") for m in ("wer", "over", "misaligned", "events", "latency"))
    md = (run_dir / "sweep.md").read_text()
    assert "* main [baseline]: quality knee at stress@mnbt=16,load=all (per load: all: stress@mnbt=16,load=all, " \
           "c1: stress@mnbt=16,load=c1)" in md
    assert "* pr [candidate]: no quality knee (WER inside the gate at every point)" in md


def test_gate_on_a_sweep_gates_the_map(tiny_sweep: tuple[Path, str], tmp_path: Path) -> None:
    run_dir, _ = tiny_sweep
    res = invoke_cli("gate", str(run_dir), "--junit", str(tmp_path / "j.xml"))
    assert res.exit_code == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert "PASS   arm main [baseline]: shows the bug in 2 of 2 stressed cells (2 cells did not stress: reported, " \
           "not counted); quality knee at stress@mnbt=16,load=all (per load: all: stress@mnbt=16,load=all, " \
           "c1: stress@mnbt=16,load=c1)" in lines
    assert "PASS   arm pr [candidate]: holds its rules in 2 of 2 stressed cells (2 cells did not stress: reported, " \
           "not counted); no quality knee (WER inside the gate at every point)" in lines
    assert lines[-1] == "map gate: 2 of 2 arms pass -> pass (exit 0)"
    xml = (tmp_path / "j.xml").read_text()
    assert 'tests="10" failures="0" errors="0" skipped="4"' in xml


def test_map_gate_fails_a_candidate_that_breaks_at_one_point(tiny_sweep: tuple[Path, str]) -> None:
    """main's cells under the candidate role: its stressed points fail the exact and the WER rules."""
    import dataclasses

    from harness.gate import DEFAULT_RULES, load_rules
    from harness.report.summary import load_run, summarize_cells
    from harness.sweep.gate import evaluate_map

    run_dir, _ = tiny_sweep
    run = load_run(run_dir)
    cells = [dataclasses.replace(c, role="candidate") for c in summarize_cells(run) if c.arm == "main"]
    verdict = evaluate_map(load_rules(DEFAULT_RULES), cells, run.manifest["sweep"])
    (arm,) = verdict.arms
    assert arm.status == "fail" and verdict.exit_code == 1
    assert [(c.point, c.status) for c in arm.cells] == [(POINTS[0], "fail"), (POINTS[1], "fail"),
                                                         (POINTS[2], "unstressed"), (POINTS[3], "unstressed")]
    assert "max_wer_delta: mean WER minus the reference deploy's mean WER = +1.000 > +0.030" in arm.cells[0].message
    # the pages' verdict line names the failing rules and where (issue 46: pages that answer first); main's
    # reference breaks the contract too (its end region)
    from harness.sweep.report import _failing_rules

    assert _failing_rules(arm) == (f"candidate-contract on the reference; candidate-contract at 2 of 2 stressed points ({POINTS[0]}, {POINTS[1]}); "
                                   f"candidate-stress-matches-reference at 2 of 2 stressed points ({POINTS[0]}, "
                                   f"{POINTS[1]})")
    # the baseline role: no stressed point left (only the unstressed ones): the harness proves nothing
    only_unstressed = [c for c in summarize_cells(run) if c.deploy in ("reference", POINTS[2], POINTS[3])]
    assert {a.status for a in evaluate_map(load_rules(DEFAULT_RULES), only_unstressed,
                                           run.manifest["sweep"]).arms} == {"error"}


def test_resume_of_a_killed_sweep(tiny_sweep: tuple[Path, str], tmp_path: Path) -> None:
    """A sweep killed after its first cells: --resume runs the rest and gives the same records."""
    full, _ = tiny_sweep
    run_dir = tmp_path / "killed"
    shutil.copytree(full, run_dir)
    manifest = read_manifest(run_dir)
    manifest["finished"] = None
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    lines = (run_dir / "requests.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "requests.jsonl").write_text("".join(lines[:7]) + lines[7][:40])  # two cells and a torn line
    kept = {tuple(json.loads(line)[k] for k in ("arm", "deploy")) for line in lines[:7]}
    from harness.spanstore import export_lines, file_cell, span_files

    for path in span_files(run_dir):  # the span store: the files of the cells not kept never got written
        if file_cell(path)[:2] not in kept:
            path.unlink()
    for name in ("sweep.md", "sweep.json", "sweep.html"):
        (run_dir / name).unlink()
    res = invoke_cli(*TINY_ARGS, "--resume", str(run_dir))
    assert res.exit_code == 0, res.stderr

    def canon(path: Path) -> list[str]:
        out = []
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            rec.pop("wall_s", None)
            out.append(json.dumps(rec, sort_keys=True))
        return sorted(out)

    assert canon(run_dir / "requests.jsonl") == canon(full / "requests.jsonl")
    for d in (run_dir, full):
        (d.parent / f"{d.name}.spans.jsonl").write_text("".join(export_lines(d)))
    assert canon(tmp_path / "killed.spans.jsonl") == canon(full.parent / f"{full.name}.spans.jsonl")
    assert json.loads((run_dir / "sweep.json").read_text())["rows"] == json.loads((full / "sweep.json").read_text())["rows"]
    assert len(read_manifest(run_dir)["resumed"]) == 1


def test_resume_with_another_sweep_is_refused(tiny_sweep: tuple[Path, str], tmp_path: Path) -> None:
    full, _ = tiny_sweep
    run_dir = tmp_path / "run"
    shutil.copytree(full, run_dir)
    other = tmp_path / "other.yaml"
    other.write_text(TINY.read_text().replace("[16, 4096]", "[16, 2048]"))
    res = invoke_cli("sweep", str(other), "--prompts", str(PROMPTS), "--quiet", "--resume", str(run_dir))
    assert_one_line_error(res, f"--resume {run_dir}: config_hashes differ from the manifest")
    res = invoke_cli("sweep", str(TINY), "--prompts", str(PROMPTS), "--quiet", "--resume", str(run_dir),
                     "--seed", "7")
    assert_one_line_error(res, f"--resume {run_dir}: ")


def test_list_sweeps() -> None:
    res = invoke_cli("list", "sweeps")
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "Sweeps (deploy_configs/sweeps/; omni-stress sweep NAME):"
    assert "  cpu        2 points around cpu-stress (reference cpu-reference)" in lines
    assert "  default    24 points around stress (reference reference)" in lines


def test_client_load_on_the_real_backend() -> None:
    """Wall-time pacing: at most N in flight; Poisson send times drawn from the seed."""
    import asyncio

    from harness.serve.load import ClientLoad, poisson_offsets

    async def peak(load: LoadSettings, n: int) -> int:
        pacing = ClientLoad(load, n, 0)
        active, top = [0], [0]

        async def one(i: int) -> None:
            async with pacing.slot(i):
                active[0] += 1
                top[0] = max(top[0], active[0])
                await asyncio.sleep(0.01)
                active[0] -= 1

        await asyncio.gather(*(one(i) for i in range(n)))
        return top[0]

    assert asyncio.run(peak(LoadSettings("concurrency", 2), 6)) == 2
    assert asyncio.run(peak(LoadSettings(), 6)) == 6
    offsets = poisson_offsets(4, 2.0, 42)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets == poisson_offsets(4, 2.0, 42)
    assert offsets != poisson_offsets(4, 2.0, 43)
    assert [round(t, 3) for t in offsets] == [0.0, 1.068, 1.129, 1.346]


def test_report_on_a_sweep_rewrites_the_map(tiny_sweep: tuple[Path, str], tmp_path: Path) -> None:
    full, _ = tiny_sweep
    run_dir = tmp_path / "run"
    shutil.copytree(full, run_dir)
    (run_dir / "sweep.json").unlink()
    res = invoke_cli("report", str(run_dir), "--format", "csv")
    assert res.exit_code == 0, res.stderr
    assert f"wrote sweep.json: {run_dir / 'sweep.json'}" in res.stderr.splitlines()
    assert json.loads((run_dir / "sweep.json").read_text())["rows"] == json.loads((full / "sweep.json").read_text())["rows"]


def test_specdec_cells_get_wer_rules(tmp_path: Path) -> None:
    """A candidate whose rows drift under verify spans (OneRowPerSpan) now fails a WER rule under specdec
    too, not only the exact contract rule a backend that cannot count rows does not have."""
    from conftest import SMALL_PROMPTS

    from harness import gate
    from harness.report.summary import load_run, summarize_cells

    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path),
                     "--run-id", "spec", "--arm", "onerow=tests.fixtures.mutants:OneRowPerSpan",
                     "--deploy", "reference", "--deploy", "specdec")
    assert res.exit_code == 0, res.stderr
    result = gate.evaluate(gate.load_rules(gate.DEFAULT_RULES), summarize_cells(load_run(tmp_path / "spec")))
    case = next(c for c in result.cases if c.rule.name == "candidate-specdec-matches-reference")
    assert [(c.bound.key, c.status) for c in case.checks] == [
        ("min_multi_position_decode_spans", "pass"), ("max_wer_delta", "fail"), ("max_worst_paired_delta", "fail"),
        ("max_requests_over", "fail")]
    assert case.checks[1].message == ("max_wer_delta: mean WER minus the reference deploy's mean WER = +0.478 > "
                                      "+0.030 (vs onerow/reference run 1: 0.000)")


def test_real_backend_latency_columns_from_records(tiny_sweep: tuple[Path, str]) -> None:
    """The map of a real-backend sweep, without a server: the tiny sweep's records as the real backend
    writes them (seconds, a first-codec-token time, RTF, audio). The map adds RTF and the audio's
    seconds, says that TTFA is not streamed, and keeps a sim sweep's columns as they were."""
    import dataclasses

    from harness.gate import DEFAULT_RULES, load_rules
    from harness.report.summary import load_run
    from harness.sweep.report import build_map, latency_note, map_json, table_rows, terminal_map

    run_dir, stdout = tiny_sweep
    sim_map = build_map(run_dir, load_rules(DEFAULT_RULES))
    head, _ = table_rows(sim_map)
    assert "RTF p50/p90/p99" not in head and "Audio s (med)" not in head and latency_note(sim_map) is None
    assert "E2E p50/p90/p99 (steps)" in head and "latency (real backend" not in stdout

    run = load_run(run_dir)
    real = []
    for i, r in enumerate(run.requests):
        wall = 2.0 + i % 4
        audio = r.num_codec_tokens / 50
        real.append(dataclasses.replace(r, backend="vllm-omni", wall_s=wall, ttfa_s=round(wall / 2, 3),
                                        rtf=round(wall / audio, 4), audio_seconds=audio, sent_step=None,
                                        arrival_step=None, first_token_step=None, finish_step=None))
    run.requests = real
    real_map = build_map(run, load_rules(DEFAULT_RULES))
    head, body = table_rows(real_map)
    for column in ("E2E p50/p90/p99 (s)", "TTFA p50/p90/p99 (s)", "RTF p50/p90/p99", "Audio s (med)",
                   "Dur. ratio (med)", "Truncated", "Overrun"):
        assert column in head, column
    assert head.index("TTFA p50/p90/p99 (s)") + 1 == head.index("RTF p50/p90/p99") == head.index("Audio s (med)") - 1
    assert len(body) == 10 and all(len(row) == len(head) for row in body)
    e2e = head.index("E2E p50/p90/p99 (s)")
    assert [row[e2e] for row in body][:2] == ["3/4/4", "3/5/5"]
    note = latency_note(real_map)
    assert note is not None and "TTFA is not streamed" in note and "first codec token" in note
    assert note in terminal_map(real_map)
    rows = map_json(real_map)["rows"]
    assert all(r["latency"]["unit"] == "s" and r["latency"]["measured"] == 3 and r["audio_seconds_median"] > 0
               for r in rows)
    assert [r["duration"]["truncated"] for r in rows if r["arm"] == "main"] == [0, 2, 2, 0, 0]


def test_time_to_first_codec_reads_the_trace() -> None:
    """Real backend: from the first send to the Talker's first call at a generated position (c >= P)
    during the attempt that answered; none for a failed request or a trace without such a call."""
    from harness.serve.backend import generated_position_time, time_to_first_codec
    from harness.serve.client import ChatResult

    lines = [{"_omni_prompt_len": 10, "_omni_num_computed_tokens": 0, "time": 100.5},
             {"_omni_prompt_len": 10, "_omni_num_computed_tokens": 10, "time": 101.25},
             {"_omni_prompt_len": 10, "_omni_num_computed_tokens": 11, "time": 101.5},
             {"_omni_prompt_len": 10, "_omni_num_computed_tokens": 12, "time": float("nan")},
             {"_omni_prompt_len": 10, "_omni_num_computed_tokens": 13, "time": True}]
    times = [t for line in lines if (t := generated_position_time(line)) is not None]
    assert times == [101.25, 101.5]
    assert time_to_first_codec(ChatResult("p", "t", sent_at=100.0), times) == 1.25
    # a retry: the first attempt's calls do not count
    assert time_to_first_codec(ChatResult("p", "t", sent_at=99.0, answered_attempt_at=101.4), times) == 2.5
    assert time_to_first_codec(ChatResult("p", "t", sent_at=100.0, error="boom"), times) is None
    assert time_to_first_codec(ChatResult("p", "t", sent_at=100.0), []) is None
    assert time_to_first_codec(ChatResult("p", "t"), times) is None


def test_span_json_is_json_dumps_byte_for_byte() -> None:
    import json

    from harness.records import SpanRecord, span_json

    spans = [SpanRecord(arm="main", deploy="stress@mnbt=16,kv=128,load=all", repeat=1, request="p01", step=3, P=80,
                        c=32, n=16, rows=80, misaligned_text=2, misaligned_end=0),
             SpanRecord(arm="a\u00e9\"b", deploy="d\\x", repeat=2, request="\u2603 q", step=0, P=5, c=0, n=5,
                        rows=5, error="raised: \"x\"\n"),
             SpanRecord(arm="m", deploy="d", repeat=1, request="r", step=1, P=5, c=6, n=1, rows=True)]
    odd = SpanRecord(arm="m", deploy="d", repeat=1, request="r", step=1, P=5, c=6, n=1, rows=1)
    odd.extra = 1.5
    for span in [*spans, odd]:
        assert span_json(span) == to_json(span) == json.dumps(dict(vars(span)), sort_keys=True)


def test_streamed_ttfa_is_labelled_measured(tiny_sweep: tuple[Path, str]) -> None:
    """Issue 31 item 3: records with a measured TTFA (``run --stream``: ``stream_ttfa_s``) put it in the
    map labelled measured; a map whose rows mix measured and trace-derived TTFA marks each cell."""
    import dataclasses

    from harness.gate import DEFAULT_RULES, load_rules
    from harness.report.summary import load_run
    from harness.sweep.report import build_map, latency_note, map_json, table_rows

    run_dir, _ = tiny_sweep
    run = load_run(run_dir)
    cleared = dict(sent_step=None, arrival_step=None, first_token_step=None, finish_step=None)
    streamed = [dataclasses.replace(r, backend="vllm-omni", wall_s=4.0, ttfa_s=1.0, stream_ttfa_s=3.0 + i % 2,
                                    rtf=1.0, audio_seconds=4.0, **cleared) for i, r in enumerate(run.requests)]
    run.requests = streamed
    m = build_map(run, load_rules(DEFAULT_RULES))
    head, body = table_rows(m)
    col = head.index("TTFA p50/p90/p99 (s, measured)")
    assert {row[col] for row in body} <= {"3/4/4", "3/3/3", "4/4/4"} and body[0][col] == "3/4/4"
    assert "TTFA is measured (the client asks for stream: true, --stream)" in latency_note(m)
    assert {r["latency"]["ttfa_source"] for r in map_json(m)["rows"]} == {"stream"}

    run.requests = [dataclasses.replace(r, stream_ttfa_s=None) if r.arm == "main" else r for r in streamed]
    mixed = build_map(run, load_rules(DEFAULT_RULES))
    head, body = table_rows(mixed)
    col = head.index("TTFA p50/p90/p99 (s)")
    assert {row[col] for row in body if row[0] == "main"} == {"1/1/1 [trace]"}
    assert all(row[col].endswith(" [stream]") for row in body if row[0] == "pr")
    assert "where marked [stream]" in latency_note(mixed)
