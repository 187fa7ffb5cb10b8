"""Which vLLM-Omni release ``--source`` names, and where its files are read from.

``--source`` takes ``vllm-omni:SOURCE`` or ``vllm-omni==VERSION``. SOURCE is a source tree (a checkout,
a site-packages folder, a vendored copy), a wheel file, a single ``.py`` file, ``installed``, or a version.
A version is looked up, in this order, as:

1. the installed ``vllm-omni`` distribution, when its version is that one (its site-packages folder);
2. a wheel of that version in omni-stress's wheel cache (``~/.cache/omni-stress/wheels``);
3. the vendored copy ``harness/conform/vendor/vllm-omni-<version>/`` (only the files the checks read,
   byte-identical to the PyPI wheel, hashes pinned in its README and in the tests): offline and fast;
4. ``pip download vllm-omni==<version> --no-deps`` into a temporary folder (pip reuses its own local
   cache when it has the wheel). ``OMNI_STRESS_OFFLINE=1`` skips this step.

Everything downstream (the adapters' ``read_model_source``, the deploy files in ``harness.conform.reach``)
then reads the resolved tree or wheel, so one run reads one release consistently.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from harness.errors import ConfigError, UserError

VENDOR_ROOT = Path(__file__).parent.parent / "conform" / "vendor"  # read by conform and by the families' arms
# The releases whose files are vendored (harness/conform/vendor/vllm-omni-<version>): the default --source.
VENDORED = ("0.30.0", "0.32.0rc1")
DEFAULT_SOURCES = tuple(f"vllm-omni:{v}" for v in VENDORED)
PIP_TIMEOUT_S = 180


@dataclass(frozen=True)
class Release:
    """One resolved ``--source``."""

    source: str  # as given, e.g. "vllm-omni:0.32.0rc1"
    spec: str  # what the readers get (harness.talkers.upstream.read_source): a path, or the spec unchanged
    kind: str  # installed | wheel-cache | vendored | downloaded | wheel | tree | file | version
    version: str | None
    location: str

    @property
    def label(self) -> str:
        v = self.version or "?"
        where = {"vendored": "vendored copy", "downloaded": "pip download", "wheel-cache": "cached wheel",
                 "installed": "installed"}.get(self.kind, self.kind)
        return f"vLLM-Omni {v} ({where}: {self.location})"


def vendor_dir(version: str) -> Path:
    return VENDOR_ROOT / f"vllm-omni-{version}"


def split_source(source: str) -> str:
    """``vllm-omni:SPEC`` or ``vllm-omni==VERSION`` -> SPEC (a UserError for anything else)."""
    if source.startswith("vllm-omni=="):
        return source[len("vllm-omni=="):]
    if source.startswith("vllm-omni:"):
        return source[len("vllm-omni:"):]
    raise UserError(f"--source {source}: give vllm-omni:SOURCE (a checkout, a wheel, a version or 'installed') "
                    f"or vllm-omni==VERSION")


def resolve(source: str, base_dir: Path | None = None, wheel_dir: Path | None = None) -> Release:
    """The release ``source`` names (``vllm-omni:SPEC``, ``vllm-omni==VERSION`` or a bare SPEC)."""
    spec = split_source(source) if source.startswith("vllm-omni") else source
    return _resolve(source, spec, str(base_dir) if base_dir else None, str(wheel_dir) if wheel_dir else None)


@lru_cache(maxsize=32)
def _resolve(source: str, spec: str, base_dir: str | None, wheel_dir: str | None) -> Release:
    from harness.talkers.upstream import _VERSION_RE, _same_version, _wheel_version, default_wheel_dir

    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = Path(base_dir or Path.cwd()) / path
    if path.is_dir():
        return Release(source, str(path), "tree", _tree_version(path), str(path))
    if path.is_file():
        kind = "wheel" if path.suffix == ".whl" else "file"
        version = _wheel_version(path.name) if kind == "wheel" else None
        return Release(source, str(path), kind, version, str(path))
    if spec == "installed":
        return Release(source, spec, "installed", _installed(), "site-packages")
    if not _VERSION_RE.match(spec):
        raise UserError(f"--source {source}: no such file or folder: {path}")
    installed = _installed()
    if installed is not None and _same_version(installed, spec):
        dist = importlib.metadata.distribution("vllm-omni")
        return Release(source, str(Path(str(dist.locate_file("")))), "installed", installed, "site-packages")
    cache = Path(wheel_dir) if wheel_dir else default_wheel_dir()
    for wheel in sorted(cache.glob("vllm_omni-*.whl")) if cache.is_dir() else []:
        v = _wheel_version(wheel.name)
        if v is not None and _same_version(v, spec):
            return Release(source, str(wheel), "wheel-cache", v, str(wheel))
    for v in VENDORED:
        if _same_version(v, spec) and vendor_dir(v).is_dir():
            return Release(source, str(vendor_dir(v)), "vendored", v, str(vendor_dir(v).relative_to(
                VENDOR_ROOT.parents[2])))
    if os.environ.get("OMNI_STRESS_OFFLINE"):
        raise UserError(f"--source {source}: vLLM-Omni {spec} is not installed, not in the wheel cache {cache} and "
                        f"not vendored, and OMNI_STRESS_OFFLINE is set (no pip download)")
    wheel = _pip_download(spec, source)
    return Release(source, str(wheel), "downloaded", _wheel_version(wheel.name) or spec, str(wheel))


_NOT_A_RELEASE = ("give a vLLM-Omni checkout or site-packages folder, a vllm_omni wheel, one model file (.py), "
                  "a version or 'installed'")


def check_release(release: Release) -> Release:
    """``release`` when its file can be a release; a ``UserError`` naming ``--source`` for a file that cannot
    (a text file, a wheel of another package, a file that is no zip), before anything is checked against it
    (issue 33, case 9). Folders and versions are read as they are (what they lack is said per model)."""
    path = Path(release.spec)
    where = f"--source {release.source}"
    if release.kind in ("wheel", "wheel-cache", "downloaded"):
        try:
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
        except (zipfile.BadZipFile, OSError) as exc:
            raise UserError(f"{where}: {path} is not a wheel ({exc}); {_NOT_A_RELEASE}") from None
        if not any(n.startswith("vllm_omni/") for n in names):
            raise UserError(f"{where}: wheel {path} holds no vllm_omni package, so it is not a vLLM-Omni "
                            f"release; {_NOT_A_RELEASE}") from None
    elif release.kind == "file":
        import ast

        why = None
        if path.suffix != ".py":
            why = f"{path.name} is not a Python file (.py)"
        else:
            try:
                ast.parse(path.read_bytes(), str(path))
            except (SyntaxError, ValueError, OSError, UnicodeDecodeError) as exc:
                why = f"{path.name} is not Python source ({type(exc).__name__}: {getattr(exc, 'msg', None) or exc})"
        if why is not None:
            raise UserError(f"{where}: {why}, so it is not a vLLM-Omni release or model file; {_NOT_A_RELEASE}")
    return release


def _installed() -> str | None:
    try:
        return importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return None


def _tree_version(path: Path) -> str | None:
    from harness.talkers.upstream import _SCM_VERSION_RE

    for root in (path, *sorted(path.glob("*"))[:50]):
        vp = root / "vllm_omni" / "_version.py"
        if vp.is_file():
            m = _SCM_VERSION_RE.search(vp.read_text(encoding="utf-8", errors="replace"))
            return m.group(1) if m else None
    return None


def _pip_download(version: str, source: str) -> Path:
    """``pip download vllm-omni==VERSION --no-deps`` into a temporary folder removed at exit."""
    tmp = Path(tempfile.mkdtemp(prefix="omni-stress-vllm-omni-"))
    atexit.register(shutil.rmtree, tmp, True)
    cmd = [sys.executable, "-m", "pip", "download", f"vllm-omni=={version}", "--no-deps", "--pre",
           "--only-binary=:all:", "-d", str(tmp), "-q"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"--source {source}: `pip download vllm-omni=={version}` failed: {exc}") from None
    wheels = sorted(tmp.glob("vllm_omni-*.whl"))
    if out.returncode != 0 or not wheels:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise UserError(f"--source {source}: vLLM-Omni {version} is not installed, cached or vendored, and "
                        f"`pip download vllm-omni=={version} --no-deps` failed: {tail[0]}")
    return wheels[0]


def deploy_names(release_spec: str) -> list[str] | None:
    """The file names under ``vllm_omni/deploy/`` of a resolved tree or wheel (None: not listable)."""
    path = Path(release_spec)
    if path.is_dir():
        for d in (path / "vllm_omni" / "deploy", *sorted(path.glob("*/vllm_omni/deploy"))[:1]):
            if d.is_dir():
                return sorted(p.name for p in d.glob("*.yaml"))
        return []
    if path.is_file() and path.suffix == ".whl":
        try:
            with zipfile.ZipFile(path) as zf:
                return sorted(n.rsplit("/", 1)[1] for n in zf.namelist()
                              if n.startswith("vllm_omni/deploy/") and n.endswith(".yaml") and n.count("/") == 2)
        except (zipfile.BadZipFile, OSError):
            return None
    return None


def _to_device_nonblocking(tensor: Any, device: Any) -> Any:
    """``vllm_omni.utils.device_copy.to_device_nonblocking`` (0.32.0rc1) on the CPU: its own CPU branch,
    ``tensor.to(device)`` (the pinned non-blocking copy is for CUDA/NPU targets only)."""
    import torch

    return tensor.to(torch.device(device))


def _index_to_device(values: Any, device: Any, dtype: Any = None) -> Any:
    """``vllm_omni.utils.device_copy.index_to_device`` (0.32.0rc1) on the CPU: its own CPU branch
    (``dtype`` defaults to ``torch.long``)."""
    import torch

    return torch.tensor(values, dtype=torch.long if dtype is None else dtype, device=device)


# Names newer releases import that carry no model logic (device copies): their CPU branches, for every adapter.
RELEASE_SHIMS: dict[tuple[str, str], Any] = {
    ("vllm_omni.utils.device_copy", "to_device_nonblocking"): _to_device_nonblocking,
    ("vllm_omni.utils.device_copy", "index_to_device"): _index_to_device,
}


def read_model_source(spec: str, member: str, base_dir: Path | None = None, wheel_dir: Path | None = None) -> Any:
    """``harness.talkers.upstream.read_source`` for ``member``; a version that is neither installed nor
    cached falls back to the vendored copy of that version (``harness/conform/vendor/vllm-omni-<version>``)."""
    from harness.talkers.upstream import _VERSION_RE, read_source

    try:
        return read_source(spec, base_dir, wheel_dir, member=member)
    except ConfigError:
        for version in VENDORED:
            if _VERSION_RE.match(spec) and _same(spec, version) and (vendor_dir(version) / member).is_file():
                src = read_source(str(vendor_dir(version)), None, wheel_dir, member=member)
                return type(src)(spec, "vendored", src.location, src.version, src.sha256, src.text)
        raise


def _same(a: str, b: str) -> bool:
    from harness.talkers.upstream import _same_version

    return _same_version(a, b)


def release_or_plugin(arm: Any, hook: str, family: str, release_mixin: Any, plugin_base: str) -> Any:
    """A Qwen3 family's arm (``Family.load_arm``): ``vllm-omni:SOURCE`` is the release's own hook compiled by
    ``release_mixin(spec, base_dir)``; ``package.module:attr`` a class (or a function taken as ``hook``) whose
    methods replace the release's of the same name, laid over ``release_mixin(plugin_base)`` as a class bound
    into the real server would be over the installed release."""
    where = f"arm {arm.name!r} ({arm.talker}, from {arm.source})"
    arms_file = Path(arm.source)
    base = arms_file.parent if arm.source not in ("--arm", "builtin") and arms_file.is_file() else None
    if arm.talker.startswith("vllm-omni:"):
        try:
            return release_mixin(arm.talker[len("vllm-omni:"):], base)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    from harness.talkers import import_target

    obj = import_target(arm.talker, where)
    attr = arm.talker.partition(":")[2]
    if isinstance(obj, type):
        if not callable(getattr(obj, hook, None)):
            raise ConfigError(f"{where}: class {attr!r} has no {hook} method (the hook the {family} runner calls)")
        cls = obj
    elif callable(obj):
        cls = type(f"{attr}Arm", (), {hook: obj})
    else:
        raise ConfigError(f"{where}: {attr!r} is neither a class nor a function")
    return type(f"Plugin{cls.__name__}", (cls, release_mixin(plugin_base)), {})
