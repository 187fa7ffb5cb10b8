"""Transcript cache: (WAV sha256, ASR key) -> transcript, as small JSON files on disk.

Why: a run speaks the same audio many times (pr under stress speaks exactly what pr speaks
under the reference deploy; repeats repeat), and Whisper on CPU is the slowest part of a run.
The key holds everything that changes a transcript (backend, model, options, versions), so a
hit is always valid. A memory layer makes repeats within one process free even with
``--no-cache`` (``directory=None`` turns off only the disk).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

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
