"""The run directory, below the commands: opening a new one or a ``--resume``d one, its lock, its
manifest (written first, checked on resume), and the guards around it: a safe ``--run-id``, records
that ``--resume`` can trust, a full disk or exhausted memory said in one line. ``run`` and
``sweep`` both use it (``open_run_dir``, ``in_run_dir``, ``start_manifest``).

Each check fails with a ``UserError`` naming the file (and line, or field), so the CLI prints one
line and exits 2 (docs/robustness.md).
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.backends import DEFAULT_SIM_TALKER, is_simulated
from harness.config import check_name
from harness.errors import UserError, WorkerOutOfMemory, out_of_memory
from harness.family import DEFAULT_FAMILY
from harness.records import (
    MANIFEST_FILE,
    REQUESTS_FILE,
    SPANS_FILE,
    read_manifest,
    read_requests,
    truncate_torn_tail,
    write_manifest,
)
from harness.spanstore import span_cells as stored_span_cells

LOCK_FILE = ".lock"
_held: set[int] = set()  # lock fds this process holds


def _close_in_child() -> None:
    """A forked child (a sim worker) must not keep the run's lock: after a SIGKILL of the run its
    workers live on for up to half a second (``proc.exit_with_parent``), and a ``--resume`` then
    would find the directory still locked. An flock lives while any copy of its fd is open."""
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


# Environment variables that name folders a run uses later (caches, matplotlib's config): pinned
# to absolute paths at start with the options, so an arm that changes the working directory
# cannot move them (issue 24 case 6).
PATH_ENV = ("OMNI_STRESS_CACHE_DIR", "XDG_CACHE_HOME", "MPLCONFIGDIR")


def absolute(path: Path | str | None) -> Path | None:
    """``path`` made absolute against today's working directory (``~`` expanded, symbolic links
    kept as given, bytes that are not UTF-8 kept), so nothing a plugin does to the working
    directory later (``os.chdir`` at import or in a call) moves the run's files."""
    if path is None:
        return None
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def pin_path_env() -> None:
    """Each of ``PATH_ENV`` that is set to a relative path, set to its absolute path now."""
    for name in PATH_ENV:
        value = os.environ.get(name)
        if value and not os.path.isabs(os.path.expanduser(value)):
            os.environ[name] = str(absolute(value))


def check_run_id(run_id: str) -> None:
    """``--run-id`` names one folder inside ``--out``: no separators, no ``..``, not absolute."""
    if (bad := check_name(run_id)) is not None:
        raise UserError(f"--run-id: {bad}")


@contextmanager
def locked(run_dir: Path) -> Iterator[None]:
    """Holds ``RUN_DIR/.lock`` (``flock``) while a run writes the directory: a second ``run
    --resume`` of the same directory is refused instead of appending duplicate records. The lock
    goes with the process (also on SIGKILL: the kernel releases it); the file stays, empty."""
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise UserError(f"{path}: cannot open the run directory's lock ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise UserError(f"{path}: cannot lock the run directory ({exc.strerror})") from None
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            raise UserError(f"{run_dir}: another omni-stress run is writing this run directory"
                            f"{f' (pid {holder})' if holder.isdigit() else ''}; wait for it to finish or stop it, "
                            "then --resume") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held.add(fd)
        yield
    finally:
        _held.discard(fd)
        os.close(fd)  # releases the lock


RUN_FILES = (MANIFEST_FILE, REQUESTS_FILE, SPANS_FILE, LOCK_FILE)
RUN_FOLDERS = ("audio", "spans")  # spans/: the span store (harness.spanstore)


def check_run_files(run_dir: Path) -> None:
    """The files a run reads and appends to are regular files of the run directory: a symlink (a
    downloaded CI artifact can carry one to a file elsewhere, which ``--resume`` would append to) or
    a folder in place of a file is refused with one line naming it (issue 24, cases 4 and 17)."""
    for name in RUN_FILES + RUN_FOLDERS:
        path = run_dir / name
        if path.is_symlink():
            try:
                target = f" to {os.readlink(path)}"
            except OSError:
                target = ""
            raise UserError(f"{path}: is a symbolic link{target}; refused: the files of a run directory must be "
                            "its own (a copied artifact can carry a link to a file elsewhere, which would be read and "
                            "written); replace the link with a copy of the file")
        if not path.exists():
            continue
        if name in RUN_FOLDERS and not path.is_dir():
            raise UserError(f"{path}: is not a folder; a run directory's {name}/ holds the run's files")
        if name not in RUN_FOLDERS and not path.is_file():
            kind = "a folder" if path.is_dir() else "not a regular file"
            raise UserError(f"{path}: is {kind}; a run directory's {name} must be a regular file")


_MANIFEST_TYPES: dict[str, tuple[type, ...]] = {
    "config_hashes": (dict,), "cells": (list,), "backend": (str,), "asr": (dict,), "seed": (int,),
    "resumed": (list,), "cell_wall_s": (dict,),
}


def read_resumable_manifest(run_dir: Path) -> dict[str, Any]:
    """The manifest of a run directory to resume, checked enough that resuming cannot trip on it."""
    from harness.records import read_manifest

    path = run_dir / MANIFEST_FILE
    if not path.is_file():
        raise UserError(f"--resume {run_dir}: not a run directory (no {MANIFEST_FILE})")
    try:
        manifest = read_manifest(run_dir)
    except (ValueError, OSError) as exc:  # JSON or UTF-8 errors are ValueErrors
        raise UserError(f"{path}: unreadable manifest ({' '.join(str(exc).split())})") from None
    except RecursionError:
        raise UserError(f"{path}: unreadable manifest (nested too deeply)") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path}: unreadable manifest (expected a JSON object, got {_json_type(manifest)})")
    for key, types in _MANIFEST_TYPES.items():
        value = manifest.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            want = {dict: "an object", list: "a list", str: "a string", int: "an integer"}[types[0]]
            raise UserError(f"{path}: {key}: expected {want}, got {_json_type(value)}")
    for i, cell in enumerate(manifest.get("cells") or []):
        if not isinstance(cell, dict) or not all(k in cell for k in ("arm", "deploy", "repeat")):
            raise UserError(f"{path}: cells[{i}]: expected an object with arm, deploy and repeat")
    return manifest


def check_same_scoring(run_dir: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    """A resumed run is scored as it started: WER from one ASR backend, model and beam, so its
    table never mixes Whisper with oracle scores (or two Whisper models)."""
    was, now = old.get("asr"), new.get("asr")
    if was != now:
        raise UserError(f"--resume {run_dir}: asr differs from the manifest (was {_asr_text(was)}, now "
                        f"{_asr_text(now)}); resume with the same --asr/--asr-model/--beam-size/--asr-batch, or start a new run")


def _asr_text(asr: Any) -> str:
    if not isinstance(asr, dict):
        return repr(asr)
    if asr.get("backend") == "none":
        return "--asr none"
    batch = f" --asr-batch {asr['batch']}" if asr.get("batch") else ""
    return f"--asr {asr.get('backend')} --asr-model {asr.get('model')} --beam-size {asr.get('beam_size')}{batch}"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def count_records(run_dir: Path) -> int:
    """Complete lines in ``requests.jsonl`` (what a resume keeps)."""
    try:
        with open(run_dir / REQUESTS_FILE, "rb") as fh:
            return sum(1 for line in fh if line.endswith(b"\n") and line.strip())
    except OSError:
        return 0


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _remove_empty_run_dir(run_dir: Path) -> bool:
    """Removes a run directory that holds nothing but what ``prepare_run_dir`` and the lock made (an
    empty ``audio/``, ``.lock``, temporary files); False, and nothing removed, if it holds more."""
    try:
        entries = list(run_dir.iterdir())
        own = {LOCK_FILE, "audio"}
        if any(p.name not in own and not p.name.endswith(".tmp") for p in entries):
            return False
        if (run_dir / "audio").is_dir() and any((run_dir / "audio").iterdir()):
            return False
        for p in entries:
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
            else:
                p.unlink()
        run_dir.rmdir()
    except OSError:
        return False
    return True


def disk_full_error(exc: OSError, run_dir: Path) -> UserError:
    """``OSError: [Errno 28]`` while a run writes, as one line that says what is kept and what to do.

    Before the first manifest is in, nothing was recorded and ``--resume`` could not continue (it
    needs the manifest): the new run directory is removed, so running the same command again works
    (issue 24, case 19)."""
    what = exc.strerror or "no space left on device"
    where = f" writing {exc.filename}" if exc.filename else ""
    if not (run_dir / MANIFEST_FILE).exists() and _remove_empty_run_dir(run_dir):
        return UserError(f"{what.lower()}{where}: nothing was recorded and {run_dir} was removed; free some space, "
                         "then run the same command again")
    n = count_records(run_dir)
    return UserError(f"{what.lower()}{where}: {n} record{'s' if n != 1 else ''} kept in {run_dir}; "
                     f"free some space, then --resume {run_dir} continues")



def out_of_memory_error(exc: BaseException, run_dir: Path) -> UserError:
    """The run's own process out of memory (an arm that keeps what it allocated, a low ``ulimit
    -v``), as one line that says what is kept and what to do (issue 24, case 10). Records are
    written as each request ends, so nothing measured is lost; the resume completes the run and
    writes its report."""
    what = ("MemoryError" if isinstance(exc, MemoryError) else "Cannot allocate memory" if isinstance(exc, OSError)
            else "no memory to load a library")
    where = f"a sim worker (cell {exc.cell})" if isinstance(exc, WorkerOutOfMemory) else "the run's process"
    if not (run_dir / MANIFEST_FILE).exists() and _remove_empty_run_dir(run_dir):
        return UserError(f"out of memory in {where} ({what}): nothing was recorded and {run_dir} was removed; raise "
                         "the process's memory limit (ulimit -v), then run the same command again")
    n = count_records(run_dir)
    return UserError(f"out of memory in {where} ({what}): {n} record{'s' if n != 1 else ''} kept in "
                     f"{run_dir}; an arm may be holding memory it allocated (its failed requests are recorded), or "
                     f"the memory limit (ulimit -v) is too low: raise it, then --resume {run_dir} completes the run "
                     "and writes its report")


# --------------------------------------------------------------------------- opening and resuming


def manifest_sim_talker(manifest: dict[str, Any]) -> str | None:
    """The sim Talker mode a run's manifest records: a sim run written before the modes ran ``words``;
    None for a real-backend run."""
    if not is_simulated(manifest.get("backend", "sim")):
        return None
    mode = manifest.get("sim_talker")
    return mode if isinstance(mode, str) else DEFAULT_SIM_TALKER


def manifest_trace(manifest: dict[str, Any]) -> str | None:
    """The ``--trace`` level a run's manifest records: None on the sim, ``contract`` for a real run
    written before the option (issue 34) existed."""
    if is_simulated(manifest.get("backend", "sim")):
        return None
    level = manifest.get("trace")
    return level if isinstance(level, str) else "contract"


def manifest_family(manifest: dict[str, Any]) -> str:
    """The model family a run's manifest records (a run written before families: Qwen2.5-Omni)."""
    family = manifest.get("family")
    return family if isinstance(family, str) else DEFAULT_FAMILY


def same_family(what: str, first: dict[str, Any], second: dict[str, Any], why: str) -> str:
    """The model family two runs share (their manifests); two families are one line naming both, ``why``
    saying what the command cannot do with them (``fidelity``, ``compare``)."""
    families = manifest_family(first), manifest_family(second)
    if families[0] != families[1]:
        raise UserError(f"{what}: the first run is of family {families[0]!r}, the second of {families[1]!r}; {why}")
    return families[0]


def prepare_run_dir(out: Path, run_id: str) -> Path:
    run_dir = out / run_id
    try:
        run_dir.mkdir(parents=True, exist_ok=False)
        (run_dir / "audio").mkdir()
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except FileExistsError:
        raise UserError(f"{run_dir}: run directory exists already (use --resume {run_dir} or another --run-id)") \
            from None
    except OSError as exc:
        raise UserError(f"--out {out}: output directory not writable ({exc.strerror})") from None
    return run_dir


@dataclass
class ResumeState:
    done: set[tuple] = field(default_factory=set)  # (arm, deploy, repeat, prompt) recorded
    span_cells: set[tuple] = field(default_factory=set)  # (arm, deploy, repeat) whose spans are written


def check_resume(run_dir: Path, plan_manifest: dict[str, Any]) -> ResumeState:
    """What is already recorded; refuses a run dir made with a different configuration."""
    if not (run_dir / MANIFEST_FILE).is_file():
        raise UserError(f"--resume {run_dir}: not a run directory (no {MANIFEST_FILE})")
    try:
        old = read_manifest(run_dir)
    except ValueError as exc:
        raise UserError(f"{run_dir / MANIFEST_FILE}: unreadable manifest ({exc})") from None
    for key in ("config_hashes", "cells", "seed", "backend", "family", "sim_talker", "trace", "stream"):
        was, now = old.get(key), plan_manifest.get(key)
        if key == "family":  # a run written before families ran Qwen2.5-Omni
            was, now = manifest_family(old), manifest_family(plan_manifest)
        if key == "cells":  # a finished run's cells also carry their wall_s
            was, now = _cell_keys(was), _cell_keys(now)
        if key == "sim_talker":
            was, now = manifest_sim_talker(old), manifest_sim_talker(plan_manifest)
        if key == "trace":  # a real run written before --trace traced at contract
            was, now = manifest_trace(old), manifest_trace(plan_manifest)
        elif key == "stream":  # --stream on one side only: records measured two ways in one run
            was, now = bool(old.get("stream")), bool(plan_manifest.get("stream"))
        if key == "config_hashes" and isinstance(was, dict) and isinstance(now, dict):
            arm = next((k for k in now if k.startswith("arm:") and k in was and was[k] != now[k]), None)
            if arm is not None:
                raise UserError(f"--resume {run_dir}: arm {arm[4:]!r}: its code changed since the run started "
                                f"(was {was[arm]}, now {now[arm]}); resuming would mix records of two "
                                "implementations; start a new run instead")
        if was != now:
            raise UserError(f"--resume {run_dir}: {key} differ from the manifest "
                            f"(was {was!r}, now {now!r}); start a new run instead")
    truncate_torn_tail(run_dir / REQUESTS_FILE)
    truncate_torn_tail(run_dir / SPANS_FILE)
    try:
        done = {r.key for r in read_requests(run_dir)}
        span_cells = stored_span_cells(run_dir)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return ResumeState(done, span_cells)


def _cell_keys(cells: Any) -> list[tuple]:
    if not isinstance(cells, list):
        return []
    return [(c.get("arm"), c.get("deploy"), c.get("repeat")) if isinstance(c, dict) else c for c in cells]


def open_run_dir(out: Path, resume_dir: Path | None, run_id: Callable[[], str]) -> Path:
    """``--resume``'s run directory (checked), else a new one named ``run_id()`` inside ``out``."""
    if resume_dir is not None:
        if not (resume_dir / MANIFEST_FILE).is_file():
            raise UserError(f"--resume {resume_dir}: not a run directory (no {MANIFEST_FILE})")
        check_run_files(resume_dir)  # before the lock: .lock itself may be the planted link
        return resume_dir
    return prepare_run_dir(out, run_id())


def in_run_dir(run_dir: Path, work: Callable[[], str]) -> str:
    """``work()`` holding the run directory's lock; a full disk or exhausted memory is one line naming it."""
    with locked(run_dir):
        try:
            return work()
        except (OSError, MemoryError, ImportError) as exc:
            if isinstance(exc, OSError) and exc.errno in DISK_FULL:
                raise disk_full_error(exc, run_dir) from None
            if not out_of_memory(exc):
                raise
            exc.__traceback__ = None  # free what the failed frames held before the message is built
            raise out_of_memory_error(exc, run_dir) from None


def start_manifest(run_dir: Path, planned: dict[str, Any], resume: bool,
                   check: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """A new run writes its planned manifest; a resumed one checks the recorded manifest against it
    (``check`` first: a command's own condition), notes the command line and returns what is done."""
    if not resume:
        write_manifest(run_dir, planned)
        return None
    manifest = read_resumable_manifest(run_dir)
    if check is not None:
        check(manifest)
    check_same_scoring(run_dir, manifest, planned)
    state = check_resume(run_dir, planned)
    manifest.setdefault("resumed", []).append(" ".join(sys.argv))
    manifest["finished"] = None
    write_manifest(run_dir, manifest)
    return state


def absolute_paths(out, resume_dir, cache_dir, arms_file, serve_python, asr_model):
    """The path options of ``run`` and ``sweep`` made absolute, and the environment's cache folders
    pinned, once as the command starts: a plugin arm may os.chdir() when imported or called."""
    out, resume_dir, cache_dir, arms_file = absolute(out), absolute(resume_dir), absolute(cache_dir), absolute(arms_file)
    serve_python = absolute(serve_python) if serve_python is not None and serve_python.exists() else serve_python
    pin_path_env()
    return out, resume_dir, cache_dir, arms_file, serve_python, _absolute_model(asr_model)


def _absolute_model(model: str) -> str:
    """``--asr-model``: a path (one that exists, or is written as a path) made absolute; a model name
    (``base``, ``tiny.en``, an openai-whisper name) kept."""
    from harness.audio.asr import PACKAGED_MODELS

    if model in PACKAGED_MODELS:
        return model
    looks_like_path = os.sep in model or model.startswith(("~", ".")) or model.endswith(".pt")
    if looks_like_path or os.path.exists(model):
        return str(absolute(model))
    return model


def say_when_interrupted(run_dir: Path, planned: int, command: str) -> None:
    """What a Ctrl-C leaves behind, for the one line ``harness.interrupt`` prints: the records on disk
    (every completed request is kept) and the command that completes the run."""
    from harness import interrupt

    def line() -> str:
        held = count_records(run_dir)
        if held >= planned:
            return (f"{run_dir} holds all {planned} request records; `omni-stress {command} --resume {run_dir}` "
                    f"(same options) writes its reports")
        return (f"{run_dir} holds {held} of {planned} request records; `omni-stress {command} --resume {run_dir}` "
                f"(same options) completes it")

    interrupt.describe(line)
