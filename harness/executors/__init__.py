"""Where cells run: the seam between the pipeline (which alone writes the run directory) and the
backends (which run one cell). Arrows point one way: the pipeline uses an executor, an executor
uses a backend, a backend never imports the pipeline.

``local`` (default): the backend itself, on this machine (the sim forks up to two worker
processes; the real backend starts one server per cell). ``ray``: each cell a Ray task on a
cluster (``harness.executors.ray``, imported only when asked for); its records, spans and audio
come back to the driver, which writes them exactly as a local run does.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from harness.errors import UserError

if TYPE_CHECKING:
    from harness.backends import Backend, RunOptions

EXECUTORS = ("local", "ray")


def make_executor(run_dir: Path, options: RunOptions) -> Backend:
    """The executor ``options.executor`` names, over the backend ``options.backend`` names. Both
    have the ``Backend`` interface: ``open`` with every cell, ``run_cell`` each in order (its records
    and spans handed to the caller's ``emit``), ``close`` on every path."""
    name = getattr(options, "executor", "local")
    if name == "local":
        from harness.executors.local import make_backend

        return make_backend(options.backend, run_dir, options)
    if name == "ray":
        from harness.executors.ray import RayExecutor

        return RayExecutor(run_dir, options)
    raise UserError(f"--executor {name!r}: unknown executor (choose {' or '.join(EXECUTORS)})")
