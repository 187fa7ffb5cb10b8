"""The plots of a run are drawn once: ``report`` reuses the PNGs ``run`` drew, when nothing they show changed.

Drawing the three plots of the default matrix takes about 1.7 s of CPU (matplotlib's text layout,
``tight_layout`` and the PNG encoder), importing pyplot another 0.7 s: most of what ``omni-stress
report`` did on a run whose report files ``omni-stress run`` had just written. ``remember`` writes
``plots/.render-key.json`` beside the PNGs: the render key and each PNG's sha256. ``cached_images``
returns the PNGs in ``plots/`` only when the key is the same and every file still has the bytes it
recorded; anything else (no key file, a changed record, new code, a PNG replaced or a symlink) and
the plots are drawn again (``harness.report.plots.render_all``), so the bytes written are always the
ones drawing would give.

The render key covers what the pictures are drawn from: the bytes of the run's manifest, requests
and spans (``Run.digest``, set by ``summary.load_run``; a Run built by hand has none and is always
drawn), the cells (their repr), the source of the modules that draw and count, the matplotlib and
numpy versions, Python's, and every matplotlibrc file matplotlib could read with the environment
variables that choose them. This module imports neither matplotlib nor numpy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

PLOT_NAMES = ("wer", "events", "timeline")  # plots.render_all's order, which the HTML follows
RENDER_KEY_FILE = ".render-key.json"
KEY_VERSION = 1
_KEY_SOURCES = ("plots.py", "summary.py", "contract.py", "records.py", "plotcache.py")
_RC_ENV = ("MATPLOTLIBRC", "MPLCONFIGDIR", "XDG_CONFIG_HOME", "HOME", "MPLBACKEND")


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "-"


def _matplotlib_files() -> list[str]:
    """Digests of matplotlib's version file and of every matplotlibrc it could read (cwd,
    $MATPLOTLIBRC, the config folder, its own default), as matplotlib.matplotlib_fname looks."""
    spec = importlib.util.find_spec("matplotlib")
    package = Path(spec.origin).parent if spec is not None and spec.origin else None
    candidates = [Path("matplotlibrc")]
    rc_env = os.environ.get("MATPLOTLIBRC")
    if rc_env:
        candidates += [Path(rc_env), Path(rc_env) / "matplotlibrc"]
    config_dirs = [os.environ.get("MPLCONFIGDIR"), os.environ.get("XDG_CONFIG_HOME") and
                   os.path.join(os.environ["XDG_CONFIG_HOME"], "matplotlib"),
                   os.path.join(os.path.expanduser("~"), ".config", "matplotlib")]
    candidates += [Path(d) / "matplotlibrc" for d in config_dirs if d]
    if package is not None:
        candidates += [package / "_version.py", package / "mpl-data" / "matplotlibrc"]
    return [f"{p}:{_file_digest(p)}" for p in candidates]


def render_key(run: Any, cells: list[Any]) -> str | None:
    """The key of the plots of ``run`` and ``cells``; None for a run not read by ``load_run``."""
    digest = getattr(run, "digest", None)
    if digest is None:
        return None
    here = Path(__file__).resolve().parent
    numpy = sys.modules.get("numpy")
    parts = [KEY_VERSION, sys.version, getattr(numpy, "__version__", None), digest, repr(cells),
             [_file_digest(here / name) for name in _KEY_SOURCES], _matplotlib_files(),
             [os.environ.get(name) for name in _RC_ENV]]
    return hashlib.sha256(json.dumps(parts).encode("utf-8", "surrogateescape")).hexdigest()


def cached_images(plot_dir: Path, key: str | None) -> dict[str, bytes] | None:
    """{name: PNG bytes} from ``plot_dir`` when ``remember`` recorded them under ``key``, else None."""
    if key is None:
        return None
    try:
        saved = json.loads((plot_dir / RENDER_KEY_FILE).read_text(encoding="utf-8"))
        if not isinstance(saved, dict) or saved.get("key") != key:
            return None
        digests = saved.get("png_sha256")
        if not isinstance(digests, dict) or not set(digests) <= set(PLOT_NAMES) or not {"wer", "events"} <= set(digests):
            return None
        out = {}
        for name in [n for n in PLOT_NAMES if n in digests]:
            fd = os.open(plot_dir / f"{name}.png", os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with open(fd, "rb") as fh:
                data = fh.read()
            if hashlib.sha256(data).hexdigest() != digests[name]:
                return None
            out[name] = data
    except (OSError, ValueError):
        return None
    return out


def remember(plot_dir: Path, key: str | None, images: dict[str, bytes]) -> None:
    """Records ``images`` (already written to ``plot_dir``) under ``key``; without a key, forgets."""
    from harness.records import write_file_atomic

    path = plot_dir / RENDER_KEY_FILE
    if key is None:
        try:
            path.unlink()
        except OSError:
            pass
        return
    write_file_atomic(path, json.dumps({"key": key, "png_sha256": {
        name: hashlib.sha256(png).hexdigest() for name, png in images.items()}}, sort_keys=True) + "\n")
