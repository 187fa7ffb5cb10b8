"""Per-request latency and duration, and the schedules a run explored (the sweep's map reads them).

Latency: the sim's records carry the steps their request was sent, reached the Talker, got its
first codec token and finished (``omni-stress sweep``); end to end is finish - sent, time to first
audio first token - sent, both in scheduler steps. The real backend's are seconds: ``wall_s`` end
to end (send to the whole response), ``ttfa_s`` send to the Talker's first codec token (the server's
trace; the chat API is asked for ``stream: false``, so no audio byte arrives before the response:
this is the earliest a streaming API could send audio, not a streamed measurement), ``rtf`` (end to
end over the audio's duration). A streamed run (``--stream``) measures TTFA instead: ``stream_ttfa_s``,
send to the first audio bytes received; ``ttfa`` takes it where a record has it, and ``ttfa_source``
labels each value (``stream``: measured; ``trace``: trace-derived; ``steps``: the sim's).

Duration: each request's codec tokens (and audio seconds, where both have audio) against the same
prompt's cell in the reference deploy (same arm, same repeat, else its only repeat): under
``TRUNCATED`` of it is a truncation, over ``OVERRUN`` an overrun (a restart that re-speaks from the
start shows as overrun plus WER).

Schedules: a request's schedule is its sequence of (P, c, n) spans; the distinct schedules of a
run are the distinct (deploy, prompt, schedule) triples over its arms and repeats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from harness.backends import is_simulated

if TYPE_CHECKING:
    from harness.records import RequestRecord
    from harness.report.summary import CellSummary, Run

TRUNCATED = 0.9  # codec tokens below 90 % of the reference's: truncated
OVERRUN = 1.1  # above 110 %: overrun
PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (a value that occurred; None without values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def e2e(record: RequestRecord) -> float | None:
    """End to end: steps (sim) or seconds (real backend)."""
    if is_simulated(record.backend):
        if record.finish_step is None or record.sent_step is None:
            return None
        return float(record.finish_step - record.sent_step)
    return float(record.wall_s) if record.error is None else None


def ttfa(record: RequestRecord) -> float | None:
    """Time to first audio: steps (sim), seconds to the first audio bytes (real, streamed: measured), else
    seconds to the Talker's first codec token (real, not streamed: trace-derived, see the module)."""
    if is_simulated(record.backend):
        if record.first_token_step is None or record.sent_step is None:
            return None
        return float(record.first_token_step - record.sent_step)
    return record.stream_ttfa_s if record.stream_ttfa_s is not None else record.ttfa_s


def ttfa_source(record: RequestRecord) -> str | None:
    """Where ``ttfa(record)`` comes from: ``steps`` (sim), ``stream`` (measured), ``trace`` (derived), None."""
    if ttfa(record) is None:
        return None
    if is_simulated(record.backend):
        return "steps"
    return "stream" if record.stream_ttfa_s is not None else "trace"


def unit(records: list[RequestRecord]) -> str:
    return "steps" if records and all(is_simulated(r.backend) for r in records) else "s"


@dataclass
class Latency:
    unit: str
    e2e: dict[int, float | None]  # percentile -> value
    ttfa: dict[int, float | None]
    rtf: dict[int, float | None]
    measured: int
    ttfa_source: str | None = None  # ``ttfa_source`` of every TTFA value, "mixed" when they differ, None: none


def latency(records: list[RequestRecord]) -> Latency:
    e = [v for r in records if (v := e2e(r)) is not None]
    t = [v for r in records if (v := ttfa(r)) is not None]
    f = [r.rtf for r in records if r.rtf is not None]
    sources = {s for r in records if (s := ttfa_source(r)) is not None}
    source = next(iter(sources)) if len(sources) == 1 else "mixed" if sources else None
    return Latency(unit(records), {q: percentile(e, q) for q in PERCENTILES}, {q: percentile(t, q) for q in PERCENTILES},
                   {q: percentile(f, q) for q in PERCENTILES}, len(e), source)


def audio_seconds(records: list[RequestRecord]) -> float | None:
    """Median seconds of audio of the answered requests that have audio."""
    return percentile([r.audio_seconds for r in records if r.error is None and r.audio_seconds], 50)


@dataclass
class Duration:
    compared: int = 0  # requests with a reference request of the same prompt
    truncated: int = 0
    overrun: int = 0
    ratios: tuple[float, ...] = ()  # codec tokens / the reference's, per compared request

    @property
    def median_ratio(self) -> float | None:
        return percentile(list(self.ratios), 50)


def duration(cell: CellSummary, reference: CellSummary | None) -> Duration:
    """Codec tokens (and audio seconds where both have them) against the reference cell's same prompt."""
    out = Duration()
    if reference is None or reference is cell:
        return out
    theirs = {r.prompt_id: r for r in reference.records}
    ratios = []
    for rec in cell.records:
        ref = theirs.get(rec.prompt_id)
        if ref is None or rec.error is not None or ref.error is not None:
            continue
        if rec.audio_seconds and ref.audio_seconds and not (rec.num_codec_tokens and ref.num_codec_tokens):
            ratio = rec.audio_seconds / ref.audio_seconds
        elif ref.num_codec_tokens:
            ratio = rec.num_codec_tokens / ref.num_codec_tokens
        else:
            continue
        ratios.append(ratio)
        out.truncated += ratio < TRUNCATED
        out.overrun += ratio > OVERRUN
    out.compared = len(ratios)
    out.ratios = tuple(round(r, 4) for r in ratios)
    return out


@dataclass
class Schedules:
    requests: int  # (arm, deploy, repeat, prompt) with spans
    distinct: int  # distinct (deploy, prompt, schedule)
    per_arm: dict[str, int]  # distinct (deploy, prompt, schedule) of each arm
    per_deploy: dict[str, int]  # distinct (prompt, schedule) of each deploy, over arms and repeats


def schedules(run: Run) -> Schedules:
    """Distinct (P, c, n) span sequences per request: from the records' ``schedule`` digests when every
    record has one (a sweep's), else from ``spans.jsonl`` (in step order per cell)."""
    if run.requests and all(r.schedule is not None for r in run.requests):
        seen_r: set[tuple] = set()
        arm_r: dict[str, set] = {}
        deploy_r: dict[str, set] = {}
        for r in run.requests:
            seen_r.add((r.deploy, r.prompt_id, r.schedule))
            arm_r.setdefault(r.arm, set()).add((r.deploy, r.prompt_id, r.schedule))
            deploy_r.setdefault(r.deploy, set()).add((r.prompt_id, r.schedule))
        return Schedules(len(run.requests), len(seen_r), {a: len(v) for a, v in arm_r.items()},
                         {d: len(v) for d, v in deploy_r.items()})
    table = run.spans
    if len(table) == 0:
        return Schedules(0, 0, {}, {})
    keys, codes = table.group_codes
    cols = table.columns
    order = np.lexsort((cols["step"], codes))
    triples = np.stack([cols["P"], cols["c"], cols["n"]], axis=1)[order].astype(np.int64)
    sorted_codes = codes[order]
    bounds = np.flatnonzero(np.diff(sorted_codes)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(sorted_codes)]])
    seen: set[tuple] = set()
    per_arm: dict[str, set] = {}
    per_deploy: dict[str, set] = {}
    for s, e in zip(starts.tolist(), ends.tolist()):
        arm, deploy, _repeat, request = keys[int(sorted_codes[s])]
        blob = triples[s:e].tobytes()
        seen.add((deploy, request, blob))
        per_arm.setdefault(arm, set()).add((deploy, request, blob))
        per_deploy.setdefault(deploy, set()).add((request, blob))
    return Schedules(len(keys), len(seen), {a: len(v) for a, v in per_arm.items()},
                     {d: len(v) for d, v in per_deploy.items()})
