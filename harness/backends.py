"""One interface for both backends: a cell in, request records (with their audio) and spans out.

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


EmitRecord = Callable[[RequestRecord], None]
EmitSpans = Callable[[list[SpanRecord]], None]


class Backend(Protocol):
    """``open`` once with every cell to run, ``run_cell`` each in order, ``close`` on every path."""

    name: str

    def open(self, jobs: list[CellJob]) -> None: ...

    def run_cell(self, job: CellJob, emit: EmitRecord, emit_spans: EmitSpans,
                 idle: Callable[[], None]) -> CellOutcome: ...

    def close(self, cancel: bool = False) -> None: ...


def make_backend(name: str, run_dir: Path, options: Any) -> Backend:
    """The backend named by ``--backend``; ``options`` is the run's ``RunOptions``."""
    if name == "sim":
        from harness.sim.backend import SimBackend

        return SimBackend(run_dir, options)
    if name == "vllm-omni":
        from harness.serve.backend import ServeBackend

        return ServeBackend(run_dir, options.serve)
    from harness.errors import UserError

    raise UserError(f"--backend {name!r}: unknown backend (choose sim or vllm-omni)")
