"""Bad input through the CLI, as a user types it: exit code 2, one line naming the file/field/value,
no traceback; and arms that raise, which fail their requests (recorded) but never the run.

Every table case fails before anything is simulated (config load or pre-flight), so the table is
fast; the in-process CLI (click's CliRunner on ``harness.cli.main``) runs the same code as the
``omni-stress`` executable without an interpreter start-up per case.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Callable

import pytest
import yaml
from conftest import REPO, SMALL_PROMPTS, CliResult, invoke_cli

from harness.records import read_requests

STRESS = yaml.safe_load((REPO / "deploy_configs" / "stress.yaml").read_text())
SMALL = yaml.safe_load(SMALL_PROMPTS.read_text())
PLUGINS = "tests.fixtures.plugins"


def _deploy(tmp: Path, name: str = "bad", **sections: dict) -> str:
    """The stress deploy with ``sections`` merged in (a value of ``...`` deletes the key)."""
    data = copy.deepcopy(STRESS)
    data["name"] = name
    for section, values in sections.items():
        if not isinstance(values, dict):
            data[section] = values
            continue
        data.setdefault(section, {}).update(values)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _prompts(tmp: Path, edit: Callable[[list[dict]], None]) -> str:
    data = copy.deepcopy(SMALL)
    edit(data["prompts"])
    path = tmp / "prompts.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _text(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def _run_dir_with(tmp: Path, manifest: str | None) -> str:
    d = tmp / "old-run"
    d.mkdir()
    if manifest is not None:
        (d / "manifest.json").write_text(manifest)
    return str(d)


def _file(tmp: Path) -> str:
    (tmp / "a-file").write_text("not a folder")
    return str(tmp / "a-file")


def _empty_dir(tmp: Path) -> str:
    (tmp / "empty").mkdir()
    return str(tmp / "empty")


def _long_reply(prompts: list[dict]) -> None:
    prompts[0]["reply"] = " ".join(["word"] * 81)


def _drop_reply(prompts: list[dict]) -> None:
    del prompts[1]["reply"]


def _dup_id(prompts: list[dict]) -> None:
    prompts[1]["id"] = prompts[0]["id"]


# (case id, extra CLI args given tmp_path, substrings the one error line must contain)
CASES: list[tuple[str, Callable[[Path], list[str]], list[str]]] = [
    ("malformed-yaml-deploy", lambda t: ["--deploy", _text(t, "broken.yaml", "talker: [max_num_seqs: 4\n")],
     ["broken.yaml", "line 2", "malformed YAML"]),
    ("malformed-yaml-prompts", lambda t: ["--prompts", _text(t, "p.yaml", "prompts:\n  - id: a\n   user: x\n")],
     ["p.yaml", "malformed YAML"]),
    ("deploy-not-a-mapping", lambda t: ["--deploy", _text(t, "list.yaml", "- a\n- b\n")],
     ["list.yaml", "top level", "expected a mapping, got list"]),
    ("unknown-arm", lambda t: ["--arm", "mian"], ["--arm 'mian'", "unknown arm", "known: main"]),
    ("unknown-deploy", lambda t: ["--deploy", "strss"], ["unknown deploy 'strss'", "known: ", "reference", "stress"]),
    ("deploy-file-missing", lambda t: ["--deploy", str(t / "nope.yaml")], ["nope.yaml", "not found"]),
    ("unknown-prompt-set", lambda t: ["--prompts", "defualt"], ["unknown prompt set 'defualt'"]),
    ("missing-prompt-field", lambda t: ["--prompts", _prompts(t, _drop_reply)],
     ["prompts.yaml", "prompts[1].reply", "missing required field"]),
    ("duplicate-prompt-id", lambda t: ["--prompts", _prompts(t, _dup_id)],
     ["prompts.yaml", "prompts[1].id", "duplicate prompt id 'p01-weather'"]),
    ("reply-over-token-limit", lambda t: ["--prompts", _prompts(t, _long_reply)],
     ["prompts.yaml", "prompts[0].reply", "81 tokens", "limit of 80"]),
    ("empty-prompt-list", lambda t: ["--prompts", _text(t, "p.yaml", "system_prompt: s\nprompts: []\n")],
     ["p.yaml", "prompts", "non-empty list"]),
    ("zero-max-num-seqs", lambda t: ["--deploy", _deploy(t, talker={"max_num_seqs": 0})],
     ["bad.yaml", "talker.max_num_seqs", "positive integer, got 0"]),
    ("negative-batched-tokens", lambda t: ["--deploy", _deploy(t, talker={"max_num_batched_tokens": -32})],
     ["bad.yaml", "talker.max_num_batched_tokens", "got -32"]),
    ("one-kv-block", lambda t: ["--deploy", _deploy(t, talker={"num_gpu_blocks_override": 1})],
     ["bad.yaml", "talker.num_gpu_blocks_override", ">= 2"]),
    ("zero-max-tokens", lambda t: ["--deploy", _deploy(t, sampling={"max_tokens": 0})],
     ["bad.yaml", "sampling.max_tokens", "got 0"]),
    ("negative-temperature", lambda t: ["--deploy", _deploy(t, sampling={"temperature": -0.5})],
     ["bad.yaml", "sampling.temperature", "got -0.5"]),
    ("zero-top-p", lambda t: ["--deploy", _deploy(t, sampling={"top_p": 0})],
     ["bad.yaml", "sampling.top_p", "got 0"]),
    ("not-a-number", lambda t: ["--deploy", _deploy(t, talker={"max_num_seqs": "four"})],
     ["bad.yaml", "talker.max_num_seqs", "'four'"]),
    ("typo-key-in-deploy", lambda t: ["--deploy", _deploy(t, talker={"max_num_seq": 4})],
     ["bad.yaml", "talker.max_num_seq", "unknown key", "max_num_seqs"]),
    ("typo-top-level-key", lambda t: ["--deploy", _deploy(t, talkr={"max_num_seqs": 4})],
     ["bad.yaml", "talkr", "unknown key"]),
    ("duplicate-deploy-names", lambda t: ["--deploy", "stress", "--deploy", _deploy(t, name="stress")],
     ["--deploy", "unique", "stress, stress"]),
    ("arms-file-missing", lambda t: ["--arms-file", str(t / "arms.yaml")], ["arms.yaml", "file not found"]),
    ("arms-file-talker-without-attr", lambda t: ["--arms-file", _text(t, "arms.yaml", "arms:\n  fix:\n    talker: mypkg.fix\n"),
                                                 "--arm", "fix"],
     ["arms.yaml", "arms.fix.talker", "'package.module:attr'", "'mypkg.fix'"]),
    ("plugin-module-not-found", lambda t: ["--arm", "x=tests.fixtures.no_such_module:f"],
     ["arm 'x'", "cannot import module 'tests.fixtures.no_such_module'", "ModuleNotFoundError"]),
    ("plugin-module-fails-import", lambda t: ["--arm", "x=tests.fixtures.broken_import:f"],
     ["arm 'x'", "tests.fixtures.broken_import", "ImportError", "broken on purpose"]),
    ("plugin-attr-missing", lambda t: ["--arm", f"x={PLUGINS}:missing"], ["arm 'x'", "no attribute 'missing'"]),
    ("plugin-attr-not-callable", lambda t: ["--arm", f"x={PLUGINS}:NOT_CALLABLE"],
     ["arm 'x'", "'NOT_CALLABLE' is not callable"]),
    ("plugin-class-without-preprocess", lambda t: ["--arm", f"x={PLUGINS}:NoPreprocess"],
     ["arm 'x'", "'NoPreprocess' has no talker_preprocess"]),
    ("plugin-arm-syntax", lambda t: ["--arm", "x=tests.fixtures.plugins"],
     ["--arm 'x=tests.fixtures.plugins'", "NAME=package.module:attr"]),
    ("duplicate-arm-names", lambda t: ["--arm", "main", "--arm", f"main={PLUGINS}:RaisesOnPrompt"],
     ["--arm", "unique", "main, main"]),
    ("asr-checkpoint-missing", lambda t: ["--asr", "openai-whisper", "--asr-model", str(t / "models" / "base.pt")],
     ["--asr-model", "base.pt", "not found"]),
    ("asr-model-folder-without-model", lambda t: ["--asr", "faster-whisper", "--asr-model", _empty_dir(t)],
     ["--asr-model", "empty", "no model.bin"]),
    ("out-is-a-file", lambda t: ["--out", _file(t)], ["--out", "a-file", "not writable"]),
    ("resume-not-a-run-dir", lambda t: ["--resume", _run_dir_with(t, None)],
     ["--resume", "old-run", "not a run directory (no manifest.json)"]),
    ("resume-missing-dir", lambda t: ["--resume", str(t / "never-ran")], ["--resume", "never-ran", "not a run directory"]),
    ("resume-unreadable-manifest", lambda t: ["--resume", _run_dir_with(t, "{ torn")],
     ["old-run", "manifest.json", "unreadable manifest"]),
    ("dry-run-with-sim", lambda t: ["--dry-run"], ["--dry-run applies to --backend vllm-omni"]),
    ("vllm-omni-arm-without-serve-and-no-real-env",
     lambda t: ["--backend", "vllm-omni", "--serve-python", str(t / "no-venv" / "python"),
                "--arm", f"plug={PLUGINS}:raising_talker"],
     ["arm 'plug': interpreter", "no-venv/python' not found", "scripts/install-real-cpu.sh"]),
    ("option-value-out-of-range", lambda t: ["--repeat", "0"],
     ["Invalid value for '--repeat': 0 is not in the range 1<=x<=100.", "(see 'omni-stress run --help')"]),
    ("unknown-option", lambda t: ["--arms", "main"],
     ["No such option '--arms'", "(see 'omni-stress run --help')"]),
]


def assert_one_line_error(res: CliResult, *needles: str) -> str:
    """Exit 2, nothing on stderr but ``omni-stress: error: ...`` on one line, no traceback."""
    assert res.exit_code == 2, (res.exit_code, res.stderr, res.stdout[-2000:])
    assert "Traceback" not in res.stderr + res.stdout
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    line = lines[0]
    assert line.startswith("omni-stress: error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line(case, tmp_path):
    _, make_args, needles = case
    out = tmp_path / "results"
    args = ["run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(out),
            *make_args(tmp_path)]
    assert_one_line_error(invoke_cli(*args), *needles)
    if "--resume" not in args:  # refused before any run directory was made
        assert not out.exists() or not any(out.iterdir())


def test_table_is_large_enough():
    assert len(CASES) >= 20


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(ro))
        assert_one_line_error(res, "--out", "ro", "not writable")
    finally:
        ro.chmod(0o700)


def test_prompt_longer_than_max_model_len_is_refused_during_the_run(tmp_path):
    """Found only once the Thinker has tokenised the prompt: still one line and exit 2."""
    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path),
                     "--deploy", _deploy(tmp_path, name="short", talker={"max_model_len": 40}))
    assert_one_line_error(res, "prompt 'p01-weather'", "Talker prompt length 61", "short.yaml",
                          "talker.max_model_len 40")


def test_subprocess_cli_prints_one_line_too(tmp_path):
    """The installed entry point, not just the in-process runner."""
    from conftest import run_cli

    res = run_cli("run", "--asr", "none", "--quiet", "--out", str(tmp_path),
                  "--deploy", _deploy(tmp_path, talker={"max_num_seq": 4}), timeout=900)
    assert_one_line_error(res, "bad.yaml", "talker.max_num_seq", "unknown key")


# ----------------------------------------------------------------------------- arms that raise


def test_raising_arms_fail_their_requests_and_the_run_goes_on(tmp_path, small_run):
    """A plugin raising on every call fails all of its requests, one raising on one prompt fails that
    request only; both are recorded with the exception text, the table counts them, and the other
    arm's records are exactly those of a run without the raising arms."""
    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path),
                     "--run-id", "r", "--deploy", "stress", "--arm", f"boom={PLUGINS}:raising_talker",
                     "--arm", f"half={PLUGINS}:RaisesOnPrompt", "--arm", "pr")
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    records = read_requests(tmp_path / "r")
    by_arm: dict[str, dict] = {}
    for r in records:
        by_arm.setdefault(r.arm, {})[r.prompt_id] = r
    ids = [p["id"] for p in SMALL["prompts"]]
    assert {a: sorted(v) for a, v in by_arm.items()} == {a: sorted(ids) for a in ("boom", "half", "pr")}
    assert all(r.error == "RuntimeError: plugin arm exploded on purpose" and r.finish_reason == "abort"
               and r.codec_tokens == [] for r in by_arm["boom"].values())
    assert by_arm["half"]["p03-sleep"].error == "ValueError: no rows for p03-sleep"
    assert [pid for pid, r in by_arm["half"].items() if r.error] == ["p03-sleep"]
    assert all(r.oracle_wer == 0.0 for pid, r in by_arm["half"].items() if pid != "p03-sleep")
    reference = {r.prompt_id: r for r in read_requests(small_run) if (r.arm, r.deploy) == ("pr", "stress")}
    assert all(by_arm["pr"][pid].codec_tokens == reference[pid].codec_tokens for pid in ids)
    assert all(r.error is None for r in by_arm["pr"].values())
    errors_col = _errors_column(res.stdout)
    assert errors_col == {"boom": 4, "half": 1, "pr": 0}


def _errors_column(table: str) -> dict[str, int]:
    """The Errors column of the extended terminal table, by arm (cells sliced by the ``----`` rule)."""
    import re

    lines = table.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("Arm ") and "Errors" in ln)
    at = lines[header].index("Errors")
    spans = [m.span() for m in re.finditer(r"-+", lines[header + 1])]
    lo, hi = next((a, b) for a, b in spans if a <= at < b)
    out = {}
    for ln in lines[header + 2:]:
        if not ln.strip():
            break
        out[ln.split()[0]] = int(ln[lo:hi])
    return out


# ----------------------------------------------------------------------------- real backend, fake server


@pytest.fixture
def fake_arms(tmp_path):
    """An arms file whose arm ``main`` serves with the fake ``vllm`` of tests/fake_vllm (``FAKE_VLLM_*`` env)."""

    def write(**env: str) -> str:
        fake = REPO / "tests" / "fake_vllm" / "fake_vllm_serve.py"
        # the fake is "an installed vLLM-Omni as it is": no arm bound into it, no contract check on its rows
        arms = {"arms": {"main": {"talker": "harness.talkers.main:MainTalker",
                                  "serve": {"command": [sys.executable, str(fake)], "bind_arm": False,
                                            "env": {"OMNI_STRESS_CONTRACT": "0", **env}}}}}
        path = tmp_path / "arms.yaml"
        path.write_text(yaml.safe_dump(arms))
        return str(path)

    return write


def _serve(tmp: Path, arms_file: str, *extra: str) -> CliResult:
    return invoke_cli("run", "--backend", "vllm-omni", "--model", "fake/model", "--arms-file", arms_file,
                      "--arm", "main", "--deploy", "stress", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS),
                      "--out", str(tmp / "out"), "--run-id", "r", "--request-timeout", "20", *extra)


def _serve_error(res: CliResult) -> str:
    """The real backend's failures: exit 2, one ``omni-stress: error:`` line, then the server log's tail."""
    assert res.exit_code == 2, (res.stderr, res.stdout[-2000:])
    assert "Traceback" not in res.stderr + res.stdout
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("omni-stress: error: ")]
    assert len(errors) == 1, res.stderr
    tail = res.stderr.split(errors[0], 1)[1].splitlines()[1:]
    assert not tail or tail[0].startswith("--- last lines of server-main-stress.log"), res.stderr
    return errors[0]


@pytest.mark.slow
def test_vllm_omni_server_never_healthy(tmp_path, fake_arms):
    line = _serve_error(_serve(tmp_path, fake_arms(FAKE_VLLM_NEVER_HEALTHY="1"), "--health-timeout", "1.5"))
    assert "did not become healthy within 1.5 s" in line and "server-main-stress.log" in line


@pytest.mark.slow
def test_vllm_omni_server_dies_mid_run_keeps_records(tmp_path, fake_arms):
    line = _serve_error(_serve(tmp_path, fake_arms(FAKE_VLLM_DIE_AFTER="1")))
    assert "exited with code 3 during the run (1/4 requests completed)" in line
    records = read_requests(tmp_path / "out" / "r")
    assert len(records) == 4 and sum(r.error is None for r in records) == 1
    assert all("server exited with code 3" in r.error for r in records if r.error)


@pytest.mark.slow
def test_vllm_omni_malformed_body_and_undecodable_audio_are_request_errors(tmp_path, fake_arms):
    res = _serve(tmp_path, fake_arms(FAKE_VLLM_MALFORMED="p03-sleep", FAKE_VLLM_BAD_AUDIO="p05-garden"))
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    records = {r.prompt_id: r for r in read_requests(tmp_path / "out" / "r")}
    assert sorted(pid for pid, r in records.items() if r.error) == ["p03-sleep", "p05-garden"]
    assert _errors_column(res.stdout) == {"main": 2}
