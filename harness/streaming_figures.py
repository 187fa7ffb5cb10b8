"""The streaming figures users compare, per cell, from its request records (pure, no I/O).

Why: an operator choosing a Talker concurrency asks how soon audio starts (TTFP), whether playback stalls,
and what share of users got what they were promised (goodput), at p50/p90/p99 and worst, not as a mean.
Every figure is measured from what the client received (``harness.stream_metrics``, the records'
``stream_*`` fields); a request that failed (an error, or audio shorter than its codec stream:
``stream_failed``) counts in every rate as a failure, never as a success.

Definitions (docs/streaming.md):

* **TTFP**: time to the first audio packet (the record's ``stream_ttfa_s``).
* **gaps**: every inter-chunk gap of every streamed request.
* **stall**: an underrun of a player that starts at the first packet and waits when it runs dry
  (``stream_underruns``); a request's worst stall is its longest one, its stall total their sum.
* **continuity at T**: the share of the cell's requests that finished streaming with no stall over T
  seconds (T = 0.05, 0.1, 0.2; 0.1 is the rate gated, the "audible gap" threshold upstream's bench uses).
* **RTF**: the request's wall time over its audio seconds (the record's ``rtf``, as for every real record).
* **audio throughput**: the cell's audio seconds over its request window (first send to last byte).
* **goodput**: the share of requests that meet the SLO (``StreamingSlo``: TTFP at most ``ttfp_s``, no stall over
  ``max_stall_s``); errors and failed streams violate it.
* **chunk violations**: the Code2Wav windows that broke the chunk contract (``harness.chunk_contract``).

``bench_fields`` names the cell's figures as ``vllm bench serve --omni`` does (``mean_audio_ttfp_ms``,
``p99_audio_ttfp_ms``, ``mean_audio_rtf``, ``audio_throughput``, ``audio_continuity_ok_rate``, ...), so a
result can be put beside upstream's. Upstream's ``audio_underrun_s`` is the deficit of a player that
never pauses (``vllm_omni/benchmarks/audio_continuity.py``); ours is a player that waits, so the stall
figures keep their own names, and ``audio_continuity_ok_rate`` here is ours at 100 ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from harness.config import StreamingSlo
from harness.records import RequestRecord

THRESHOLDS_S = (0.05, 0.1, 0.2)
GATED_THRESHOLD_S = 0.1
PERCENTILES = (50, 90, 99)




@dataclass(frozen=True)
class Spread:
    """p50/p90/p99 (linear interpolation, numpy's default) and the worst of a set of values."""

    p50: float
    p90: float
    p99: float
    worst: float
    mean: float


def spread(values: Sequence[float]) -> Spread | None:
    if not values:
        return None
    xs = sorted(float(v) for v in values)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return Spread(pct(50), pct(90), pct(99), xs[-1], math.fsum(xs) / len(xs))


def worst_stall(r: RequestRecord) -> float:
    return max((u[1] for u in r.stream_underruns or []), default=0.0)


def failed(r: RequestRecord) -> bool:
    """An error, or a stream that answered but is not the audio its codec stream says."""
    return r.error is not None or r.stream_failed is not None


def streamed(records: Sequence[RequestRecord]) -> bool:
    """Whether any request of a cell streamed: answered with a measured stream, or a truncated one."""
    return any((r.error is None and r.stream_ttfa_s is not None) or r.stream_failed is not None for r in records)


def meets_slo(r: RequestRecord, slo: StreamingSlo) -> bool:
    """Goodput's test of one request: answered with a whole stream, its TTFP and worst stall within ``slo``."""
    if failed(r) or r.stream_ttfa_s is None:
        return False
    return ((slo.ttfp_s is None or r.stream_ttfa_s <= slo.ttfp_s)
            and (slo.max_stall_s is None or worst_stall(r) <= slo.max_stall_s))


@dataclass(frozen=True)
class StreamingFigures:
    requests: int  # the cell's requests
    streamed: int  # answered with a measured stream (a truncated one included)
    failed: int  # errors and failed streams (truncated audio)
    ttfp: Spread | None
    gaps: Spread | None
    worst_stall_s: float | None  # the longest stall of any request
    stall: Spread | None  # per request: its stall total
    continuity: dict[float, float]  # threshold (s) -> share of requests
    rtf: Spread | None
    audio_s: float
    window_s: float | None  # first send to last byte
    goodput: float | None  # share of requests meeting the SLO
    slo: StreamingSlo
    chunk_violations: int | None  # None: the connector's windows were not traced or modelled
    chunk_windows: Spread | None  # windows per request

    @property
    def throughput(self) -> float | None:
        """Audio seconds per wall second over the cell's request window."""
        return self.audio_s / self.window_s if self.window_s else None

    @property
    def continuity_rate(self) -> float | None:
        return self.continuity.get(GATED_THRESHOLD_S)


def figures(records: Sequence[RequestRecord], slo: StreamingSlo = StreamingSlo()) -> StreamingFigures | None:
    """The cell's figures; None when none of its requests streamed (nothing to measure). Latencies (TTFP,
    gaps, stalls, RTF) are over every answered stream, a truncated one included; the rates (continuity,
    goodput) count a failed request as a failure."""
    recs = list(records)
    if not streamed(recs):
        return None
    answered = [r for r in recs if r.error is None and r.stream_ttfa_s is not None]
    n = len(recs)
    stalls = {id(r): worst_stall(r) for r in answered}
    ok = [r for r in answered if not failed(r)]
    continuity = {t: sum(stalls[id(r)] <= t for r in ok) / n for t in THRESHOLDS_S} if n else {}
    good = [r for r in ok if meets_slo(r, slo)]
    sent = [r for r in answered if r.stream_sent_at is not None and r.stream_end_s is not None]
    window = (max(r.stream_sent_at + r.stream_end_s for r in sent) - min(r.stream_sent_at for r in sent)  # type: ignore[operator]
              if sent else None)
    audio = math.fsum(sum(r.stream_chunk_frames) / r.stream_sample_rate for r in answered
                      if r.stream_chunk_frames and r.stream_sample_rate)
    chunked = [r for r in recs if r.chunk_violations is not None]
    return StreamingFigures(
        requests=n, streamed=len(answered), failed=sum(failed(r) for r in recs),
        ttfp=spread([r.stream_ttfa_s for r in answered]),  # type: ignore[misc]
        gaps=spread([g for r in answered for g in r.stream_gaps_s or []]),
        worst_stall_s=max(stalls.values()) if stalls else None,
        stall=spread([r.stream_underrun_s or 0.0 for r in answered]), continuity=continuity,
        rtf=spread([r.rtf for r in answered if r.rtf is not None]),
        audio_s=audio, window_s=window, goodput=len(good) / n if n else None, slo=slo,
        chunk_violations=sum(r.chunk_violations or 0 for r in chunked) if chunked else None,
        chunk_windows=spread([float(r.chunk_windows or 0) for r in chunked]),
    )


@dataclass(frozen=True)
class ModelledFigures:
    """The sim's streaming figures, in scheduler steps, from its modelled windows (``chunk_window_steps``):
    the first window's step since the send (TTFP), the steps between windows, the windows and violations.
    Modelled, not measured: no player stalls or goodput (they need seconds of audio against wall time)."""

    requests: int
    modelled: int  # requests with modelled windows
    ttfp_steps: Spread | None
    gap_steps: Spread | None
    windows: Spread | None
    chunk_violations: int


def modelled_figures(records: Sequence[RequestRecord]) -> ModelledFigures | None:
    """None when no request of the cell has modelled windows (a measured stream, or no streaming deploy).
    A request's send is its ``sent_step`` (every request is sent at step 0 in a run without latency fields:
    load ``all``, as the sim's arrivals say)."""
    recs = [r for r in records if r.chunk_window_steps and r.stream_ttfa_s is None]
    if not recs:
        return None
    return ModelledFigures(
        requests=len(records), modelled=len(recs),
        ttfp_steps=spread([float(r.chunk_window_steps[0] - (r.sent_step or 0)) for r in recs]),  # type: ignore[index]
        gap_steps=spread([float(b - a) for r in recs for a, b in zip(r.chunk_window_steps, r.chunk_window_steps[1:])]),  # type: ignore[arg-type]
        windows=spread([float(r.chunk_windows or 0) for r in recs]),
        chunk_violations=sum(r.chunk_violations or 0 for r in recs),
    )


def modelled_fields(f: ModelledFigures) -> dict[str, float | int | None]:
    """streaming.json's fields of a modelled cell (steps; ``modelled: true``)."""
    out: dict[str, float | int | None] = {"modelled": True, "requests": f.requests, "modelled_requests": f.modelled}
    for name, sp in (("ttfp_steps", f.ttfp_steps), ("gap_steps", f.gap_steps)):
        if sp is not None:
            out.update({f"median_{name}": sp.p50, f"p90_{name}": sp.p90, f"p99_{name}": sp.p99,
                        f"max_{name}": sp.worst})
    out["median_windows"] = None if f.windows is None else f.windows.p50
    out["chunk_violations"] = f.chunk_violations
    return out


def violations_beyond_replays(records: Sequence[RequestRecord]) -> int | None:
    """Chunk-contract violations beyond one window per preempted request: on vLLM-Omni 0.30.0 the window
    holding a replay's recomputed frames reaches Code2Wav with frames the Talker did not produce, whatever
    the arm (measured on the CPU server, docs/streaming.md), so a gate can hold a candidate to 0 here and
    to 0 plain ``chunk_violations`` where nothing is preempted. None: no window was traced or modelled."""
    chunked = [r for r in records if r.chunk_violations is not None]
    if not chunked:
        return None
    return sum(max(0, (r.chunk_violations or 0) - (1 if r.preemptions > 0 else 0)) for r in chunked)


STREAM_METRICS: dict[str, str] = {  # the gate's streaming metrics (harness.gate.rules), their labels
    "failed_streams": "streamed requests that failed (errors, audio shorter than its codec stream)",
    "continuity_rate": "share of requests with no stall over 100 ms",
    "goodput": "share of requests meeting the streaming SLO",
    "ttfp_p99_s": "TTFP p99 (s)",
    "chunk_violations": "Code2Wav windows that broke the chunk contract",
    "chunk_violations_beyond_replays": "chunk-contract violations beyond one window per preempted request",
}
RATIO_METRICS: dict[str, str] = {"ttfp_p99_ratio": "TTFP p99 over the reference deploy's"}


def metric(records: Sequence[RequestRecord], name: str, slo: StreamingSlo = StreamingSlo()) -> float | None:
    """One of ``STREAM_METRICS`` for a cell; None when the cell did not stream (or, for the chunk metrics,
    its connector was not traced)."""
    if name == "chunk_violations_beyond_replays":
        value = violations_beyond_replays(records)
        return None if value is None else float(value)
    if name == "chunk_violations":  # traced at the connector, or modelled by the sim: no audio needed
        chunked = [r.chunk_violations for r in records if r.chunk_violations is not None]
        return float(sum(chunked)) if chunked else None
    f = figures(records, slo)
    if f is None:
        return None
    if name == "failed_streams":
        return float(f.failed)
    if name == "continuity_rate":
        return f.continuity_rate
    if name == "goodput":
        return f.goodput
    if name == "ttfp_p99_s":
        return None if f.ttfp is None else f.ttfp.p99
    raise KeyError(name)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def bench_fields(f: StreamingFigures) -> dict[str, float | int | None]:
    """The figures under ``vllm bench serve --omni``'s result names where one exists (module docstring),
    and the rest under ours."""
    out: dict[str, float | int | None] = {"completed": f.requests - f.failed, "failed": f.failed}
    if f.ttfp is not None:
        out.update(mean_audio_ttfp_ms=_ms(f.ttfp.mean), median_audio_ttfp_ms=_ms(f.ttfp.p50),
                   p90_audio_ttfp_ms=_ms(f.ttfp.p90), p99_audio_ttfp_ms=_ms(f.ttfp.p99),
                   max_audio_ttfp_ms=_ms(f.ttfp.worst))
    if f.rtf is not None:
        out.update(mean_audio_rtf=round(f.rtf.mean, 4), median_audio_rtf=round(f.rtf.p50, 4),
                   p90_audio_rtf=round(f.rtf.p90, 4), p99_audio_rtf=round(f.rtf.p99, 4))
    out.update(total_audio_duration_s=round(f.audio_s, 6),
               audio_throughput=None if f.throughput is None else round(f.throughput, 4),
               audio_continuity_ok_rate=f.continuity.get(GATED_THRESHOLD_S),
               request_goodput_rate=f.goodput, slo_text=f.slo.describe(),
               benchmark_duration_s=None if f.window_s is None else round(f.window_s, 6))
    if f.gaps is not None:
        out.update(median_gap_ms=_ms(f.gaps.p50), p90_gap_ms=_ms(f.gaps.p90), p99_gap_ms=_ms(f.gaps.p99),
                   max_gap_ms=_ms(f.gaps.worst))
    out.update(max_stall_ms=_ms(f.worst_stall_s),
               **{f"continuity_{round(t * 1000)}ms_rate": v for t, v in f.continuity.items()})
    if f.stall is not None:
        out.update(p99_stall_total_s=round(f.stall.p99, 6), total_stall_s=round(f.stall.mean * f.streamed, 6))
    out["chunk_violations"] = f.chunk_violations
    return out
