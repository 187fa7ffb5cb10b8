"""WAV -> transcript -> WER for one request, through the transcript cache.

The cache (disk + memory) is consulted by the WAV's sha256 and the transcriber's key, so
identical audio within a run or across runs is transcribed once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from harness.audio.asr import Transcriber
from harness.audio.cache import TranscriptCache, sha256_file
from harness.errors import UserError
from harness.audio.scoring import wer


@dataclass(frozen=True)
class AsrResult:
    transcript: str
    wer: float
    seconds: float  # wall time spent transcribing here (about 0 on a cache hit)
    cached: bool


_PROCESS_MEMO = TranscriptCache(None)  # used when the caller passes no cache


def cached_transcript(wav_path: Path, transcriber: Transcriber, cache: TranscriptCache) -> tuple[str, str | None]:
    """(sha256 of the WAV, its cached transcript or None); a missing WAV is a UserError."""
    wav_path = Path(wav_path)
    if not wav_path.is_file():
        raise UserError(f"{wav_path}: audio file not found")
    digest = sha256_file(wav_path)
    return digest, cache.get(digest, transcriber.cache_key)


def transcribe_and_score(wav_path: Path, reference: str, transcriber: Transcriber,
                         cache: TranscriptCache | None = None) -> AsrResult:
    """Transcribe ``wav_path`` (or reuse a cached transcript) and score it against ``reference``."""
    cache = cache if cache is not None else _PROCESS_MEMO
    start = time.perf_counter()
    digest, transcript = cached_transcript(wav_path, transcriber, cache)
    cached = transcript is not None
    if transcript is None:
        transcript = transcriber.transcribe(wav_path)
        cache.put(digest, transcriber.cache_key, transcript)
    seconds = time.perf_counter() - start
    return AsrResult(transcript=transcript, wer=wer(reference, transcript), seconds=seconds, cached=cached)
