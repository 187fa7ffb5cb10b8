"""The libraries' cache folders, when the user's cannot be written (issue 33, case 8).

vLLM writes ``$VLLM_CACHE_ROOT`` (default ``$XDG_CACHE_HOME/vllm``: its model-info cache) and matplotlib
``$MPLCONFIGDIR`` (default ``$XDG_CACHE_HOME/matplotlib`` for its font cache). When that folder cannot be
written (``XDG_CACHE_HOME`` on a read-only disk, under a file, not ours), each library says so with its own
traceback or warning, in every process that imports it (four vLLM tracebacks and a matplotlib warning per
run, despite ``--quiet``). Before any command runs, each such folder that cannot be written is pointed at
omni-stress's own cache (``$OMNI_STRESS_CACHE_DIR``, ``~/.cache/omni-stress``) when that one can be
written, else at one temporary folder removed at exit; one line on stderr says where. A folder that can be
written is left alone, and nothing is said.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

CACHE_ENV = "OMNI_STRESS_CACHE_DIR"


def _cache_base() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg).expanduser() if xdg else Path.home() / ".cache"


#: The libraries each command imports that write a cache (the others are left alone, and nothing is said).
USES = {"run": ("vLLM", "matplotlib"), "sweep": ("vLLM", "matplotlib"), "report": ("matplotlib",),
        "conform": ("vLLM",)}


def _library_dirs(libraries: tuple[str, ...]) -> list[tuple[str, str, Path]]:
    """(library, environment variable, the folder it will write) for each library cache handled here."""
    base = _cache_base()
    vllm = os.environ.get("VLLM_CACHE_ROOT")
    mpl = os.environ.get("MPLCONFIGDIR")
    dirs = [("vLLM", "VLLM_CACHE_ROOT", Path(vllm).expanduser() if vllm else base / "vllm"),
            ("matplotlib", "MPLCONFIGDIR", Path(mpl).expanduser() if mpl else base / "matplotlib")]
    return [d for d in dirs if d[0] in libraries]


def unwritable(path: Path) -> str | None:
    """Why ``path`` (existing or not) cannot be made and written, or None. Nothing is created: the nearest
    existing folder on its way must be a folder this process may write into."""
    p = path if path.is_absolute() else Path.cwd() / path
    try:
        while not p.exists():
            if p.is_symlink():
                return f"{p} is a dangling symbolic link"
            if p.parent == p:
                break
            p = p.parent
        if not p.is_dir():
            return f"{p} is not a folder"
    except OSError as exc:  # a folder on the way this user may not enter (HOME=/root for another user)
        return f"{p}: {exc.strerror or exc}"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable"
    return None


def redirect_unwritable(command: str | None = None) -> None:
    """Points each cache that ``command``'s libraries write and that cannot be written at a folder that can,
    saying so once (``USES``: the caches of libraries the command does not use are left alone)."""
    for env in ("VLLM_CACHE_ROOT", "MPLCONFIGDIR"):
        if os.environ.get(env) == "":  # set but empty: vLLM would write its caches into the working folder
            del os.environ[env]
    libraries = USES.get(command or "", ())
    if not libraries:
        return
    bad = [(lib, env, path, why) for lib, env, path in _library_dirs(libraries)
           if (why := unwritable(path)) is not None]
    if not bad:
        return
    own_env = os.environ.get(CACHE_ENV)
    own = Path(own_env).expanduser() if own_env else _cache_base() / "omni-stress"
    if unwritable(own / "libraries") is None:
        root = own / "libraries"
    else:
        root = Path(tempfile.mkdtemp(prefix="omni-stress-cache-"))
        atexit.register(shutil.rmtree, root, True)
    for lib, env, _path, _why in bad:
        os.environ[env] = str(root / lib.lower())
    libs = " and ".join(f"{lib}'s" for lib, *_ in bad)
    where = f"{root} (a temporary folder, removed at exit)" if root.name != "libraries" else str(root)
    sys.stderr.write(f"omni-stress: warning: cache folder {bad[0][2]} cannot be written ({bad[0][3]}); "
                     f"{libs} cache{'s' if len(bad) > 1 else ''} go{'' if len(bad) > 1 else 'es'} to {where} "
                     f"for this command\n")
    sys.stderr.flush()


ORT_TELEMETRY_LINE = "Failed to persist telemetry device ID"


def import_onnxruntime_quietly() -> None:
    """onnxruntime (faster-whisper's VAD) tries at import to keep a telemetry ID in ``$XDG_CACHE_HOME/Microsoft``
    and, when that folder cannot be written, says so from C++ on file descriptor 2, once in every ASR process,
    whatever ``--quiet`` says (issue 47, case 7); it has no variable of its own to point elsewhere. In that case
    it is imported here with descriptor 2 captured, and every other line it wrote is passed on."""
    if "onnxruntime" in sys.modules or unwritable(_cache_base() / "Microsoft") is None:
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            pass
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode("utf-8", errors="replace")
    kept = "".join(ln for ln in text.splitlines(keepends=True) if ORT_TELEMETRY_LINE not in ln)
    if kept:
        sys.stderr.write(kept)
        sys.stderr.flush()
