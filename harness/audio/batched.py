"""Whisper over many clips at once: faster-whisper's batched pipeline, batching across clips.

``BatchedInferencePipeline.transcribe`` batches the VAD chunks of *one* file; a run's clips are
~20 s each, one chunk apiece, so per file it batches nothing. Here the same pipeline's pieces
(its VAD settings, ``collect_chunks``, the feature extractor, ``BatchedInferencePipeline.forward``)
cut every clip of a call into chunks and decode up to ``batch_size`` chunks of *any* clips in one
CTranslate2 call; each clip's text is its chunks' segments joined in order, exactly what
``BatchedInferencePipeline.transcribe(clip)`` returns for it.

Not the per-clip transcript: the batched pipeline decodes each VAD chunk on its own, without
timestamps and without the previous window's text, and its VAD keeps 160 ms pauses, so its
punctuation and a few words differ from ``WhisperModel.transcribe``'s (``--asr-batch`` in
docs/audio.md has the measured WER difference on the default prompt set). Its cache key says
``pipeline=batched``, so the two kinds of transcript never mix in the cache.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.audio.perclip import (CPU_THREADS, LANGUAGE, SAMPLE_RATE, TEMPERATURE, FasterWhisperTranscriber,
                                   faster_whisper_key)
from harness.errors import UserError

MAX_BATCH = 64


def check_batch(batch: int) -> int:
    """``--asr-batch N``: 0 (per clip, the default) or 1..MAX_BATCH chunks per decode."""
    if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch <= MAX_BATCH:
        raise UserError(f"--asr-batch {batch!r}: must be an integer from 0 (per clip) to {MAX_BATCH}")
    return batch


@dataclass
class BatchedWhisperTranscriber:
    """faster-whisper's ``BatchedInferencePipeline`` on CPU, up to ``batch_size`` VAD chunks per decode.

    ``transcribe_many(paths)`` gives one transcript per path; ``transcribe(path)`` is a call of one
    (the ``Transcriber`` interface). The model loads on first use."""

    model_name: str
    model_dir: Path
    batch_size: int = 8
    beam_size: int = 1
    cpu_threads: int = CPU_THREADS
    cache_key: str = ""
    calls: int = 0
    _pipeline: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.cache_key:
            # batch_size is not in the key: a chunk's text does not depend on what it is batched with
            # (tests/test_asr_batched.py: batches of 1, 3 and 16 chunks give the same texts).
            self.cache_key = faster_whisper_key(self.model_name, self.beam_size) + "|pipeline=batched"

    def _load(self) -> Any:
        if self._pipeline is None:
            per_clip = FasterWhisperTranscriber(self.model_name, self.model_dir, self.beam_size, self.cpu_threads)
            from faster_whisper import BatchedInferencePipeline

            self._pipeline = BatchedInferencePipeline(per_clip._load())
        return self._pipeline

    def _chunks(self, pipeline: Any, source: Any) -> tuple[list[Any], list[dict[str, Any]]]:
        """A clip's VAD chunks and their metadata, as ``BatchedInferencePipeline.transcribe`` cuts them."""
        from faster_whisper.audio import decode_audio
        from faster_whisper.vad import VadOptions, collect_chunks, get_speech_timestamps

        audio = decode_audio(source, sampling_rate=SAMPLE_RATE)
        chunk_length = pipeline.model.feature_extractor.chunk_length
        speech = get_speech_timestamps(audio, VadOptions(max_speech_duration_s=chunk_length, min_silence_duration_ms=160))
        if not speech:
            return [], []
        chunks, meta = collect_chunks(audio, speech, max_duration=chunk_length)
        return [pipeline.model.feature_extractor(c)[..., :-1] for c in chunks], meta

    def transcribe_many(self, sources: list[Any]) -> list[str]:
        """One transcript per source (a path or a binary file object), chunks of all of them batched."""
        import numpy as np
        from faster_whisper.audio import pad_or_trim
        from faster_whisper.tokenizer import Tokenizer

        with self._lock:
            pipeline = self._load()
            self.calls += 1
            owner: list[int] = []
            features: list[Any] = []
            metadata: list[dict[str, Any]] = []
            for i, source in enumerate(sources):
                feats, meta = self._chunks(pipeline, str(source) if isinstance(source, Path) else source)
                owner += [i] * len(feats)
                features += feats
                metadata += meta
            texts: list[list[str]] = [[] for _ in sources]
            if not features:
                return ["" for _ in sources]
            model = pipeline.model
            tokenizer = Tokenizer(model.hf_tokenizer, model.model.is_multilingual, task="transcribe", language=LANGUAGE)
            options = _options(tokenizer, self.beam_size)
            stacked = np.stack([pad_or_trim(f) for f in features])
            for start in range(0, len(features), self.batch_size):
                end = start + self.batch_size
                outputs = pipeline.forward(stacked[start:end], tokenizer, metadata[start:end], options)
                for clip, segments in zip(owner[start:end], outputs):
                    texts[clip] += [s["text"].strip() for s in segments if s["text"].strip()]
            return [" ".join(t) for t in texts]

    def transcribe(self, wav_path: Path) -> str:
        return self.transcribe_many([wav_path])[0]


def _options(tokenizer: Any, beam_size: int) -> Any:
    """The ``TranscriptionOptions`` ``BatchedInferencePipeline.transcribe`` builds for our settings
    (language en, greedy at temperature 0 unless ``--beam-size``, no timestamps, no prompt)."""
    from faster_whisper.transcribe import TranscriptionOptions, get_suppressed_tokens

    return TranscriptionOptions(
        beam_size=beam_size, best_of=5, patience=1, length_penalty=1, repetition_penalty=1, no_repeat_ngram_size=0,
        log_prob_threshold=-1.0, no_speech_threshold=0.6, compression_ratio_threshold=2.4,
        temperatures=[TEMPERATURE], initial_prompt=None, prefix=None, suppress_blank=True,
        suppress_tokens=get_suppressed_tokens(tokenizer, [-1]), prepend_punctuations="\"'“¿([{-",
        append_punctuations="\"'.。,，!！?？:：”)]}、", max_new_tokens=None, hotwords=None, word_timestamps=False,
        hallucination_silence_threshold=None, condition_on_previous_text=False, clip_timestamps=None,
        prompt_reset_on_temperature=0.5, multilingual=False, without_timestamps=True, max_initial_timestamp=0.0)
