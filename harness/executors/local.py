"""The local executor: a cell runs in the backend on this machine (the default)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from harness.backends import BACKENDS, get_backend

if TYPE_CHECKING:
    from harness.audio.pool import AsrPool, PoolSpec
    from harness.backends import Backend, RunOptions

__all__ = ["BACKENDS", "make_asr_pool", "make_backend", "make_executor", "preflight"]


def make_backend(name: str, run_dir: Path, options: RunOptions) -> Backend:
    """The backend named by ``--backend`` (``harness.backends.BACKENDS``), for this run's options."""
    return get_backend(name).make(run_dir, options)


def preflight(address: str | None, dry_run: bool = False) -> None:
    """``--ray-address`` names a cluster: it means nothing without ``--executor ray``."""
    if address is not None:
        from harness.errors import UserError

        raise UserError(f"--ray-address {address}: applies to --executor ray")


def make_executor(run_dir: Path, options: RunOptions) -> Backend:
    """Locally, the executor is the backend itself."""
    return make_backend(options.backend, run_dir, options)


def make_asr_pool(spec: PoolSpec, options: RunOptions) -> AsrPool:
    """Whisper in worker processes on this machine (``harness.audio.pool``)."""
    from harness.audio.pool import AsrPool

    return AsrPool(spec)
