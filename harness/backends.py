"""One interface for both backends (and the executors over them): a cell in, request records (with
their audio) and spans out.

Why one interface: everything after the Talker (ASR, scoring, reports, the gate) must not know
which backend produced a record. A backend's ``run_cell`` emits each ``RequestRecord`` as its
request completes, with ``audio_path`` already pointing at a WAV under the run directory (the
sim speaks its codec units through its own Code2Wav, ``harness.sim.code2wav``; the real backend
writes the server's audio), and each cell's ``SpanRecord`` list once. The pipeline then only
transcribes, scores and writes.

``wav_rel_path`` is the one place a WAV file is named: every component is reduced to a safe
file-name alphabet, so no prompt id or arm name can place a file outside ``audio/``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from harness.config import ArmSpec, Deploy, PromptSet
from harness.records import RequestRecord, SpanRecord


def safe_name(name: str) -> str:
    """A file-name component: letters, digits, ``.``, ``_`` and ``-`` only, never ``.``/``..``."""
    out = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "._-") else "-" for ch in str(name))
    return out if out.strip(".") else out.replace(".", "-") or "-"


def wav_rel_path(arm: str, deploy: str, repeat: int | str, prompt_id: str) -> str:
    """``audio/<arm>-<deploy>-r<repeat>-<prompt>.wav``, relative to the run directory."""
    return f"audio/{safe_name(arm)}-{safe_name(deploy)}-r{repeat}-{safe_name(prompt_id)}.wav"


# The sim's Talker modes (``--sim-talker``): ``words``, the sim's own Talker (harness/sim/talker.py);
# ``speaking``, the speaking tiny model's rules and tokenizer (harness/sim/speaking_talker.py).
SIM_TALKERS = ("words", "speaking")
DEFAULT_SIM_TALKER = "words"


@dataclass
class RunOptions:
    """How a run runs, beside the interface every backend and executor implements (so neither needs
    the pipeline: ``harness.pipeline`` uses executors, executors use backends, never back)."""

    backend: str = "sim"
    repeat: int = 1
    seed: int = 42
    asr: str = "faster-whisper"  # or openai-whisper, none
    asr_model: str = "base"
    beam_size: int = 1
    cache_dir: Path | None = None
    use_cache: bool = True
    quiet: bool = False
    asr_workers: int = -1  # -1: two worker processes on two or more cores; 0: in this process
    asr_batch: int = 0  # --asr-batch: 0 per clip; N: faster-whisper's batched pipeline, N clips per call
    sim_workers: int = -1  # -1: up to two forked processes when there are cells and cores for them
    serve: Any = None  # harness.serve.backend.ServeOptions for the real backend
    sim_talker: str = "words"  # sim: SIM_TALKERS (the manifest records it; --resume refuses another)
    executor: str = "local"  # harness.executors.EXECUTORS
    ray_address: str | None = None  # --ray-address (None: Ray's own default, RAY_ADDRESS or a local cluster)
    latency: bool = False  # sim: records carry their sent/arrival/first-token/finish steps (omni-stress sweep)
    stream: bool = False  # --stream (real backend): audio streamed and measured as it arrives (docs/streaming.md)


@dataclass
class CellJob:
    """One cell (arm x deploy x repeat) to run, minus the prompts already recorded (``skip``)."""

    arm: ArmSpec
    deploy: Deploy
    prompts: PromptSet
    repeat: int
    seed: int
    skip: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return f"{self.arm.name}/{self.deploy.name}/{self.repeat}"

    @property
    def label(self) -> str:
        return f"{self.arm.name} x {self.deploy.name} (run {self.repeat})"


@dataclass
class CellOutcome:
    """What a backend measured while running one cell (stage times, for the manifest)."""

    seconds: float = 0.0  # the cell's own time: simulation + speech, or the server's requests
    sim_seconds: float = 0.0
    sim_wall: float = 0.0  # seconds this process spent simulating or waiting for sim workers
    tts_seconds: float = 0.0
    tts_cache_hits: int = 0
    scheduled_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- the backend registry

# backend name (--backend, a record's ``backend``) -> ``module:Class`` of its entry: its hooks (make,
# prepare, dry_run, preflight, the Ray resources/timeout/payload of a cell) and flags (simulated,
# hashes_arm_code). Entries are imported on first use; nothing outside the entries tests a
# backend's name.
BACKENDS: dict[str, str] = {
    "sim": "harness.sim.entry:SimEntry",
    "vllm-omni": "harness.serve.entry:ServeEntry",
}


@functools.cache
def get_backend(name: str) -> Any:
    """The entry of backend ``name``; an unknown name is one line naming ``--backend``. Cached: the
    report and the sweep's metrics ask ``is_simulated`` once per record."""
    import importlib

    from harness.errors import UserError

    target = BACKENDS.get(name)
    if target is None:
        raise UserError(f"--backend {name!r}: unknown backend (choose {' or '.join(BACKENDS)})")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def is_simulated(name: Any) -> bool:
    """Whether a backend named in a record or manifest simulates its cells (a name this version does
    not know is not the sim's)."""
    return isinstance(name, str) and name in BACKENDS and get_backend(name).simulated


EmitRecord = Callable[[RequestRecord], None]
EmitSpans = Callable[[list[SpanRecord]], None]


class Backend(Protocol):
    """``open`` once with every cell to run, ``run_cell`` each in order, ``close`` on every path.
    ``harness.executors.make_executor`` picks one (``harness.executors.local.make_backend``)."""

    name: str

    def open(self, jobs: list[CellJob]) -> None: ...

    def run_cell(self, job: CellJob, emit: EmitRecord, emit_spans: EmitSpans,
                 idle: Callable[[], None]) -> CellOutcome: ...

    def close(self, cancel: bool = False) -> None: ...
