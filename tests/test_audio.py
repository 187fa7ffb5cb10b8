"""Audio path: espeak-ng TTS, Whisper ASR (tiny.en, loaded once), transcript cache, CLI."""

from __future__ import annotations

import hashlib
import os
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from harness.audio import asr as asr_mod
from harness.audio import tts as tts_mod
from harness.audio.asr import FasterWhisperTranscriber, make_transcriber
from harness.audio.cache import AudioCache, TranscriptCache, sha256_file
from harness.audio.pipeline import transcribe_and_score
from harness.audio.tts import (
    EMPTY_SECONDS,
    LEAD_SECONDS,
    PAUSE,
    PAUSE_SECONDS,
    SAMPLE_RATE,
    Voice,
    espeak_identity,
    speak,
    speak_key,
    units_from_text,
)
from harness.cli import main
from harness.errors import UserError
from harness.audio.scoring import wer

SENTENCES = [
    "Keep your room dark, quiet and cool.",
    "Mix four cups of flour with a spoon of salt.",
    "Plan to stop every two hours to stretch and change drivers.",
]


def read_wav(path: Path) -> tuple[wave._wave_params, np.ndarray]:
    with wave.open(str(path), "rb") as w:
        return w.getparams(), np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


@pytest.fixture(scope="module")
def tiny() -> FasterWhisperTranscriber:
    tr = make_transcriber("faster-whisper", "tiny.en", beam_size=1)
    assert isinstance(tr, FasterWhisperTranscriber)
    return tr


@pytest.fixture(scope="module")
def wavs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Speech for SENTENCES, and 2 s of pure silence, synthesised once."""
    folder = tmp_path_factory.mktemp("wavs")
    out = {}
    for i, text in enumerate(SENTENCES):
        out[f"s{i}"] = folder / f"s{i}.wav"
        speak(units_from_text(text), out[f"s{i}"])
    out["silence"] = folder / "silence.wav"
    speak([PAUSE] * 8, out["silence"])
    return out


# --------------------------------------------------------------------------- TTS


def test_speak_writes_24khz_mono_16bit(tmp_path: Path) -> None:
    path = tmp_path / "a" / "hello.wav"
    seconds = speak(["hello", "there"], path)
    params, samples = read_wav(path)
    assert (params.nchannels, params.sampwidth, params.framerate) == (1, 2, SAMPLE_RATE)
    assert seconds == pytest.approx(params.nframes / SAMPLE_RATE)
    assert 0.5 < seconds < 3.0
    assert np.abs(samples).max() > 1000  # audible speech
    assert not list(tmp_path.glob("a/.*.tmp"))  # written atomically, no leftovers


def test_speak_is_deterministic(tmp_path: Path) -> None:
    units = ["the", "moon", PAUSE, "gra", "vok", "is", "round"]
    speak(units, tmp_path / "a.wav")
    speak(["something", "else", "first"], tmp_path / "other.wav")  # espeak state must not leak
    speak(units, tmp_path / "b.wav")
    assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "b.wav").read_bytes()


def test_pause_is_silence(tmp_path: Path) -> None:
    speak(["hello", "world"], tmp_path / "w.wav")
    speak(["hello", PAUSE, "world"], tmp_path / "p.wav")
    _, words = read_wav(tmp_path / "w.wav")
    _, paused = read_wav(tmp_path / "p.wav")
    assert paused.size > words.size + round(PAUSE_SECONDS * SAMPLE_RATE) // 2
    assert not paused[: round(LEAD_SECONDS * SAMPLE_RATE)].any()  # lead-in silence
    # somewhere after the first word: a run of exact zeros at least PAUSE_SECONDS long
    edges = np.diff(np.concatenate([[0], (paused == 0).astype(np.int8), [0]]))
    runs = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
    assert runs[1:].max() >= round(PAUSE_SECONDS * SAMPLE_RATE)
    seconds = speak([PAUSE, PAUSE], tmp_path / "only.wav")
    _, only = read_wav(tmp_path / "only.wav")
    assert seconds == pytest.approx(LEAD_SECONDS + 2 * PAUSE_SECONDS) and not only.any()


def test_empty_units_give_short_silence(tmp_path: Path) -> None:
    assert speak([], tmp_path / "e.wav") == EMPTY_SECONDS
    _, samples = read_wav(tmp_path / "e.wav")
    assert samples.size == EMPTY_SECONDS * SAMPLE_RATE and not samples.any()


def test_units_from_text() -> None:
    assert units_from_text("Hi, it's me.") == ["Hi", PAUSE, "it's", "me", PAUSE]


# --------------------------------------------------------------------------- TTS audio cache

CACHED_UNITS = ["the", "moon", PAUSE, "is", "round"]


def count_espeak(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts real espeak-ng worker calls (one per uncached ``speak``)."""
    calls: list[int] = []
    real = tts_mod.espeak_segments

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tts_mod, "espeak_segments", counted)
    return calls


def forbid_espeak(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("espeak-ng was called on a cache hit")

    monkeypatch.setattr(tts_mod, "espeak_segments", refuse)


def test_tts_cache_hit_is_identical_and_skips_espeak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh_seconds = speak(CACHED_UNITS, tmp_path / "fresh.wav")  # no cache: plain synthesis
    cache = AudioCache(tmp_path / "tts")
    assert speak(CACHED_UNITS, tmp_path / "miss.wav", cache=cache) == fresh_seconds
    assert (cache.hits, cache.misses) == (0, 1)
    key = speak_key(CACHED_UNITS)
    entry = tmp_path / "tts" / key[:2] / f"{key}.wav"
    assert entry.read_bytes() == (tmp_path / "fresh.wav").read_bytes()
    forbid_espeak(monkeypatch)
    assert speak(CACHED_UNITS, tmp_path / "out" / "hit.wav", cache=cache) == fresh_seconds
    assert (tmp_path / "out" / "hit.wav").read_bytes() == (tmp_path / "fresh.wav").read_bytes()
    assert os.stat(tmp_path / "out" / "hit.wav").st_ino == os.stat(entry).st_ino  # hard link, same fs
    # a new cache object (a later run) hits on disk; re-speaking onto the same linked path works
    again = AudioCache(tmp_path / "tts")
    assert speak(CACHED_UNITS, tmp_path / "out" / "hit.wav", cache=again) == fresh_seconds
    assert (again.hits, again.misses) == (1, 0)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["hit.wav"]  # no temporaries left
    assert not list((tmp_path / "tts").rglob("*.tmp"))


def test_speak_key_names_what_is_spoken(monkeypatch: pytest.MonkeyPatch) -> None:
    key = speak_key(CACHED_UNITS)
    assert len(key) == 64 and int(key, 16) >= 0
    assert speak_key(list(CACHED_UNITS)) == key and speak_key(tuple(CACHED_UNITS)) == key
    others = {speak_key(CACHED_UNITS[:-1]), speak_key([*CACHED_UNITS, PAUSE]), speak_key(["the moon"]),
              speak_key(CACHED_UNITS, Voice(rate=150)), speak_key(CACHED_UNITS, Voice(name="en-gb")),
              speak_key([])}
    assert key not in others and len(others) == 6
    assert dict(espeak_identity())["espeak"]  # the espeak-ng version string is part of the key
    version = tts_mod.TTS_CACHE_VERSION
    monkeypatch.setattr(tts_mod, "TTS_CACHE_VERSION", version + 1)
    assert speak_key(CACHED_UNITS) != key
    monkeypatch.setattr(tts_mod, "PAUSE_SECONDS", 0.3)
    monkeypatch.setattr(tts_mod, "TTS_CACHE_VERSION", version)
    assert speak_key(CACHED_UNITS) != key
    monkeypatch.setattr(tts_mod, "PAUSE_SECONDS", PAUSE_SECONDS)
    monkeypatch.setattr(tts_mod, "BABBLE_VOICING", 0.4)  # the babble rendering is part of the key too
    assert speak_key(CACHED_UNITS) != key


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_tts_cache_corrupt_entry_is_a_miss_then_repaired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         damage: str) -> None:
    units = ["hello", "there"]
    cache = AudioCache(tmp_path / "tts")
    seconds = speak(units, tmp_path / "first.wav", cache=cache)
    good = (tmp_path / "first.wav").read_bytes()
    (entry,) = (tmp_path / "tts").rglob("*.wav")
    entry.write_bytes({"truncate": good[: len(good) // 2], "garbage": b"RIFF not a wav", "empty": b""}[damage])
    calls = count_espeak(monkeypatch)
    fresh = AudioCache(tmp_path / "tts")
    assert speak(units, tmp_path / "second.wav", cache=fresh) == seconds  # no exception: a miss
    assert calls == [1] and (fresh.hits, fresh.misses) == (0, 1)
    assert (tmp_path / "second.wav").read_bytes() == good and entry.read_bytes() == good  # repaired
    assert speak(units, tmp_path / "third.wav", cache=fresh) == seconds and calls == [1]


def test_tts_memory_only_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = AudioCache(None)
    seconds = speak(CACHED_UNITS, tmp_path / "a.wav", cache=cache)
    assert speak([], tmp_path / "e1.wav", cache=cache) == EMPTY_SECONDS
    forbid_espeak(monkeypatch)
    assert speak(CACHED_UNITS, tmp_path / "b.wav", cache=cache) == seconds
    assert speak([], tmp_path / "e2.wav", cache=cache) == EMPTY_SECONDS
    assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "b.wav").read_bytes()
    assert (tmp_path / "e1.wav").read_bytes() == (tmp_path / "e2.wav").read_bytes()
    assert (cache.hits, cache.misses) == (2, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav", "b.wav", "e1.wav", "e2.wav"]


def test_tts_unwritable_cache_dir_warns_once_and_keeps_speaking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")  # unwritable even for root
    cache = AudioCache(blocker / "tts")
    seconds = speak(["hello"], tmp_path / "a.wav", cache=cache)
    speak(["goodbye"], tmp_path / "b.wav", cache=cache)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"omni-stress: warning: TTS cache {blocker / 'tts'}: cannot write")
    assert not cache.writable
    forbid_espeak(monkeypatch)  # what it spoke is still remembered in memory
    assert speak(["hello"], tmp_path / "c.wav", cache=cache) == seconds
    assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "c.wav").read_bytes()


def ignores_permissions(folder: Path) -> bool:
    """True where this process may write into a mode-0555 folder anyway (root, CAP_DAC_OVERRIDE)."""
    probe = folder / "probe"
    probe.mkdir(mode=0o555)
    try:
        (probe / "x").touch()
        return True
    except PermissionError:
        return False
    finally:
        probe.chmod(0o755)
        (probe / "x").unlink(missing_ok=True)
        probe.rmdir()


def test_tts_read_only_cache_dir_still_serves_hits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    if ignores_permissions(tmp_path):
        pytest.skip("this process ignores directory permissions (root)")
    speak(["hello"], tmp_path / "a.wav", cache=AudioCache(tmp_path / "tts"))
    for folder in [tmp_path / "tts", *(tmp_path / "tts").iterdir()]:
        folder.chmod(0o555)
    try:
        cache = AudioCache(tmp_path / "tts")
        speak(["new", "words"], tmp_path / "b.wav", cache=cache)  # cannot store: warns, speaks
        assert "cannot write" in capsys.readouterr().err and (tmp_path / "b.wav").is_file()
        forbid_espeak(monkeypatch)
        speak(["hello"], tmp_path / "c.wav", cache=cache)  # an old entry is still read
        assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "c.wav").read_bytes()
    finally:
        for folder in [tmp_path / "tts", *(tmp_path / "tts").iterdir()]:
            folder.chmod(0o755)


def test_audio_cache_default_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STRESS_CACHE_DIR", str(tmp_path / "c"))
    assert AudioCache.default().directory == tmp_path / "c" / "tts"


# --------------------------------------------------------------------------- ASR round trip


def test_round_trip_below_bound(tiny: FasterWhisperTranscriber, wavs: dict[str, Path]) -> None:
    wers = [wer(text, tiny.transcribe(wavs[f"s{i}"])) for i, text in enumerate(SENTENCES)]
    assert sum(wers) / len(wers) <= 0.15, wers


def test_wrong_sentence_scores_high(tiny: FasterWhisperTranscriber, wavs: dict[str, Path]) -> None:
    assert wer("The volcano erupted under the moon last winter.", tiny.transcribe(wavs["s1"])) >= 0.8


def test_silence_scores_one(tiny: FasterWhisperTranscriber, wavs: dict[str, Path]) -> None:
    result = transcribe_and_score(wavs["silence"], SENTENCES[0], tiny, TranscriptCache(None))
    assert result.transcript == ""
    assert result.wer == 1.0


# --------------------------------------------------------------------------- cache


@dataclass
class CountingTranscriber:
    """Wraps a transcriber and counts real transcriptions."""

    inner: object
    cache_key: str = "counting|test"
    calls: int = 0

    def transcribe(self, wav_path: Path) -> str:
        self.calls += 1
        return self.inner.transcribe(wav_path)  # type: ignore[attr-defined]


def test_cache_hit_and_miss(tiny: FasterWhisperTranscriber, wavs: dict[str, Path], tmp_path: Path) -> None:
    counting = CountingTranscriber(tiny)
    cache = TranscriptCache(tmp_path / "cache")
    first = transcribe_and_score(wavs["s0"], SENTENCES[0], counting, cache)
    second = transcribe_and_score(wavs["s0"], SENTENCES[0], counting, cache)
    assert counting.calls == 1 and not first.cached and second.cached
    assert second.transcript == first.transcript and second.wer == first.wer
    # a new process (new cache object) still hits on disk
    fresh = TranscriptCache(tmp_path / "cache")
    assert fresh.get(sha256_file(wavs["s0"]), counting.cache_key) == first.transcript
    # another key (model/options) or other audio misses
    assert fresh.get(sha256_file(wavs["s0"]), "other|key") is None
    transcribe_and_score(wavs["s1"], SENTENCES[1], counting, cache)
    assert counting.calls == 2


def test_cache_disabled_still_memoises_in_process(tmp_path: Path) -> None:
    cache = TranscriptCache(None)
    cache.put("abc", "k", "hello")
    assert cache.get("abc", "k") == "hello" and cache.get("abc", "k2") is None
    assert not list(tmp_path.iterdir())


def test_cache_ignores_corrupt_file(tmp_path: Path) -> None:
    cache = TranscriptCache(tmp_path)
    cache.put("abc", "k", "hello")
    (entry,) = tmp_path.rglob("*.json")
    entry.write_text("{not json")
    assert TranscriptCache(tmp_path).get("abc", "k") is None


# --------------------------------------------------------------------------- model resolution


def test_base_parts_joined_once_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p1, p2 = tmp_path / "p1", tmp_path / "p2"
    p1.mkdir(), p2.mkdir()
    (p1 / "model.bin.part1").write_bytes(b"abc")
    (p2 / "model.bin.part2").write_bytes(b"defg")
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        (p1 / name).write_text(name)
    monkeypatch.setattr(asr_mod, "_base_parts", lambda: (p1, p2))
    monkeypatch.setenv("OMNI_STRESS_CACHE_DIR", str(tmp_path / "cache"))  # the verified/ stamps
    monkeypatch.setattr(asr_mod, "BASE_PART_SHA256", {"model.bin.part1": hashlib.sha256(b"abc").hexdigest(),
                                                      "model.bin.part2": hashlib.sha256(b"defg").hexdigest()})
    monkeypatch.setitem(asr_mod.PINNED_SHA256, "base", {
        **{name: hashlib.sha256(name.encode()).hexdigest() for name in ("config.json", "tokenizer.json", "vocabulary.txt")},
        "model.bin": hashlib.sha256(b"abcdefg").hexdigest()})
    folder = asr_mod.base_model_dir(tmp_path / "models")
    assert (folder / "model.bin").read_bytes() == b"abcdefg"
    assert (folder / "config.json").read_text() == "config.json"
    mtime = (folder / "model.bin").stat().st_mtime_ns
    assert asr_mod.base_model_dir(tmp_path / "models") == folder  # reused, not rebuilt
    assert (folder / "model.bin").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "models").iterdir()] == [folder.name]  # no temporary left


def test_unknown_backend_and_model() -> None:
    with pytest.raises(UserError, match="--asr 'vosk'"):
        make_transcriber("vosk", "base")
    with pytest.raises(UserError, match="--asr-model 'small'"):
        make_transcriber("faster-whisper", "small")
    with pytest.raises(UserError, match="--beam-size"):
        make_transcriber("faster-whisper", "tiny.en", beam_size=0)


def test_missing_openai_checkpoint_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expected = tmp_path / "whisper" / "base.pt"
    with pytest.raises(UserError, match=f"checkpoint {expected} not found"):
        make_transcriber("openai-whisper", "base")
    with pytest.raises(UserError, match="nothere.pt not found"):
        make_transcriber("openai-whisper", str(tmp_path / "nothere.pt"))


def test_openai_whisper_on_a_tiny_random_checkpoint(tmp_path: Path, wavs: dict[str, Path]) -> None:
    """The openai-whisper path end to end (load from a path, VAD gate), on random 1-layer weights."""
    import torch
    from whisper.model import ModelDimensions, Whisper

    dims = ModelDimensions(n_mels=80, n_audio_ctx=1500, n_audio_state=8, n_audio_head=2, n_audio_layer=1,
                           n_vocab=51864, n_text_ctx=448, n_text_state=8, n_text_head=2, n_text_layer=1)
    torch.manual_seed(0)
    ckpt = tmp_path / "random.pt"
    torch.save({"dims": dims.__dict__, "model_state_dict": Whisper(dims).state_dict()}, ckpt)
    tr = make_transcriber("openai-whisper", str(ckpt))
    assert tr.cache_key.startswith("openai-whisper=") and f"{ckpt}:" in tr.cache_key
    assert tr.transcribe(wavs["silence"]) == "" and tr.calls == 0  # VAD: no model call on silence
    speak(["hello"], tmp_path / "short.wav")
    assert isinstance(tr.transcribe(tmp_path / "short.wav"), str) and tr.calls == 1
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot load openai-whisper checkpoint"):
        make_transcriber("openai-whisper", str(tmp_path / "broken.pt")).transcribe(tmp_path / "short.wav")


# --------------------------------------------------------------------------- CLI


def test_cli_transcribe_uses_cache_and_prints_wer(tiny: FasterWhisperTranscriber, wavs: dict[str, Path],
                                                  tmp_path: Path) -> None:
    """The CLI answers from the cache (so this test loads no second model) and prints the WER."""
    cache_dir = tmp_path / "transcripts"
    expected = transcribe_and_score(wavs["s0"], SENTENCES[0], tiny, TranscriptCache(cache_dir))
    result = CliRunner().invoke(main, ["transcribe", str(wavs["s0"]), "--asr-model", "tiny.en",
                                       "--cache-dir", str(cache_dir), "--reference", SENTENCES[0]])
    assert result.exit_code == 0, result.output
    assert result.output == f"{wavs['s0']} (cached): WER {expected.wer:.3f}: {expected.transcript}\n"


def test_cli_transcribe_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["transcribe", str(tmp_path / "missing.wav")])
    assert result.exit_code == 2
    assert f"omni-stress: error: {tmp_path / 'missing.wav'}: audio file not found" in result.output
    speak(["hi"], tmp_path / "hi.wav")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    result = runner.invoke(main, ["transcribe", str(tmp_path / "hi.wav"), "--asr", "openai-whisper"])
    assert result.exit_code == 2
    assert f"checkpoint {tmp_path / 'whisper' / 'base.pt'} not found" in result.output


# --------------------------------------------------------------------------- babble (issue 13)


def _babble_units(frames: int, per_unit: int = 19, seed: int = 0) -> list[str]:
    from harness.sim.codec import NOISE_CODES, babble_unit

    rng = np.random.default_rng(seed)
    units, left = [], frames
    while left > 0:
        units.append(babble_unit(int(rng.integers(1, NOISE_CODES + 1)), min(per_unit, left)))
        left -= per_unit
    return units


def test_babble_lasts_its_codec_frames_and_is_deterministic(tmp_path: Path) -> None:
    units = _babble_units(500)  # 500 frames at 50 Hz: 10 s
    samples = tts_mod.synthesize(units)
    assert samples.size == round(LEAD_SECONDS * SAMPLE_RATE) + 500 * SAMPLE_RATE // 50
    assert np.array_equal(tts_mod.synthesize(units), samples)
    # as loud as speech frames, never clipped
    frames = samples[: samples.size // 480 * 480].reshape(-1, 480).astype(float)
    rms = np.sqrt((frames ** 2).mean(axis=1))
    assert 0.5 * tts_mod.BABBLE_RMS < np.median(rms[rms > 300]) < 1.5 * tts_mod.BABBLE_RMS
    assert np.abs(samples).max() < 32767


def test_babble_transcribes_to_few_or_no_words(tiny: FasterWhisperTranscriber, tmp_path: Path) -> None:
    """Code2Wav renders babble as non-speech: the bundled Whisper hears (almost) no words in a
    minute of it, where a syllable voice made it write one word per syllable."""
    heard = 0
    for seed in range(3):
        path = tmp_path / f"babble{seed}.wav"
        seconds = speak(_babble_units(1000, seed=seed), path)  # 20 s each
        assert seconds == pytest.approx(LEAD_SECONDS + 20.0, abs=0.01)
        heard += len(tiny.transcribe(path).split())
    assert heard <= 6  # 3 x 52 babble syllables
