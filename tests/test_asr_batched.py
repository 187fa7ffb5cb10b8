"""``--asr-batch N`` (issue 34): faster-whisper's batched pipeline, batching chunks across clips.

* a clip's text is the one ``BatchedInferencePipeline.transcribe`` gives that clip alone, whatever
  it is batched with (batches of 1, 3 and 16 chunks), silence is "", a clip over 60 s is three chunks;
* the transcripts (tiny.en, exact) and how they differ from per clip's;
* its own cache key; bad values and openai-whisper are one UserError.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.audio.asr import FasterWhisperTranscriber, make_transcriber
from harness.audio.batched import MAX_BATCH, BatchedWhisperTranscriber, check_batch
from harness.audio.tts import PAUSE, speak, units_from_text
from harness.errors import UserError

SENTENCES = [
    "Keep your room dark, quiet and cool.",
    "Mix four cups of flour with a spoon of salt.",
    "Plan to stop every two hours to stretch and change drivers.",
]
# tiny.en's batched transcripts of SENTENCES (the per-clip ones differ in clip 1: "and salt").
BATCHED = ["Keep your room dark, quiet and cool.", "Mix 4 cups on flour with a spoon unsalted",
           "Plan to stop every two hours to stretch and change drivers."]
PER_CLIP = ["Keep your room dark, quiet and cool.", "Mix 4 cups on flour with a spoon and salt",
            "Plan to stop every two hours to stretch and change drivers."]


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("batched")
    out = {}
    for i, text in enumerate(SENTENCES):
        out[f"s{i}"] = folder / f"s{i}.wav"
        speak(units_from_text(text), out[f"s{i}"])
    out["silence"] = folder / "silence.wav"
    speak([PAUSE] * 8, out["silence"])
    # Over 60 s of speech: the VAD cuts it into three chunks, so one clip spans three batch rows.
    out["long"] = folder / "long.wav"
    speak(units_from_text(" ".join(SENTENCES * 5)), out["long"])
    return out


@pytest.fixture(scope="module")
def batched() -> BatchedWhisperTranscriber:
    tr = make_transcriber("faster-whisper", "tiny.en", 1, cpu_threads=1, batch=16)
    assert isinstance(tr, BatchedWhisperTranscriber)
    return tr


@pytest.mark.slow
def test_batched_texts_are_the_pipelines_whatever_the_batch(batched: BatchedWhisperTranscriber,
                                                            clips: dict[str, Path]) -> None:
    order = [clips["s0"], clips["silence"], clips["long"], clips["s1"], clips["s2"]]
    pipeline = batched._load()
    alone = []
    for path in order:
        segments, _ = pipeline.transcribe(str(path), language="en", beam_size=1, temperature=0.0, vad_filter=True)
        alone.append(" ".join(s.text.strip() for s in segments if s.text.strip()))
    assert alone[1] == ""
    assert [alone[0], alone[3], alone[4]] == BATCHED
    chunks, _ = batched._chunks(pipeline, str(clips["long"]))
    assert len(chunks) == 3
    for size in (1, 3, 16):
        batched.batch_size = size
        assert batched.transcribe_many(order) == alone, size
    batched.batch_size = 16
    assert batched.transcribe(clips["s1"]) == BATCHED[1]
    assert batched.transcribe_many([]) == []
    assert batched.transcribe_many([clips["silence"]]) == [""]


@pytest.mark.slow
def test_per_clip_and_batched_differ_where_measured(batched: BatchedWhisperTranscriber,
                                                    clips: dict[str, Path]) -> None:
    per_clip = make_transcriber("faster-whisper", "tiny.en", 1, cpu_threads=1)
    assert isinstance(per_clip, FasterWhisperTranscriber)
    paths = [clips[f"s{i}"] for i in range(3)]
    assert [per_clip.transcribe(p) for p in paths] == PER_CLIP
    assert batched.transcribe_many(paths) == BATCHED


def test_batched_has_its_own_cache_key_without_the_batch_size() -> None:
    a = make_transcriber("faster-whisper", "tiny.en", 1, batch=4)
    b = make_transcriber("faster-whisper", "tiny.en", 1, batch=32)
    per_clip = make_transcriber("faster-whisper", "tiny.en", 1)
    assert a.cache_key == b.cache_key == per_clip.cache_key + "|pipeline=batched"


def test_bad_batch_values_are_one_user_error() -> None:
    assert check_batch(0) == 0 and check_batch(MAX_BATCH) == MAX_BATCH
    for bad in (-1, MAX_BATCH + 1, True, 2.0):
        with pytest.raises(UserError, match=r"^--asr-batch .*: must be an integer from 0 \(per clip\) to 64$"):
            make_transcriber("faster-whisper", "tiny.en", 1, batch=bad)  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"^--asr-batch 8: the batched pipeline is faster-whisper's"):
        make_transcriber("openai-whisper", "base", 1, batch=8)


def test_asr_batch_with_openai_whisper_is_one_line_exit_2(tmp_path: Path) -> None:
    from clikit import assert_one_line_error
    from conftest import SMALL_PROMPTS, invoke_cli

    res = invoke_cli("run", "--asr", "openai-whisper", "--asr-batch", "4", "--quiet", "--prompts", str(SMALL_PROMPTS),
                     "--out", str(tmp_path))
    assert_one_line_error(res, "--asr-batch 4: the batched pipeline is faster-whisper's (--asr faster-whisper), "
                               "not --asr openai-whisper")
    assert list(tmp_path.iterdir()) == []


def test_the_manifest_and_resume_name_the_batch() -> None:
    from harness.rundir import _asr_text

    assert _asr_text({"backend": "faster-whisper", "model": "base", "beam_size": 1, "batch": 8}) == \
        "--asr faster-whisper --asr-model base --beam-size 1 --asr-batch 8"
    assert _asr_text({"backend": "faster-whisper", "model": "base", "beam_size": 1}) == \
        "--asr faster-whisper --asr-model base --beam-size 1"
