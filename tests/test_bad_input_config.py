"""Bad input in what ``run`` reads before it runs: deploy files, prompt sets, arms files and plugin arms, YAML
(encoding, control characters, duplicate keys, nesting), and the options that name them (docs/robustness.md).
Each through the CLI as a user types it: exit 2 and one line naming the file, the field and the value."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Callable

import pytest
import yaml

from clikit import PLUGINS, SMALL, _records, _run_args, _with_char, assert_one_line_error
from conftest import REPO, SMALL_PROMPTS, invoke_cli, run_cli

STRESS = yaml.safe_load((REPO / "deploy_configs" / "stress.yaml").read_text())


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


def _bytes(tmp: Path, name: str, data: bytes) -> str:
    (tmp / name).write_bytes(data)
    return str(tmp / name)


def _prompts_with(tmp: Path, edit: Callable[[list[dict]], None]) -> str:
    data = copy.deepcopy(SMALL)
    edit(data["prompts"])
    path = tmp / "prompts.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return str(path)


def _set(index: int, key: str, value: str) -> Callable[[list[dict]], None]:
    def edit(prompts: list[dict]) -> None:
        prompts[index][key] = value

    return edit


STRESS_TEXT = (REPO / "deploy_configs" / "stress.yaml").read_text()


def _deploy_more(tmp: Path, name: str = "bad", file: str | None = None, **sections: dict) -> str:
    """The stress deploy with ``sections`` merged in; a value of ``...`` deletes that key."""
    data = yaml.safe_load(STRESS_TEXT)
    data["name"] = name
    for section, values in sections.items():
        for key, value in values.items():
            if value is ...:
                data.setdefault(section, {}).pop(key, None)
            else:
                data.setdefault(section, {})[key] = value
    path = tmp / f"{file or name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


DEEP = "[" * 100_000 + "]" * 100_000


# (case id, extra `run` args given tmp_path, substrings of the one error line)
CASES_MORE: list[tuple[str, Callable[[Path], list[str]], list[str]]] = [
    # F1: a file that is not UTF-8
    ("F1-latin1-deploy", lambda t: ["--deploy", _bytes(t, "latin.yaml", b"name: caf\xe9\n")],
     ["latin.yaml", "line 1", "not UTF-8", "0xe9"]),
    ("F1-binary-deploy", lambda t: ["--deploy", _bytes(t, "bin.yaml", bytes(range(256)) * 4)],
     ["bin.yaml", "not UTF-8"]),
    ("F1-latin1-prompts", lambda t: ["--prompts", _bytes(t, "p.yaml", b"system_prompt: s\nprompts:\n  - id: caf\xe9\n")],
     ["p.yaml", "line 3", "not UTF-8"]),
    ("F1-latin1-arms-file", lambda t: ["--arms-file", _bytes(t, "arms.yaml", b"arms:\n  caf\xe9: {talker: a:b}\n")],
     ["arms.yaml", "not UTF-8"]),
    # F2: nesting that would overflow the YAML reader's recursion
    ("F2-deeply-nested-deploy", lambda t: ["--deploy", _bytes(t, "deep.yaml", DEEP.encode())],
     ["deep.yaml", "nested too deeply"]),
    ("F2-deeply-nested-prompts", lambda t: ["--prompts", _bytes(t, "deep.yaml", ("prompts: " + DEEP).encode())],
     ["deep.yaml", "nested too deeply"]),
    # F3: numbers past what any deploy can mean, refused with the limit
    ("F3-huge-batched-tokens", lambda t: ["--deploy", _deploy_more(t, talker={"max_num_batched_tokens": 10**12})],
     ["bad.yaml", "talker.max_num_batched_tokens", "at most 262144 (8x vLLM-Omni's Talker default", "1000000000000"]),
    ("F3-huge-max-model-len", lambda t: ["--deploy", _deploy_more(t, talker={"max_model_len": 10**9})],
     ["bad.yaml", "talker.max_model_len", "at most 32768"]),
    ("F3-huge-kv-cache", lambda t: ["--deploy", _deploy_more(t, talker={"num_gpu_blocks_override": 10**9})],
     ["bad.yaml", "talker.num_gpu_blocks_override", "at most 262144"]),
    ("F3-huge-default-kv-cache", lambda t: ["--deploy", _deploy_more(t, talker={
        "num_gpu_blocks_override": ..., "block_size": 1, "max_model_len": 32768, "max_num_seqs": 1024,
        "max_num_batched_tokens": 32768})],
     ["bad.yaml", "talker:", "33554433 blocks", "over the limit of 262144"]),
    ("F3-huge-max-tokens", lambda t: ["--deploy", _deploy_more(t, sampling={"max_tokens": 10**7})],
     ["bad.yaml", "sampling.max_tokens", "at most 32768"]),
    ("F3-huge-max-steps", lambda t: ["--deploy", _deploy_more(t, sim={"max_steps": 10**12})],
     ["bad.yaml", "sim.max_steps", "at most 10000000"]),
    # F7: names that become file names
    ("F7-prompt-id-escapes", lambda t: ["--prompts", _prompts_with(t, _set(0, "id", "../../x/ESCAPED"))],
     ["prompts.yaml", "prompts[0].id", "'../../x/ESCAPED' is not a safe name"]),
    ("F7-prompt-id-absolute", lambda t: ["--prompts", _prompts_with(t, _set(1, "id", "/tmp/abs"))],
     ["prompts.yaml", "prompts[1].id", "not a safe name"]),
    ("F7-prompt-id-dotdot", lambda t: ["--prompts", _prompts_with(t, _set(2, "id", ".."))],
     ["prompts.yaml", "prompts[2].id", "not a safe name"]),
    ("F7-arm-name-escapes", lambda t: ["--arm", "../../x=tests.fixtures.plugins:raising_talker"],
     ["--arm '../../x=tests.fixtures.plugins:raising_talker'", "arm name", "not a safe name"]),
    ("F7-deploy-name-escapes", lambda t: ["--deploy", _deploy_more(t, name="../../x", file="ok")],
     ["ok.yaml", "name:", "'../../x' is not a safe name"]),
    # F8: --run-id is one folder inside --out
    ("F8-run-id-escapes", lambda t: ["--run-id", "../../escaped"], ["--run-id", "'../../escaped' is not a safe name"]),
    ("F8-run-id-absolute", lambda t: ["--run-id", str(t / "abs-run")], ["--run-id", "abs-run", "not a safe name"]),
    ("F8-run-id-dotdot", lambda t: ["--run-id", ".."], ["--run-id", "'..' is not a safe name"]),
    # the smaller ones
    ("kv-cache-too-small-for-one-request", lambda t: ["--deploy", _deploy_more(t, talker={"num_gpu_blocks_override": 100})],
     ["bad.yaml", "talker.num_gpu_blocks_override", "100 blocks", "talker.max_model_len 1984", "needs 124"]),
    ("kv-cache-without-max-model-len", lambda t: ["--deploy", _deploy_more(t, talker={"max_model_len": ...})],
     ["bad.yaml", "talker.num_gpu_blocks_override", "sim.default_max_model_len", "needs 2048"]),
    ("vllm-scheduler-rule-batched-below-seqs", lambda t: ["--deploy", _deploy_more(t, talker={"max_num_batched_tokens": 2})],
     ["bad.yaml", "talker.max_num_batched_tokens", "below talker.max_num_seqs 4"]),
    ("vllm-scheduler-rule-no-chunking", lambda t: ["--deploy", _deploy_more(t, talker={"enable_chunked_prefill": False})],
     ["bad.yaml", "talker.max_num_batched_tokens", "32 is below talker.max_model_len 1984",
      "enable_chunked_prefill false"]),
    ("block-size-7", lambda t: ["--deploy", _deploy_more(t, talker={"block_size": 7})],
     ["bad.yaml", "talker.block_size", "one of 1, 8, 16, 32, 64, 128, 256", "got 7"]),
    ("duplicate-yaml-key", lambda t: ["--deploy", _bytes(t, "dup.yaml", STRESS_TEXT.replace(
        "  max_num_seqs: 4\n", "  max_num_seqs: 4\n  max_num_seqs: 1\n", 1).encode())],
     ["dup.yaml", "duplicate key 'max_num_seqs'", "first given on line"]),
    ("duplicate-prompt-key", lambda t: ["--prompts", _bytes(t, "p.yaml", b"system_prompt: a\nsystem_prompt: b\n")],
     ["p.yaml", "line 2", "duplicate key 'system_prompt' (first given on line 1)"]),
    ("seed-negative-cli", lambda t: ["--seed", "-1"], ["'--seed'", "-1 is not in the range 0<=x<=4294967295"]),
    ("seed-too-large-deploy", lambda t: ["--deploy", _deploy_more(t, sampling={"seed": 2**40})],
     ["bad.yaml", "sampling.seed", "at most 4294967295"]),
    ("seed-negative-deploy", lambda t: ["--deploy", _deploy_more(t, sampling={"seed": -1})],
     ["bad.yaml", "sampling.seed", "an integer >= 0, got -1"]),
    ("reply-in-cyrillic", lambda t: ["--prompts", _prompts_with(t, _set(0, "reply", "Привет, как дела?"))],
     ["prompts.yaml", "prompts[0].reply", "'П'", "not Latin script", "English"]),
    ("reply-in-chinese", lambda t: ["--prompts", _prompts_with(t, _set(3, "reply", "The moon 月亮 is bright."))],
     ["prompts.yaml", "prompts[3].reply", "'月'", "not Latin script"]),
    # issue 45, item 3: a prompt's voice is one the family's release knows, and only a family with voices takes one
    ("unknown-speaker", lambda t: ["--family", "qwen3-tts", "--arm", "tts-fix", "--deploy", "qwen3-tts-reference",
                                   "--prompts", _text(t, "voices.yaml", "family: qwen3-tts\nprompts:\n  - id: a\n"
                                                      "    text: Hello there.\n  - id: b\n    text: Good night.\n"
                                                      "    speaker: Bob\n")],
     ["voices.yaml", "prompts[1].speaker", "unknown speaker 'Bob'", "knows Vivian, Serena, Uncle_Fu"]),
    ("speaker-of-a-family-without-voices", lambda t: ["--prompts", _prompts_with(t, _set(2, "speaker", "Vivian"))],
     ["prompts.yaml", "prompts[2].speaker", "unknown key"]),
    ("set-speaker-of-a-family-without-voices",
     lambda t: ["--prompts", _text(t, "p.yaml", "system_prompt: s\nspeaker: Vivian\nprompts:\n  - id: a\n"
                                                "    user: Hi.\n    reply: Hello there.\n")],
     ["p.yaml", "speaker", "family 'qwen2.5-omni' takes no speaker in a prompt set"]),
    # issue 45, item 3: a Base voice (speaker_embedding) is a vector of numbers, of one length in a set, on every prompt
    # of a set that gives one, never beside a CustomVoice speaker, and only in a family whose Base model takes one
    ("speaker-embedding-and-speaker", lambda t: _tts(t, "    speaker_embedding: [1, 2]\n    speaker: Ryan\n"),
     ["voices.yaml", "prompts[1].speaker_embedding", "speaker: (a CustomVoice checkpoint's voice) or "
      "speaker_embedding: (a Base checkpoint's), not both"]),
    ("speaker-embedding-on-one-prompt-only", lambda t: _tts(t, "    speaker_embedding: [1, 2]\n"),
     ["voices.yaml", "prompts[0].speaker_embedding", "missing; prompts[1] gives its voice as a speaker embedding"]),
    ("speaker-embedding-not-numbers", lambda t: _tts(t, "    speaker_embedding: [1, two]\n"),
     ["voices.yaml", "prompts[1].speaker_embedding", "must be numbers, got 'two'"]),
    ("speaker-embedding-not-finite", lambda t: _tts(t, "    speaker_embedding: [1, .nan]\n"),
     ["voices.yaml", "prompts[1].speaker_embedding", "values must be finite"]),
    ("speaker-embedding-missing-file", lambda t: _tts(t, "    speaker_embedding: nowhere.npy\n"),
     ["voices.yaml", "prompts[1].speaker_embedding", "nowhere.npy: cannot be read as .npy"]),
    ("speaker-embedding-of-a-family-without-base",
     lambda t: ["--prompts", _text(t, "p.yaml", "system_prompt: s\nspeaker_embedding: [1.0]\nprompts:\n  - id: a\n"
                                                "    user: Hi.\n    reply: Hello there.\n")],
     ["p.yaml", "speaker_embedding", "family 'qwen2.5-omni' takes no speaker embedding in a prompt set"]),
]


def _tts(tmp: Path, second: str) -> list[str]:
    """A two-prompt Qwen3-TTS set whose second prompt ends with ``second`` (its voice fields), on the sim."""
    return ["--family", "qwen3-tts", "--arm", "tts-fix", "--deploy", "qwen3-tts-reference",
            "--prompts", _text(tmp, "voices.yaml", "family: qwen3-tts\nprompts:\n  - id: a\n    text: Hello there.\n"
                                                   "  - id: b\n    text: Good night.\n" + second)]


def _outside(tmp: Path, out: Path) -> set[str]:
    """Everything under tmp except the test's own inputs and the --out folder."""
    return {str(p.relative_to(tmp)) for p in tmp.rglob("*") if out not in p.parents and p != out}


@pytest.mark.parametrize("case", CASES_MORE, ids=[c[0] for c in CASES_MORE])
def test_more_bad_input_exits_2_with_one_line(case, tmp_path):
    _, make_args, needles = case
    inputs = tmp_path / "in"
    inputs.mkdir()
    out = tmp_path / "work" / "results"
    before = _outside(tmp_path, out)
    args = ["run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(out),
            *make_args(inputs)]
    assert_one_line_error(invoke_cli(*args), *needles)
    assert not out.exists() or not any(out.iterdir()), "refused before a run directory exists"
    made = _outside(tmp_path, out) - before - {str(p.relative_to(tmp_path)) for p in inputs.rglob("*")}
    assert made == set(), f"written outside --out: {made}"
    assert not (tmp_path.parent / "escaped").exists() and not (tmp_path / "x").exists()


def test_deep_nesting_is_fast(tmp_path):
    """F2: the refusal costs no more than reading the file (no 100,000-level recursion retried)."""
    import time

    from harness.config import load_yaml
    from harness.errors import ConfigError

    path = tmp_path / "deep.yaml"
    path.write_text(DEEP)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_yaml(path)
    assert time.perf_counter() - t0 < 10


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    """A '<<' merge overridden by an explicit key is YAML's intent, not a duplicate."""
    from harness.config import load_yaml

    path = tmp_path / "m.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nover:\n  <<: *b\n  x: 3\n")
    assert load_yaml(path) == {"base": {"x": 1, "y": 2}, "over": {"x": 3, "y": 2}}


def test_shipped_configs_still_load():
    from harness.config import load_arms, load_deploy, load_prompts

    for name in ("reference", "stress", "specdec"):
        load_deploy(name)
    for name in ("default", "long_inputs"):
        load_prompts(name)
    assert {"main", "pr"} <= set(load_arms())


def test_subprocess_one_line_for_a_latin1_deploy(tmp_path):
    """F1 through the installed entry point, not just the in-process runner."""
    path = tmp_path / "latin.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    res = run_cli("run", "--asr", "none", "--quiet", "--out", str(tmp_path / "out"), "--deploy", str(path),
                  timeout=900)
    assert_one_line_error(res, "latin.yaml", "not UTF-8")
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path) == ["latin.yaml"]


def test_vllm_scheduler_refusal_is_one_line_before_the_run_directory(tmp_path, monkeypatch):
    """Whatever else vLLM's SchedulerConfig refuses (its messages span lines) is found by the
    pre-flight, said on one line naming the deploy file, before any run directory exists."""
    import vllm.config

    def refuse(**_kwargs):
        raise ValueError("max_num_batched_tokens (32) is\nsmaller than something.\nPlease increase it.")

    monkeypatch.setattr(vllm.config, "SchedulerConfig", refuse)
    out = tmp_path / "out"
    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(out),
                     "--deploy", "stress")
    assert_one_line_error(res, "stress.yaml: talker: vLLM rejects these scheduler settings:",
                          "max_num_batched_tokens (32) is smaller than something. Please increase it.")
    assert not out.exists()


ARMS_TEXT = (REPO / "deploy_configs" / "arms.yaml").read_text()


CONTROL = [("nul", "\x00", "U+0000 (NUL)"), ("ansi-escape", "\x1b[31m", "U+001B (ESC"),
           ("form-feed", "\x0c", "U+000C (form feed)")]


@pytest.mark.parametrize("which", ["deploy", "prompts", "arms-file"])
@pytest.mark.parametrize("name,ch,said", CONTROL, ids=[c[0] for c in CONTROL])
def test_1_control_character_in_a_config_names_file_line_and_character(tmp_path, which, name, ch, said):
    source = {"deploy": STRESS_TEXT, "prompts": SMALL_PROMPTS.read_text(), "arms-file": ARMS_TEXT}[which]
    path = tmp_path / f"{which}.yaml"
    path.write_bytes(_with_char(source, ch, 3).encode())
    res = invoke_cli(*_run_args(tmp_path, f"--{which}", str(path)))
    line = assert_one_line_error(res, f"{path}: line 3 column ", said, "not allowed in YAML")
    assert "\x1b" not in line and "\x00" not in line and "\x0c" not in line  # the character itself is never echoed
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 12: YAML values in messages


def _alias_bomb(levels: int) -> str:
    """``arms.x.talker`` a list that expands to 9**levels strings from a few hundred bytes."""
    lines = ["arms:", "  x:", '    talker: [&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"],']
    for k in range(1, levels + 1):
        lines.append(f"      &a{k} [" + ",".join([f"*a{k - 1}"] * 9) + "]" + ("," if k < levels else "]"))
    return "\n".join(lines) + "\n"


def test_12_alias_bomb_in_arms_file_gives_a_short_line(tmp_path):
    path = tmp_path / "arms.yaml"
    path.write_text(_alias_bomb(8))  # 9**8 = 43 million strings: a full repr is ~350 MB
    assert path.stat().st_size < 600
    res = invoke_cli(*_run_args(tmp_path, "--arms-file", str(path), "--arm", "x"))
    line = assert_one_line_error(res, f"{path}: arms.x.talker: must be a non-empty string, got [[")
    assert len(line) < 200 + len(f"omni-stress: error: {path}: arms.x.talker: must be a non-empty string, got ") + 10
    assert line.endswith("...")


def test_12_long_string_value_is_cut(tmp_path):
    deploy = yaml.safe_load(STRESS_TEXT)
    deploy["talker"]["max_num_seqs"] = "x" * 100_000
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(deploy))
    line = assert_one_line_error(invoke_cli(*_run_args(tmp_path, "--deploy", str(path))),
                                 "long.yaml: talker.max_num_seqs: must be a positive integer, got 'xxx")
    assert len(line) < 400


# ----------------------------------------------------------------------------- 14: replies the sim would mis-score

CASE_14 = [
    ("decimal", "It is 3.5 miles to the station.",
     "number '3.5' is spoken by the sim as '3 5' while WER scoring reads it whole; write the number in words"),
    ("thousands", "About 1,000 people came.",
     "number '1,000' is spoken by the sim as '1 000' while WER scoring reads it whole"),
    ("accent", "Meet me at the café tomorrow.",
     "letter 'é' (U+00E9, latin small letter e with acute) in 'café': the sim speaks ASCII letters only and would "
     "split or drop it while WER scoring reads 'cafe'; write 'cafe'"),
    ("dollar", "It costs $25 today.",
     "symbol '$' (U+0024, dollar sign): the sim does not speak it while WER scoring keeps it; write it as a word "
     "('dollars')"),
    ("percent", "Take 50% of it.",
     "symbol '%' (U+0025, percent sign): the sim does not speak it while WER scoring keeps it; write it as a word "
     "('percent')"),
    ("zero-width-space", "The wea\u200bther is fine.",
     "invisible character U+200B (zero width space): the sim splits the word there while WER scoring keeps it "
     "inside the word; remove it"),
    ("ellipsis", "...",
     "ellipsis '...': WER scoring can keep it as a word ('.') that the sim never says; write one period or a comma"),
    ("ellipsis-char", "Well\u2026 maybe.", "ellipsis '\u2026'"),
]


def _reply_set(tmp: Path, reply: str) -> Path:
    data = copy.deepcopy(SMALL)
    data["prompts"] = data["prompts"][:2]
    data["prompts"][1]["reply"] = reply
    path = tmp / "replies.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return path


@pytest.mark.parametrize("reply,said", [c[1:] for c in CASE_14], ids=[c[0] for c in CASE_14])
def test_14_a_reply_the_sim_cannot_say_as_scored_is_refused_at_load(tmp_path, reply, said):
    path = _reply_set(tmp_path, reply)
    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(path), "--out", str(tmp_path / "out"))
    line = assert_one_line_error(res, f"{path}: prompts[1].reply: {said}")
    assert "\u200b" not in line  # an invisible character is named, never echoed
    assert not (tmp_path / "out").exists()


def test_14_what_only_the_normaliser_shows_is_refused_before_the_run(tmp_path):
    # Whisper's normaliser drops text in square brackets; the sim says it
    path = _reply_set(tmp_path, "Sure. Hello [note] there, my friend, how are you today.")
    res = invoke_cli("run", "--asr", "none", "--quiet", "--prompts", str(path), "--out", str(tmp_path / "out"))
    assert_one_line_error(res, f"{path}: prompts[1].reply: WER scoring reads 'sure hello there my friend how ...' "
                               "where the sim says 'sure hello note there my friend ...', so a correct arm would "
                               f"not score 0 (prompt {SMALL['prompts'][1]['id']!r}); rewrite the reply as plain words")
    assert not (tmp_path / "out").exists()


def test_14_ordinary_english_that_is_accepted_scores_zero_for_the_fix(tmp_path):
    reply = ("It's 25 degrees, so wear a well-known coat: Mr. Smith's shop opens at 5pm, 1, 2, 3 days a week! "
             "Bring the \u201cgood\u201d umbrella; it\u2019s 3/4 full. Yes? The 1st road, the main one, "
             "is 10-15 minutes away, and it's #1 for a reason.")
    path = _reply_set(tmp_path, reply)
    res = invoke_cli("run", "--asr", "none", "--quiet", "--arm", "pr", "--deploy", "reference", "--prompts", str(path),
                     "--out", str(tmp_path / "out"), "--run-id", "r")
    assert res.exit_code == 0, res.stderr
    records = _records(tmp_path / "out" / "r")
    assert [r["oracle_wer"] for r in records] == [0.0, 0.0]


def test_14_shipped_prompt_sets_pass_unchanged():
    from harness.config import load_prompts
    from harness.families.qwen2_5_omni.sim import check_prompts

    for path in sorted((REPO / "prompts").glob("*.yaml")) + sorted((REPO / "tests" / "fixtures").glob("prompts_*.yaml")):
        check_prompts(load_prompts(str(path)), "words")
