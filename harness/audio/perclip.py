"""faster-whisper per clip, and the decode settings every Whisper path here shares.

``FasterWhisperTranscriber`` decodes one clip at a time on a model folder it is given; the settings
(language, temperature, compute type, threads, input rate) and ``faster_whisper_key`` are what its
transcripts, the batched pipeline's (``harness.audio.batched``) and openai-whisper's
(``harness.audio.asr``) are made and cached under.

Why a module of its own: the batched pipeline loads its model through this transcriber and keys its
cache by the same options, while ``harness.audio.asr`` (which finds and checks the model files and
whose ``make_transcriber`` picks per clip or batched) builds on both; with these pieces here the
imports run one way, asr -> batched -> perclip, and asr -> perclip. ``harness.audio.asr`` imports
them back, so ``from harness.audio.asr import FasterWhisperTranscriber`` (and the settings) still works.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.errors import UserError

CPU_THREADS = 2
LANGUAGE = "en"
TEMPERATURE = 0.0  # no sampling fallback: the same audio always gives the same transcript
COMPUTE_TYPE = "float32"  # CTranslate2 weights on CPU: the unquantised model, as the seed ran it
SAMPLE_RATE = 16_000  # Whisper's input rate


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "missing"


def faster_whisper_key(model_name: str, beam_size: int) -> str:
    """The transcript cache key of faster-whisper's options: versions, model, compute type, beam, language,
    VAD, temperature (a transcript made under other options is another entry)."""
    return (f"faster-whisper={_version('faster-whisper')}|ctranslate2={_version('ctranslate2')}"
            f"|model={model_name}|compute={COMPUTE_TYPE}|beam={beam_size}|lang={LANGUAGE}|vad=1"
            f"|temperature={TEMPERATURE}")


@dataclass
class FasterWhisperTranscriber:
    """faster-whisper on CPU with VAD; the model loads on first use (cache hits never load it)."""

    model_name: str
    model_dir: Path
    beam_size: int = 1
    cpu_threads: int = CPU_THREADS
    cache_key: str = ""
    calls: int = 0
    _model: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.cache_key:
            self.cache_key = faster_whisper_key(self.model_name, self.beam_size)

    def _load(self) -> Any:
        if self._model is None:
            from harness.cachedirs import import_onnxruntime_quietly

            import_onnxruntime_quietly()  # the VAD's runtime, before it can print its cache warning
            try:
                from faster_whisper import WhisperModel
            except ImportError:
                raise UserError("--asr faster-whisper needs the 'faster-whisper' package (pip install faster-whisper)") from None
            try:
                self._model = WhisperModel(str(self.model_dir), device="cpu", compute_type=COMPUTE_TYPE,
                                           cpu_threads=self.cpu_threads, local_files_only=True)
            except (RuntimeError, ValueError, OSError) as exc:  # what ctranslate2 raises on a bad model folder
                raise UserError(f"--asr-model {self.model_name}: cannot load a CTranslate2 Whisper model from "
                                f"{self.model_dir}: {exc}") from None
        return self._model

    def transcribe(self, wav_path: Path) -> str:
        with self._lock:  # one decode at a time: the model already uses every thread it is given
            model = self._load()
            self.calls += 1
            segments, _info = model.transcribe(str(wav_path), language=LANGUAGE, beam_size=self.beam_size,
                                               temperature=TEMPERATURE, vad_filter=True)
            return " ".join(s.text.strip() for s in segments if s.text.strip())  # consumes the lazy generator
