"""The sim's Code2Wav: a finished request's codec units become a WAV in the run directory.

Why here and not in the pipeline: the real backend's records arrive with the server's audio
already written, so the sim's records must too; then ASR and scoring never ask which backend
made a record. Speech is espeak-ng (``harness.audio.tts.speak``), cached by what is spoken.
"""

from __future__ import annotations

import time
from pathlib import Path

from harness.audio.cache import AudioCache
from harness.backends import wav_rel_path
from harness.records import RequestRecord


class Code2Wav:
    """Speaks units into ``<run_dir>/audio/...wav`` and fills ``audio_path``/``audio_seconds``."""

    def __init__(self, run_dir: Path, cache: AudioCache) -> None:
        self.run_dir = Path(run_dir)
        self.cache = cache
        self.seconds = 0.0

    @classmethod
    def for_options(cls, run_dir: Path, cache_dir: Path | None, use_cache: bool) -> Code2Wav:
        return cls(run_dir, AudioCache.for_run(cache_dir, use_cache))

    def speak(self, record: RequestRecord, units: list[str]) -> None:
        from harness.audio.tts import speak

        rel = wav_rel_path(record.arm, record.deploy, record.repeat, record.prompt_id)
        t0 = time.perf_counter()
        record.audio_seconds = round(speak(units, self.run_dir / rel, cache=self.cache), 3)
        self.seconds += time.perf_counter() - t0
        record.audio_path = rel

    @property
    def cache_hits(self) -> int:
        return self.cache.hits
