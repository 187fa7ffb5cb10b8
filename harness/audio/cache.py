"""Caches for the audio path: transcripts by (WAV sha256, ASR key), and spoken WAVs by TTS key.

Why: a run speaks the same audio many times (pr under stress speaks exactly what pr speaks
under the reference deploy; repeats repeat), and Whisper on CPU is the slowest part of a run.
The key holds everything that changes a transcript (backend, model, options, versions), so a
hit is always valid. A memory layer makes repeats within one process free even with
``--no-cache`` (``directory=None`` turns off only the disk).

``AudioCache`` does the same one step earlier: the transcript key needs the WAV's bytes, so
without it a warm run still re-runs espeak-ng for every request. Its key (built by
``harness.audio.tts.speak_key``) holds everything that changes the synthesised samples.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import threading
import wave
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from harness.errors import UserError

CACHE_ENV = "OMNI_STRESS_CACHE_DIR"


def cache_root() -> Path:
    """``$OMNI_STRESS_CACHE_DIR`` or ``~/.cache/omni-stress`` (models/ and transcripts/ live here)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "omni-stress"


def default_transcript_dir() -> Path:
    return cache_root() / "transcripts"


def default_tts_dir() -> Path:
    return cache_root() / "tts"


def run_cache_dir(cache_dir: Path | None, use_cache: bool, sub: str, default: Path) -> Path | None:
    """Where a run keeps one cache: ``None`` (memory only) with ``--no-cache``, ``<--cache-dir>/<sub>``,
    else the default folder. One rule for the transcript and TTS caches."""
    if not use_cache:
        return None
    return Path(cache_dir) / sub if cache_dir else default


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a unique temporary file beside ``path`` and rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class TranscriptCache:
    """Transcripts by (audio sha256, transcriber cache key); ``directory=None`` = memory only."""

    MAX_MEMORY = 100_000  # entries kept in memory (a transcript is a few hundred bytes)

    def __init__(self, directory: Path | None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else None
        self._memory: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def default(cls) -> TranscriptCache:
        return cls(default_transcript_dir())

    @classmethod
    def for_run(cls, cache_dir: Path | None, use_cache: bool) -> TranscriptCache:
        return cls(run_cache_dir(cache_dir, use_cache, "transcripts", default_transcript_dir()))

    def _file(self, sha256: str, key: str) -> Path:
        assert self.directory is not None
        digest = hashlib.sha256(f"{key}\n{sha256}".encode()).hexdigest()
        return self.directory / digest[:2] / f"{digest}.json"

    def get(self, sha256: str, key: str) -> str | None:
        with self._lock:
            found = self._memory.get((sha256, key))
        if found is None and self.directory is not None:
            found = self._read(self._file(sha256, key), sha256, key)
            if found is not None:
                self._remember(sha256, key, found)
        with self._lock:
            if found is None:
                self.misses += 1
            else:
                self.hits += 1
        return found

    def put(self, sha256: str, key: str, transcript: str) -> None:
        self._remember(sha256, key, transcript)
        if self.directory is None:
            return
        entry = {"sha256": sha256, "key": key, "transcript": transcript}
        try:
            atomic_write_text(self._file(sha256, key), json.dumps(entry, ensure_ascii=False))
        except OSError as exc:
            raise UserError(f"transcript cache {self.directory}: cannot write ({exc.strerror}); "
                            "use --cache-dir DIR or --no-cache") from None

    def _remember(self, sha256: str, key: str, transcript: str) -> None:
        with self._lock:
            if len(self._memory) >= self.MAX_MEMORY:
                self._memory.clear()
            self._memory[(sha256, key)] = transcript

    @staticmethod
    def _read(path: Path, sha256: str, key: str) -> str | None:
        """A missing, unreadable or foreign file is a miss (it will be rewritten), never an error."""
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("sha256") != sha256 or entry.get("key") != key:
            return None
        transcript = entry.get("transcript")
        return transcript if isinstance(transcript, str) else None


class AudioCache:
    """Spoken WAVs by TTS key (see ``tts.speak_key``); ``directory=None`` = memory only.

    On disk an entry is ``<dir>/<key[:2]>/<key>.wav``, a plain WAV written by temporary file +
    ``os.replace``. ``get`` hard-links the entry to the caller's path when both sit on one file
    system (a warm run then costs no disk), else copies it; either way ``dest`` appears whole or
    not at all. A missing, truncated or foreign entry is a miss and is overwritten by the next
    ``put``. A cache directory that cannot be written is no error: speaking goes on, new entries
    are kept in memory only, and one warning line goes to stderr.
    """

    MAX_MEMORY_BYTES = 256 << 20  # WAV bytes kept in memory (a reply is ~0.2-1 MB), then cleared

    def __init__(self, directory: Path | None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else None
        self._memory: dict[str, bytes] = {}
        self._memory_bytes = 0
        self._lock = threading.Lock()
        self.writable = self.directory is not None
        self.hits = 0
        self.misses = 0

    @classmethod
    def default(cls) -> AudioCache:
        return cls(default_tts_dir())

    @classmethod
    def for_run(cls, cache_dir: Path | None, use_cache: bool) -> AudioCache:
        return cls(run_cache_dir(cache_dir, use_cache, "tts", default_tts_dir()))

    def _file(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / f"{key}.wav"

    def get(self, key: str, dest: Path) -> float | None:
        """Put the WAV cached under ``key`` at ``dest`` and return its seconds; ``None`` on a miss."""
        dest = Path(dest)
        with self._lock:
            data = self._memory.get(key)
        seconds: float | None = None
        if data is not None:
            seconds = wav_seconds_bytes(data)
            if seconds is not None:
                _atomic_write_bytes(dest, data)
        elif self.directory is not None:
            entry = self._file(key)
            seconds = wav_seconds(entry)
            if seconds is not None:
                _atomic_link_or_copy(entry, dest)
        with self._lock:
            if seconds is None:
                self.misses += 1
            else:
                self.hits += 1
        return seconds

    def put(self, key: str, wav_path: Path) -> None:
        """Store a copy of ``wav_path`` under ``key`` (a copy: later edits of the source never leak in)."""
        if self.writable:
            try:
                _atomic_copy(Path(wav_path), self._file(key))
                return
            except OSError as exc:
                self._disable_disk(exc)
        data = Path(wav_path).read_bytes()
        with self._lock:
            if self._memory_bytes + len(data) > self.MAX_MEMORY_BYTES:
                self._memory.clear()
                self._memory_bytes = 0
            self._memory_bytes += len(data) - len(self._memory.get(key, b""))
            self._memory[key] = data

    def _disable_disk(self, exc: OSError) -> None:
        with self._lock:
            if not self.writable:
                return
            self.writable = False
        reason = exc.strerror or type(exc).__name__
        sys.stderr.write(f"omni-stress: warning: TTS cache {self.directory}: cannot write ({reason}); "
                         "new audio is cached in memory only\n")
        sys.stderr.flush()


def wav_seconds(path: Path) -> float | None:
    """Seconds of a complete 16-bit mono WAV at ``path``; ``None`` if missing, truncated or not one."""
    try:
        with open(path, "rb") as f:
            return _wav_seconds(f)
    except OSError:
        return None


def wav_seconds_bytes(data: bytes) -> float | None:
    return _wav_seconds(io.BytesIO(data))


def _wav_seconds(f: BinaryIO) -> float | None:
    try:
        with wave.open(f, "rb") as w:
            if w.getnchannels() != 1 or w.getsampwidth() != 2 or w.getframerate() <= 0:
                return None
            frames = w.getnframes()
            if len(w.readframes(frames)) != frames * 2:  # the header promises more than is there
                return None
            return frames / w.getframerate()
    except (wave.Error, EOFError, ValueError):
        return None


def _tmp_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _atomic_fill(dest: Path, fill: Callable[[Path], None]) -> None:
    """``fill`` writes a temporary file beside ``dest``, which then replaces ``dest`` whole."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_beside(dest)
    try:
        tmp.unlink(missing_ok=True)
        fill(tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_copy(src: Path, dest: Path) -> None:
    _atomic_fill(dest, lambda tmp: shutil.copyfile(src, tmp))


def _atomic_write_bytes(dest: Path, data: bytes) -> None:
    _atomic_fill(dest, lambda tmp: tmp.write_bytes(data))


def _atomic_link_or_copy(src: Path, dest: Path) -> None:
    """Hard link ``src`` at ``dest`` (same file system), else copy; ``dest`` appears whole."""

    def link_or_copy(tmp: Path) -> None:
        try:
            os.link(src, tmp)
        except OSError:  # another file system (EXDEV), or one without hard links
            shutil.copyfile(src, tmp)

    _atomic_fill(dest, link_or_copy)
