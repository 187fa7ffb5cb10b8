"""The local executor: a cell runs in the backend on this machine (the default)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from harness.errors import UserError

if TYPE_CHECKING:
    from harness.backends import Backend, RunOptions

BACKENDS = ("sim", "vllm-omni")


def make_backend(name: str, run_dir: Path, options: RunOptions) -> Backend:
    """The backend named by ``--backend``, for this run's options."""
    if name == "sim":
        from harness.sim.backend import SimBackend

        return SimBackend(run_dir, options)
    if name == "vllm-omni":
        from harness.serve.backend import ServeBackend

        return ServeBackend(run_dir, options.serve)
    raise UserError(f"--backend {name!r}: unknown backend (choose {' or '.join(BACKENDS)})")
