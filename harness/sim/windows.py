"""The Code2Wav windows the sim models for a streaming deploy (pure, no vLLM, no I/O but the rule's YAML).

Why: with ``async_chunk: true`` the real server's Talker hands Code2Wav its codec frames in windows (the
connector's rule, ``harness.chunk_contract``), and its records carry those windows as traced
(``harness.serve.backend.chunk_fields``). The sim has no connector, so for a family whose connector sends
windows (its serve module names a ``CHUNKER``: Qwen3-TTS) it models them: the release's rule over the
request's codec stream, each window sent at the scheduler step its last new frame was produced (one frame
per generated codec token, in order). The records then carry the same ``chunk_*`` fields on both backends,
so ``omni-stress fidelity`` can compare window boundaries request by request, and each window's step says
when its audio could first be decoded (``chunk_window_steps``, sim only).

A replay (preemption by recompute) recomputes positions without producing frames: a frame exists from the
first step its generated token was produced, and a position produced again later adds none
(:func:`frame_steps`). The sim sends exactly the rule, so the chunk contract's check finds nothing, but it
is computed (``check_windows``), not assumed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from harness.chunk_contract import ChunkRule, Window, check_windows
from harness.config import Deploy
from harness.family import Family
from harness.records import RequestRecord


@dataclass(frozen=True)
class ModelledWindows:
    """One request's windows as the modelled connector sends them, and when."""

    windows: tuple[Window, ...]  # sending order; the last says finished (an empty one when the frames end on a boundary)
    steps: tuple[int, ...]  # per window with new frames: the step it was sent (its last new frame's step)


def connector_rule(family: Family, deploy: Deploy) -> ChunkRule | None:
    """The window rule of ``deploy``'s connector, or None where the sim models no windows: a deploy that does
    not stream (``async_chunk: false``, the full payload: one decode per request), or a family whose serve
    module names no connector chunker (``CHUNKER``; a family without a real backend has none). Decided by the
    family, never by a deploy's or an arm's name; the rule is the one the real backend checks against."""
    if not deploy.async_chunk or family.serve_missing is not None:
        return None
    serve = family.serve()
    if not getattr(serve, "CHUNKER", None):
        return None
    rule: ChunkRule = serve.chunk_rule()
    return rule


def frame_steps(progress: Iterable[tuple[int, int]]) -> list[int]:
    """The step at which each frame (generated codec token) was first produced.

    ``progress``: ``(step, generated)`` in step order, the request's count of generated tokens after each step
    that sampled for it. A count that holds (a replay recomputing positions) or falls back and grows again
    (positions produced a second time) adds no frame: only a count past every earlier one does."""
    steps: list[int] = []
    for step, generated in progress:
        while len(steps) < generated:
            steps.append(int(step))
    return steps


def model_windows(codes: Sequence[int], steps: Sequence[int], rule: ChunkRule) -> ModelledWindows:
    """The windows ``rule`` sends for the codec stream ``codes`` whose frame ``g`` was produced at ``steps[g]``.

    Windows follow ``rule.boundaries``; each carries the rule's left context before its new frames. The window
    holding the last frame says finished when it is a remainder (shorter than the rule's size); a stream that
    ends on a boundary gets an empty finished window after it, as the connector sends one when the request
    finishes (not listed in ``steps``: it carries no frame)."""
    if len(steps) < len(codes):
        raise ValueError(f"{len(codes)} frames but the steps of only {len(steps)}")
    sizes = rule.boundaries(len(codes))
    windows: list[Window] = []
    sent: list[int] = []
    pos = 0
    for i, n in enumerate(sizes):
        left = min(rule.left_context, pos)
        frames = tuple(int(c) for c in codes[pos - left:pos + n])
        pos += n
        windows.append(Window(frames, left, i == len(sizes) - 1 and n < rule.size(i)))
        sent.append(int(steps[pos - 1]))
    if not windows or not windows[-1].finished:
        left = min(rule.left_context, pos)
        windows.append(Window(tuple(int(c) for c in codes[pos - left:pos]), left, True))
    return ModelledWindows(tuple(windows), tuple(sent))


def window_fields(record: RequestRecord, modelled: ModelledWindows, rule: ChunkRule) -> None:
    """The record's ``chunk_*`` fields from the modelled windows, checked against its codec stream as the
    real backend checks the traced ones."""
    check = check_windows(modelled.windows, record.codec_tokens, rule)
    record.chunk_windows, record.chunk_frames_sent = check.windows, list(check.frames_sent)
    record.chunk_window_steps = list(modelled.steps)
    record.chunk_violations, record.chunk_violation = check.count, check.first


def record_windows(record: RequestRecord, progress: Iterable[tuple[int, int]], rule: ChunkRule) -> None:
    """Models the windows of a finished request (its codec stream, its ``progress`` as :func:`frame_steps` takes
    it) into its record."""
    window_fields(record, model_windows(record.codec_tokens, frame_steps(progress), rule), rule)
