"""Where cells run: the seam between the pipeline (which alone writes the run directory) and the
backends (which run one cell). Arrows point one way: the pipeline uses an executor, an executor
uses a backend, a backend never imports the pipeline.

``local`` (default): the backend itself, on this machine (the sim forks up to two worker
processes; the real backend starts one server per cell). ``ray``: each cell a Ray task on a
cluster (``harness.executors.ray``, imported only when asked for); its records, spans and audio
come back to the driver, which writes them exactly as a local run does.

The registry maps ``--executor``'s name to a module with three hooks: ``preflight(address)`` (before
any run directory exists: is the executor usable with this ``--ray-address``),
``make_executor(run_dir, options)`` (the ``harness.backends.Backend`` interface over the backend) and
``make_asr_pool(spec, options)`` (where Whisper scores the clips: worker processes here, or actors
on the Ray cluster; either way the transcripts come back to the driver, the one writer).
Nothing outside a module named here tests an executor's name.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from harness.errors import UserError

if TYPE_CHECKING:
    from harness.backends import Backend, RunOptions

EXECUTOR_MODULES: dict[str, str] = {
    "local": "harness.executors.local",
    "ray": "harness.executors.ray",
}
EXECUTORS = tuple(EXECUTOR_MODULES)


def get_executor(name: str) -> ModuleType:
    module = EXECUTOR_MODULES.get(name)
    if module is None:
        raise UserError(f"--executor {name!r}: unknown executor (choose {' or '.join(EXECUTORS)})")
    return importlib.import_module(module)


def make_executor(run_dir: Path, options: RunOptions) -> Backend:
    """The executor ``options.executor`` names, over the backend ``options.backend`` names. Both
    have the ``Backend`` interface: ``open`` with every cell, ``run_cell`` each in order (its records
    and spans handed to the caller's ``emit``), ``close`` on every path."""
    return get_executor(getattr(options, "executor", "local")).make_executor(run_dir, options)
