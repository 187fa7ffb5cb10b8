"""A sweep file: a base deploy, axes over any deploy key and the load, one ``Deploy`` per grid point.

Pure (reads YAML only). Every grid point is an ordinary deploy, so it is an ordinary cell of one run
directory: resumable, reported and gated like any other. Sweep file (``deploy_configs/sweeps/*.yaml``)::

    name: default
    description: "..."
    base: stress                  # deploy name or YAML path: every point starts from it
    reference: reference          # the cell each point is compared with (WER delta, duration); null: none
    jitter: 8                     # optional: load.jitter of every point (sim: seeded arrival jitter, steps)
    axes:                         # the grid is their product, in this order (list values mild to harsh:
      talker.max_num_batched_tokens: [16, 32, 64]   # the quality knee is the first failing point in it)
      talker.num_gpu_blocks_override: [128, 256]
      load: [all, c2, p0.05]      # all | cN (concurrency N) | pX (Poisson, X per step) | a load mapping

A point is named ``<base>@<axis>=<value>,...`` (``stress@mnbt=16,kv=128,load=c2``), with the short
names of ``SHORT_NAMES`` (else the key's last part). Each point is validated exactly like a deploy
file; an error names the sweep file, the axis and the value, and exits 2.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.config import (
    DEPLOY_DIR,
    MAX_NUM_SEQS,
    Deploy,
    _resolve,
    load_deploy,
    load_yaml,
    parse_deploy,
)
from harness.errors import ConfigError, short_repr

SWEEP_DIR = DEPLOY_DIR / "sweeps"
MAX_POINTS = 1024
TOP_KEYS = {"name", "description", "base", "reference", "jitter", "axes"}
SHORT_NAMES = {
    "talker.max_num_batched_tokens": "mnbt",
    "talker.num_gpu_blocks_override": "kv",
    "talker.max_num_seqs": "seqs",
    "talker.block_size": "bs",
    "talker.max_model_len": "mml",
    "talker.enable_chunked_prefill": "chunked",
    "thinker.max_num_seqs": "thinker_seqs",
    "speculative.num_speculative_tokens": "spec",
    "speculative.acceptance_rate": "accept",
    "sampling.seed": "sseed",
    "load": "load",
}
_LOAD_SHORT = re.compile(r"(?:all|c(\d+)|p(\d+(?:\.\d*)?|\.\d+)(?:e-?\d+)?)")


@dataclass(frozen=True)
class Axis:
    key: str  # dotted deploy key, or "load"
    short: str
    values: tuple[Any, ...]
    labels: tuple[str, ...]  # each value as the point names show it


@dataclass(frozen=True)
class Point:
    deploy: Deploy
    coords: tuple[tuple[str, str], ...]  # (axis short name, value label), in axis order

    @property
    def name(self) -> str:
        return self.deploy.name

    def coord(self, short: str) -> str | None:
        return dict(self.coords).get(short)


@dataclass(frozen=True)
class Sweep:
    name: str
    description: str
    path: Path
    base: Deploy
    reference: Deploy | None
    axes: tuple[Axis, ...]
    points: tuple[Point, ...]
    jitter: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def deploys(self) -> list[Deploy]:
        """The reference (first) and every point: the run's deploys."""
        return ([self.reference] if self.reference is not None else []) + [p.deploy for p in self.points]

    def describe(self) -> dict[str, Any]:
        """What the manifest records (``sweep``), and what the map and the map gate read back."""
        return {
            "name": self.name, "file": str(self.path), "base": self.base.name,
            "reference": self.reference.name if self.reference is not None else None,
            "jitter": self.jitter,
            "axes": [{"key": a.key, "short": a.short, "values": list(a.labels)} for a in self.axes],
            "points": [{"deploy": p.name, "coords": dict(p.coords)} for p in self.points],
        }


def resolve_sweep_path(name_or_path: str) -> Path:
    return _resolve(name_or_path, SWEEP_DIR, "sweep")


def load_sweep(name_or_path: str) -> Sweep:
    path = resolve_sweep_path(name_or_path)
    return parse_sweep(load_yaml(path), path)


def _fail(path: Path, where: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {where}: {msg}")


def parse_sweep(data: Any, path: Path) -> Sweep:
    if not isinstance(data, dict):
        raise _fail(path, "top level", f"expected a mapping with base and axes, got {type(data).__name__}")
    for key in data:
        if key not in TOP_KEYS:
            raise _fail(path, str(key)[:80], f"unknown key (allowed: {', '.join(sorted(TOP_KEYS))})")
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name.strip():
        raise _fail(path, "name", f"must be a non-empty string, got {short_repr(name)}")
    description = data.get("description", "") or ""
    if not isinstance(description, str):
        raise _fail(path, "description", f"must be a string, got {short_repr(description)}")
    base_name = data.get("base")
    if not isinstance(base_name, str) or not base_name.strip():
        raise _fail(path, "base", f"must name a deploy (a name in deploy_configs/ or a YAML path), got {short_repr(base_name)}")
    base = _load_named(path, "base", base_name)
    ref_name = data.get("reference", "reference")
    reference = None
    if ref_name is not None:
        if not isinstance(ref_name, str) or not ref_name.strip():
            raise _fail(path, "reference", f"must name a deploy or be null, got {short_repr(ref_name)}")
        reference = _load_named(path, "reference", ref_name)
    jitter = data.get("jitter")
    if jitter is not None and (isinstance(jitter, bool) or not isinstance(jitter, int) or not 0 <= jitter <= 100_000):
        raise _fail(path, "jitter", f"must be an integer in [0, 100000] (steps), got {short_repr(jitter)}")
    axes = _parse_axes(path, data.get("axes"))
    count = 1
    for axis in axes:
        count *= len(axis.values)
    if count > MAX_POINTS:
        raise _fail(path, "axes", f"{count} grid points, over the limit of {MAX_POINTS}; sweep fewer values")
    base_data = load_yaml(base.path)
    points = []
    names: dict[str, str] = {}
    if reference is not None:
        names[reference.name] = "reference"
    for combo in itertools.product(*(range(len(a.values)) for a in axes)):
        data_i = copy.deepcopy(base_data) if isinstance(base_data, dict) else {}
        overrides: list[tuple[str, Any]] = []
        coords = []
        for axis, i in zip(axes, combo):
            value = axis.values[i]
            _apply(data_i, axis.key, value)
            overrides.append((axis.key, _hashable(value)))
            coords.append((axis.short, axis.labels[i]))
        if jitter is not None:
            load = data_i.get("load")
            load = dict(load) if isinstance(load, dict) else {}
            load["jitter"] = jitter
            data_i["load"] = load
            overrides.append(("load.jitter", jitter))
        label = f"{base.name}@" + ",".join(f"{s}={v}" for s, v in coords)
        data_i["name"] = base.name  # validated as the base's name; the point's own name is set below
        where = "axes (" + ", ".join(f"{a.key}={a.labels[i]}" for a, i in zip(axes, combo)) + ")"
        try:
            deploy = parse_deploy(base.path, data_i, tuple(overrides))
        except ConfigError as exc:
            text = str(exc)
            prefix = f"{base.path}: "
            raise _fail(path, where, text[len(prefix):] if text.startswith(prefix) else text) from None
        if label in names:
            raise _fail(path, where, f"point name {label!r} given twice (two values of an axis print the same)")
        names[label] = where
        from dataclasses import replace

        desc = f"{base.description} | sweep {name}: " + ", ".join(f"{a.key}={a.labels[i]}" for a, i in zip(axes, combo))
        # a point is measured against the sweep's reference, whatever its base deploy declares
        points.append(Point(replace(deploy, name=label, description=desc, role="stress",
                                    pair=reference.name if reference is not None else None), tuple(coords)))
    return Sweep(name=name, description=description, path=path, base=base, reference=reference, axes=tuple(axes),
                 points=tuple(points), jitter=jitter)


def _load_named(path: Path, where: str, name: str) -> Deploy:
    try:
        return load_deploy(name)
    except ConfigError as exc:
        raise _fail(path, where, str(exc)) from None


def _parse_axes(path: Path, raw: Any) -> list[Axis]:
    if not isinstance(raw, dict) or not raw:
        raise _fail(path, "axes", "must be a mapping of deploy keys to lists of values "
                                  "(e.g. talker.max_num_batched_tokens: [16, 32, 64])")
    axes = []
    shorts: dict[str, str] = {}
    for key, values in raw.items():
        if not isinstance(key, str) or not re.fullmatch(r"[a-z_]+(\.[a-z_]+)?", key):
            raise _fail(path, f"axes.{short_repr(key)}", "an axis is a deploy key path such as "
                                                        "talker.max_num_batched_tokens, or load")
        section = key.split(".")[0]
        if key in ("name", "description") or section not in (
                "talker", "thinker", "code2wav", "sampling", "sim", "speculative", "load", "async_chunk"):
            raise _fail(path, f"axes.{key}", "not a deploy key that a sweep can vary (talker.*, thinker.*, code2wav.*, "
                                             "sampling.*, sim.*, speculative.*, async_chunk, load, load.*)")
        if not isinstance(values, list) or not values:
            raise _fail(path, f"axes.{key}", f"must be a non-empty list of values, got {short_repr(values)}")
        if key == "load":
            parsed = [_load_value(path, f"axes.load[{i}]", v) for i, v in enumerate(values)]
            labels = [_load_label(v) for v in parsed]
            values = parsed
        else:
            for i, v in enumerate(values):
                if isinstance(v, (dict, list)):
                    raise _fail(path, f"axes.{key}[{i}]", f"must be a single value, got {short_repr(v)}")
            labels = [_label(v) for v in values]
        if len(set(labels)) != len(labels):
            dup = next(lab for lab in labels if labels.count(lab) > 1)
            raise _fail(path, f"axes.{key}", f"value {dup} given twice")
        short = SHORT_NAMES.get(key, key.split(".")[-1])
        if short in shorts:
            short = key
        shorts[short] = key
        axes.append(Axis(key=key, short=short, values=tuple(values), labels=tuple(labels)))
    return axes


def _label(value: Any) -> str:
    if value is None:
        return "default"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _load_value(path: Path, where: str, value: Any) -> dict[str, Any]:
    """``all``, ``cN``, ``pX`` or a load mapping, as the mapping a deploy's ``load:`` section holds."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, str) and _LOAD_SHORT.fullmatch(value.strip()):
        text = value.strip()
        if text == "all":
            return {"mode": "all"}
        if text.startswith("c"):
            n = int(text[1:])
            if not 1 <= n <= MAX_NUM_SEQS:
                raise _fail(path, where, f"concurrency must be in [1, {MAX_NUM_SEQS}], got {n}")
            return {"mode": "concurrency", "concurrency": n}
        rate = float(text[1:])
        if not rate > 0:
            raise _fail(path, where, f"a Poisson rate must be above 0, got {text[1:]}")
        return {"mode": "poisson", "rate": rate}
    raise _fail(path, where, f"a load is all, cN (N requests in flight), pX (Poisson, X requests per step) or a "
                             f"mapping {{mode, concurrency, rate, jitter}}, got {short_repr(value)}")


def _load_label(load: dict[str, Any]) -> str:
    mode = load.get("mode", "all")
    if mode == "concurrency":
        text = f"c{load.get('concurrency')}"
    elif mode == "poisson":
        rate = load.get("rate")
        text = f"p{rate:g}" if isinstance(rate, (int, float)) and not isinstance(rate, bool) else "poisson"
    else:
        text = str(mode)
    if load.get("jitter"):
        text += f"+j{load['jitter']}"
    return text


def _apply(data: dict[str, Any], key: str, value: Any) -> None:
    """Sets ``key`` (dotted) in the deploy document; ``load`` replaces the whole section, and
    ``speculative.num_speculative_tokens: 0`` removes speculative decoding."""
    if key == "load":
        data["load"] = dict(value)
        return
    if key == "speculative.num_speculative_tokens" and value == 0:
        data.pop("speculative", None)
        return
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _hashable(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def list_sweeps() -> list[str]:
    return sorted(p.stem for p in SWEEP_DIR.glob("*.yaml")) if SWEEP_DIR.is_dir() else []
