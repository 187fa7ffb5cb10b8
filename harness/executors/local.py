"""The local executor: a cell runs in the backend on this machine (the default)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from harness.backends import BACKENDS, get_backend

if TYPE_CHECKING:
    from harness.backends import Backend, RunOptions

__all__ = ["BACKENDS", "make_backend"]


def make_backend(name: str, run_dir: Path, options: RunOptions) -> Backend:
    """The backend named by ``--backend`` (``harness.backends.BACKENDS``), for this run's options."""
    return get_backend(name).make(run_dir, options)
