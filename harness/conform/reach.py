"""Reachability: which shipped deploy of the release can produce a failing schedule.

A cell that fails says *that* a schedule breaks the model; a maintainer also needs to know
*whether a shipped deploy ever makes that schedule*. This module reads the release's own deploy
files (``vllm_omni/deploy/*.yaml`` from ``--source``, or the vendored copies), resolves each for
every platform it names the way ``vllm_omni.config.stage_config`` does (``base_config``
inheritance, stage lists merged by ``stage_id``, ``platforms.<name>`` overrides, a platform's
``model_runner``), takes the settings of the stage whose hook is under test, and derives which
scheduling mechanisms that stage can hit:

* **chunking**: vLLM's chunked prefill splits a prompt when the prompts scheduled together exceed
  ``max_num_batched_tokens``. With ``max_num_seqs`` requests prefilling at once, that needs a
  prompt of at least ``budget // max_num_seqs + 1`` tokens (``budget + 1`` when ``max_num_seqs``
  is 1), which must fit ``max_model_len``. ``enable_chunked_prefill: false`` rules it out.
* **preemption** (by recompute): needs a second running request (``max_num_seqs > 1``) and a KV
  cache that ``max_num_seqs x max_model_len`` tokens can outgrow. An explicit cap
  (``num_gpu_blocks_override``, ``kv_cache_memory_bytes``) that holds them rules it out; a cache
  sized by ``gpu_memory_utilization`` alone depends on the device and can be outgrown.
* **speculative decoding**: ``speculative_config`` on the stage (multi-position decode spans
  without a preemption arise only from its verify spans).

What a failing cell needs comes from the span that showed it (``Cell.trigger``): a replay needs
preemption (plus chunking when the replay span does not start at 0), a chunk or one-token tail
needs chunking, a decode span of ``n > 1`` outside a replay needs speculative decoding, the whole
prompt at once or a one-token decode needs nothing (every request).

A deploy can also run the stage under settings conform does not model for that model (the MRV2
runner, Qwen3-Omni's ``async_chunk`` decode path): the adapter says which, and such a deploy
counts as *not modelled* rather than as reaching the failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.errors import UserError

MECHANISMS = ("chunking", "preemption", "specdec")
SHORT = {"chunking": "chunked prefill", "preemption": "preemption", "specdec": "speculative decoding"}
NEED_TEXT = {
    "chunking": "prompts scheduled together longer than max_num_batched_tokens",
    "preemption": "max_num_seqs > 1 and a KV cache smaller than max_num_seqs x max_model_len tokens",
    "specdec": "speculative_config on the stage",
}


def only_with(all_needs: set[tuple[str, ...]], define: bool = True) -> str:
    """``only with A or B + C (A: its condition; ...)`` over the minimal mechanism sets."""
    sets = [set(n) for n in all_needs if n]
    minimal = sorted({tuple(m for m in MECHANISMS if m in s) for s in sets if not any(o < s for o in sets)},
                     key=lambda t: (len(t), [MECHANISMS.index(m) for m in t]))
    if not minimal:
        return "only with changed settings"
    if minimal == [("specdec",)]:
        return "only from speculative decoding"
    used = [m for m in MECHANISMS if any(m in t for t in minimal)]
    return ("only with " + " or ".join(" + ".join(SHORT[m] for m in t) for t in minimal)
            + (" (" + "; ".join(f"{SHORT[m]}: {NEED_TEXT[m]}" for m in used) + ")" if define else ""))
VLLM_DEFAULT_BUDGET = 2048  # vLLM's smallest default max_num_batched_tokens (API server, small devices)
VLLM_DEFAULT_SEQS = 256
BLOCK_SIZE = 16
PLATFORM_DEFAULT = "cuda"


@dataclass(frozen=True)
class StageTarget:
    """One (shipped deploy file, platform): the settings of the stage under test."""

    deploy: str  # file name, e.g. qwen3_tts.yaml
    platform: str
    stage: int
    budget: int
    max_num_seqs: int
    max_model_len: int
    chunked_prefill: bool
    kv: str  # how the KV cache is sized, in words
    kv_tokens: int | None  # its capacity when an explicit cap fixes it
    specdec: bool
    runner: str  # v1 | v2
    async_chunk: bool
    session_mode: str = "turn"
    defaulted: tuple[str, ...] = ()  # settings the deploy leaves to vLLM's (or the model config's) default

    def settings(self) -> str:
        def v(key: str, value: object) -> str:
            return f"{key} {value}" + (" (default)" if key in self.defaulted else "")

        return (f"stage {self.stage}: {v('max_num_batched_tokens', self.budget)}, "
                f"{v('max_num_seqs', self.max_num_seqs)}, {v('max_model_len', self.max_model_len)}, "
                f"{self.kv}, model_runner {self.runner}, "
                f"async_chunk {str(self.async_chunk).lower()}"
                + ("" if self.chunked_prefill else ", enable_chunked_prefill false")
                + (", speculative decoding" if self.specdec else ""))

    def reach(self, mechanism: str) -> tuple[bool, str]:
        """Can this stage hit ``mechanism``, and why (or why not)."""
        if mechanism == "chunking":
            if not self.chunked_prefill:
                return False, "enable_chunked_prefill false"
            need = self.budget // self.max_num_seqs + 1
            if need > self.max_model_len:
                return False, (f"{self.max_num_seqs} x a prompt of at most max_model_len {self.max_model_len} "
                               f"tokens never exceeds the {self.budget}-token budget")
            return True, (f"{self.max_num_seqs} prompts of {need}+ tokens exceed the {self.budget}-token budget"
                          if self.max_num_seqs > 1 else f"a prompt of {need}+ tokens exceeds the {self.budget}-token "
                                                        f"budget")
        if mechanism == "preemption":
            demand = self.max_num_seqs * self.max_model_len
            if self.max_num_seqs < 2:
                return False, "max_num_seqs 1: no second request to make room for"
            if self.kv_tokens is not None and self.kv_tokens >= demand:
                return False, (f"{self.kv} holds {self.kv_tokens} tokens >= max_num_seqs x max_model_len = "
                               f"{demand}")
            if self.kv_tokens is not None:
                return True, f"{self.kv} holds {self.kv_tokens} tokens < max_num_seqs x max_model_len = {demand}"
            return True, (f"{self.kv}: the device decides; {self.max_num_seqs} x {self.max_model_len} = {demand} "
                          f"tokens can outgrow it")
        if mechanism == "specdec":
            return (True, "speculative_config set") if self.specdec else (False, "no speculative_config")
        raise ValueError(mechanism)


@dataclass
class ModelDeploys:
    """What an adapter says about its shipped deploys."""

    files: tuple[str, ...]  # vllm_omni/deploy/<file>; a glob (qwen3_omni*.yaml) takes every match in the release
    stage: int  # the stage whose hook is under test
    max_model_len: int  # the stage's max_model_len when a deploy sets none (the model config's)
    kv_bytes_per_token: int | None = None  # to turn kv_cache_memory_bytes into tokens
    # settings conform does not model for this model: (key, value, why), e.g. ("async_chunk", True, "...")
    unmodelled: tuple[tuple[str, Any, str], ...] = ()


@dataclass
class CellReach:
    needs: tuple[str, ...]  # mechanisms the failing span needs (empty: every request)
    shipped: list[str] = field(default_factory=list)  # "qwen3_tts.yaml (rocm, npu)" deploys that reach it
    unmodelled: list[str] = field(default_factory=list)  # deploys that would reach it under unmodelled settings
    why_not: list[str] = field(default_factory=list)  # per shipped deploy, why it cannot
    hit: list[StageTarget] = field(default_factory=list)  # the (deploy, platform)s behind ``shipped``

    @property
    def text(self) -> str:
        if self.shipped:
            return "reached by shipped deploy " + ", ".join(self.shipped)
        base = only_with({self.needs}, define=False) if self.needs else "every request (no shipped deploy read)"
        return base + (" (shipped deploys reach it only under settings conform does not model)"
                       if self.unmodelled else "")

    def to_json(self) -> dict[str, Any]:
        return {"needs": list(self.needs), "shipped": self.shipped, "unmodelled": self.unmodelled,
                "why_not": self.why_not, "text": self.text}


def needs_of(trigger: dict[str, int] | None) -> tuple[str, ...]:
    """The mechanisms a span ``{P, c, n, replay}`` needs to be scheduled at all."""
    if trigger is None:
        return ()
    P = trigger["P"]
    span = _span_needs(P, trigger["c"], trigger["n"], trigger["replay"])
    # the earlier spans of the request's run count too: always in a forced schedule (built to be minimal), and
    # in a vLLM run when the span itself needs nothing (a plain decode step differs only because of its past)
    if trigger.get("history") and (not trigger.get("vllm") or not span):
        need = set(span)
        for c, n, replay in trigger["history"]:
            need |= set(_span_needs(P, c, n, replay))
        return tuple(m for m in MECHANISMS if m in need)
    return span


def _span_needs(P: int, c: int, n: int, replay: int) -> tuple[str, ...]:
    if replay > 0:
        return ("chunking", "preemption") if c > 0 else ("preemption",)
    if c >= P:
        return ("specdec",) if n > 1 else ()
    if c > 0 or c + n < P:
        return ("chunking",)
    return ()


# ----------------------------------------------------------------------------- deploy files


def _read_yaml(spec: str, name: str, base_dir: Path | None, wheel_dir: Path | None) -> tuple[dict[str, Any], str]:
    from harness.conform.adapter import read_model_source

    src = read_model_source(spec, f"vllm_omni/deploy/{name}", base_dir, wheel_dir)
    if src.kind == "file":  # a lone .py file stands for every member: no deploy files there
        raise UserError(f"vllm-omni:{spec} is a single file: it holds no deploy files")
    try:
        data = yaml.safe_load(src.text) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{src.location}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{src.location}: a deploy file must be a mapping")
    return data, src.sha256


def _merge_stages(base: list[dict[str, Any]] | None, over: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    by_id = {s["stage_id"]: dict(s) for s in base or []}
    for s in over or []:
        by_id[s["stage_id"]] = {**by_id.get(s["stage_id"], {}), **s}
    return list(by_id.values())


def resolve_deploy(spec: str, name: str, base_dir: Path | None = None, wheel_dir: Path | None = None,
                   _depth: int = 0) -> tuple[dict[str, Any], list[str]]:
    """The deploy file with ``base_config`` inheritance resolved (vllm_omni's ``resolve_deploy_yaml``);
    also the sha256 of each file read."""
    raw, sha = _read_yaml(spec, name, base_dir, wheel_dir)
    base_name = raw.pop("base_config", None)
    if base_name is None:
        return raw, [sha]
    if _depth > 8:
        raise UserError(f"{name}: base_config chain deeper than 8")
    base, shas = resolve_deploy(spec, str(base_name), base_dir, wheel_dir, _depth + 1)
    merged = {**base, **{k: v for k, v in raw.items() if k not in ("stages", "platforms")}}
    merged["stages"] = _merge_stages(base.get("stages"), raw.get("stages"))
    plats: dict[str, Any] = {}
    for p in dict.fromkeys([*(base.get("platforms") or {}), *(raw.get("platforms") or {})]):
        bp, op = (base.get("platforms") or {}).get(p) or {}, (raw.get("platforms") or {}).get(p) or {}
        plats[p] = {**bp, **{k: v for k, v in op.items() if k != "stages"},
                    "stages": _merge_stages(bp.get("stages"), op.get("stages"))}
    if plats:
        merged["platforms"] = plats
    return merged, [sha, *shas]


def targets(deploy: dict[str, Any], name: str, md: ModelDeploys) -> list[StageTarget]:
    """The stage under test in ``deploy`` on each platform (the default one, cuda, and each it names)."""
    out = []
    platforms = deploy.get("platforms") or {}
    for platform in [PLATFORM_DEFAULT, *[p for p in platforms if p != PLATFORM_DEFAULT]]:
        section = platforms.get(platform) or {}
        runner = str(section.get("model_runner", deploy.get("model_runner", "v1")))
        stage = next((dict(s) for s in deploy.get("stages") or [] if s.get("stage_id") == md.stage), None)
        if stage is None:
            return []  # a deploy without the stage (thinker only)
        # a stage's own model_runner overrides the deploy's (0.32.0rc1 *_mrv2.yaml); a platform's
        # model_runner v1 also covers stages that opt into v2 (stage_config.py)
        stage_runner = stage.get("model_runner")
        if stage_runner == "v2" and section.get("model_runner") == "v1":
            stage_runner = None
        runner = str(stage_runner or runner)
        if runner == "v2" and platform in ("npu", "xpu"):
            continue  # vllm_omni refuses MRV2 there (NotImplementedError): no such deploy
        for ps in section.get("stages") or []:
            if ps.get("stage_id") == md.stage:
                stage.update({k: v for k, v in (ps.get("engine_args") or ps).items() if k != "stage_id"})
        stage = {**stage, **(stage.get("engine_args") or {})}
        out.append(_target(deploy, stage, name, platform, runner, md))
    return out


def _target(deploy: dict[str, Any], stage: dict[str, Any], name: str, platform: str, runner: str,
            md: ModelDeploys) -> StageTarget:
    budget = int(stage.get("max_num_batched_tokens") or VLLM_DEFAULT_BUDGET)
    seqs = int(stage.get("max_num_seqs") or VLLM_DEFAULT_SEQS)
    mml = int(stage.get("max_model_len") or md.max_model_len)
    chunked = stage.get("enable_chunked_prefill", deploy.get("enable_chunked_prefill"))
    kv_tokens = None
    if stage.get("num_gpu_blocks_override"):
        blocks = int(stage["num_gpu_blocks_override"])
        kv_tokens = blocks * int(stage.get("block_size") or BLOCK_SIZE)
        kv = f"num_gpu_blocks_override {blocks}"
    elif stage.get("kv_cache_memory_bytes"):
        nbytes = int(stage["kv_cache_memory_bytes"])
        kv = f"kv_cache_memory_bytes {nbytes}"
        if md.kv_bytes_per_token:
            kv_tokens = nbytes // md.kv_bytes_per_token
    else:
        kv = f"gpu_memory_utilization {stage.get('gpu_memory_utilization', 0.9)}"
    stage_async = stage.get("async_chunk")
    async_chunk = bool(deploy.get("async_chunk", True)) and stage_async is not False
    defaulted = tuple(k for k in ("max_num_batched_tokens", "max_num_seqs", "max_model_len") if not stage.get(k))
    return StageTarget(name, platform, md.stage, budget, seqs, mml, chunked is not False, kv, kv_tokens,
                       bool(stage.get("speculative_config")), runner, async_chunk,
                       str(deploy.get("session_mode", "turn")), defaulted)


@dataclass
class Shipped:
    """The shipped deploys of one model in one release."""

    targets: list[StageTarget]
    files: list[dict[str, Any]]  # name, sha256 (with base files)
    missing: list[str]  # deploy files the release does not have
    error: str | None = None  # no deploy files at all (a single-file source)


def load_shipped(md: ModelDeploys | None, spec: str, base_dir: Path | None = None,
                 wheel_dir: Path | None = None) -> Shipped:
    if md is None:
        return Shipped([], [], [], "the adapter names no shipped deploys")
    out = Shipped([], [], [])
    for name in expand_files(md.files, spec, base_dir, wheel_dir):
        try:
            deploy, shas = resolve_deploy(spec, name, base_dir, wheel_dir)
        except UserError as exc:
            if "single file" in str(exc):
                return Shipped([], [], [], str(exc))
            out.missing.append(name)
            continue
        out.files.append({"name": name, "sha256": shas})
        out.targets += targets(deploy, name, md)
    if not out.files:
        out.error = f"none of the deploy files {', '.join(md.files)} is in vllm-omni:{spec}"
    return out


def expand_files(files: tuple[str, ...], spec: str, base_dir: Path | None = None,
                 wheel_dir: Path | None = None) -> list[str]:
    """``files`` with each glob replaced by the release's matching deploy files (sorted), in order; a release
    whose deploy folder cannot be listed keeps only the plain names."""
    import fnmatch

    from harness.talkers.release import deploy_names, resolve

    names: list[str] | None = None
    if any(ch in f for f in files for ch in "*?["):
        try:
            names = deploy_names(resolve(spec, base_dir, wheel_dir).spec)
        except UserError:
            names = None
    out: list[str] = []
    for f in files:
        matches = [f] if not any(ch in f for ch in "*?[") else fnmatch.filter(names or [], f)
        out += [m for m in matches if m not in out]
    return out


def _group(ts: list[StageTarget]) -> list[str]:
    """``deploy (platform, platform)`` in file order."""
    by: dict[str, list[str]] = {}
    for t in ts:
        by.setdefault(t.deploy, []).append(t.platform)
    return [f"{d} ({', '.join(p)})" for d, p in by.items()]


def unmodelled_reason(t: StageTarget, md: ModelDeploys, needs: tuple[str, ...]) -> str | None:
    for key, value, why in md.unmodelled:
        got = tuple(getattr(t, k) for k in key.split("+")) if "+" in key else getattr(t, key)
        if got == value and (key != "runner" or "preemption" in needs):
            return why
    return None


def cell_reach(needs: tuple[str, ...], shipped: Shipped, md: ModelDeploys | None) -> CellReach:
    out = CellReach(needs)
    hit, unmod = [], []
    for t in shipped.targets:
        reasons = [t.reach(m) for m in needs]
        if all(ok for ok, _ in reasons):
            why = unmodelled_reason(t, md, needs) if md else None
            (unmod if why else hit).append((t, why))
        else:
            out.why_not += [f"{t.deploy} on {t.platform}: {r}" for ok, r in reasons if not ok]
    out.hit = [t for t, _ in hit]
    out.shipped = _group(out.hit)
    by_why: dict[str, list[StageTarget]] = {}
    for t, why in unmod:
        by_why.setdefault(str(why), []).append(t)
    out.unmodelled = [f"{', '.join(_group(ts))} reach it with {why}" for why, ts in by_why.items()]
    return out


@dataclass
class ModelReach:
    """The model's verdict with reach."""

    status: str  # conforms | shipped | only | unknown
    text: str
    cells: dict[str, CellReach] = field(default_factory=dict)
    deploys: list[dict[str, Any]] = field(default_factory=list)  # targets, for --json
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "text": self.text, "note": self.note,
                "cells": {k: v.to_json() for k, v in self.cells.items()}, "deploys": self.deploys}


def model_reach(failing: dict[str, dict[str, int] | None], shipped: Shipped, md: ModelDeploys | None) -> ModelReach:
    """``failing``: column -> the trigger span of each cell that does not conform."""
    deploys = [{"deploy": t.deploy, "platform": t.platform, "settings": t.settings(),
                "reach": {m: t.reach(m)[1] if t.reach(m)[0] else "no: " + t.reach(m)[1] for m in MECHANISMS}}
               for t in shipped.targets]
    if not failing:
        return ModelReach("conforms", "conforms", {}, deploys)
    if shipped.error is not None:
        cells = {k: CellReach(needs_of(v)) for k, v in failing.items()}
        return ModelReach("unknown", f"fails (reachability unknown: {shipped.error})", cells, deploys)
    cells = {k: cell_reach(needs_of(v), shipped, md) for k, v in failing.items()}
    hit_targets = {(t.deploy, t.platform) for c in cells.values() for t in c.hit}
    reached = _group([t for t in shipped.targets if (t.deploy, t.platform) in hit_targets])
    if reached:
        return ModelReach("shipped", "fails under shipped deploy " + ", ".join(reached), cells, deploys)
    text = "fails " + only_with({c.needs for c in cells.values()})
    if any(c.unmodelled for c in cells.values()):
        text += "; the shipped deploys that reach these schedules run settings conform does not model"
    unmod = list(dict.fromkeys(u for c in cells.values() for u in c.unmodelled))
    why: dict[str, dict[str, list[str]]] = {}  # reason -> deploy -> platforms
    for c in cells.values():
        for line in c.why_not:
            where, reason = line.split(": ", 1)
            deploy, platform = where.split(" on ")
            plats = why.setdefault(reason, {}).setdefault(deploy, [])
            if platform not in plats:
                plats.append(platform)
    notes = [", ".join(f"{d} ({', '.join(p)})" for d, p in ds.items()) + f": {reason}" for reason, ds in why.items()]
    if unmod:
        notes.append("not modelled: " + "; ".join(unmod))
    return ModelReach("only", text, cells, deploys, "\n  ".join(notes) if notes else None)
