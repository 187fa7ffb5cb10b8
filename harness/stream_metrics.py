"""What a listener gets from a streamed audio response, from the chunks' arrival times alone (pure, no I/O).

Why a module of its own: the same definitions serve every streaming API the harness measures
(Qwen2.5-Omni's ``/v1/chat/completions`` with ``stream: true``, ``/v1/audio/speech`` streamed or not)
and the tests pin them with hand-computed cases, so a number in a record means one thing.

Input: one ``Chunk`` per piece of audio the client received, with its arrival time (seconds, on the
clock the send time was taken with) and the audio frames it carried (samples per channel), plus the
sample rate. Definitions (docs/streaming.md):

* **TTFA**: send to the arrival of the first chunk that carries audio (its first bytes were read).
* **gaps**: arrival of chunk k minus arrival of chunk k-1, for every audio chunk after the first
  (``chunks - 1`` values).
* **underruns**: a player that starts playing at the first chunk's arrival, plays each chunk whole and
  in order, and when it has nothing left waits for the next chunk (then goes on from there). Chunk k
  is due when the audio before it has been played: ``due_k = start_k-1 + duration_k-1`` with
  ``start_1 = arrival_1`` and ``start_k = max(arrival_k, due_k)``. An underrun is a chunk arriving
  after it was due: it starts at ``due_k`` (seconds since the send) and lasts ``arrival_k - due_k``.
* **RTF**: the stream's wall time (send to its last byte) over the seconds of audio received.

Chunks without audio frames (a WAV header alone, a text delta) are not audio chunks: they move no
clock here; the caller leaves them out or passes them with ``frames == 0``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """One piece of audio as received: ``at`` seconds (any clock; the send time is on the same one)."""

    at: float
    frames: int


@dataclass(frozen=True)
class Underrun:
    """The player ran dry: from ``start_s`` (seconds since the send) for ``length_s`` seconds."""

    start_s: float
    length_s: float


@dataclass(frozen=True)
class StreamMetrics:
    """The streaming facts of one response (times in seconds since the send)."""

    sample_rate: int
    chunks: int  # chunks that carried audio frames
    frames: int  # audio frames received in all
    ttfa_s: float | None  # None: no audio arrived
    end_s: float  # the stream's last byte (or the last chunk when no end is given)
    gaps_s: tuple[float, ...]  # chunks - 1 values
    underruns: tuple[Underrun, ...]
    chunk_frames: tuple[int, ...]  # frames of each audio chunk, in order

    @property
    def audio_s(self) -> float:
        return self.frames / self.sample_rate

    @property
    def underrun_s(self) -> float:
        """Total time the player spent waiting (the sum of the underruns' lengths)."""
        return math.fsum(u.length_s for u in self.underruns)

    @property
    def rtf(self) -> float | None:
        """Wall time of the stream over the audio's seconds; None without audio."""
        return self.end_s / self.audio_s if self.frames else None


class StreamError(ValueError):
    """The chunks cannot describe a stream (a time before the send or out of order, negative frames)."""


def stream_metrics(chunks: Sequence[Chunk], sample_rate: int, sent_at: float = 0.0,
                   end_at: float | None = None) -> StreamMetrics:
    """The metrics of ``chunks`` (in arrival order) sent at ``sent_at``; ``end_at``: when the stream's
    last byte arrived (default: the last chunk's arrival). Chunks with no frames are skipped."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
        raise StreamError(f"sample rate must be a positive integer, got {sample_rate!r}")
    if not math.isfinite(sent_at):
        raise StreamError(f"send time must be finite, got {sent_at!r}")
    previous = sent_at
    for i, c in enumerate(chunks):
        if isinstance(c.frames, bool) or not isinstance(c.frames, int) or c.frames < 0:
            raise StreamError(f"chunk {i}: frames must be an integer >= 0, got {c.frames!r}")
        if not math.isfinite(c.at) or c.at < sent_at:
            raise StreamError(f"chunk {i}: arrival {c.at!r} is not after the send ({sent_at!r})")
        if c.at < previous:
            raise StreamError(f"chunk {i}: arrival {c.at!r} is before the chunk before it ({previous!r})")
        previous = c.at
    audio = [Chunk(c.at - sent_at, c.frames) for c in chunks if c.frames > 0]
    last = chunks[-1].at if chunks else sent_at
    if end_at is not None and (not math.isfinite(end_at) or end_at < last):
        raise StreamError(f"stream end {end_at!r} is before its last chunk ({last!r})")
    end = (end_at if end_at is not None else last) - sent_at
    gaps = tuple(b.at - a.at for a, b in zip(audio, audio[1:]))
    underruns: list[Underrun] = []
    if audio:
        start = audio[0].at
        for before, chunk in zip(audio, audio[1:]):
            due = start + before.frames / sample_rate
            if chunk.at > due:
                underruns.append(Underrun(due, chunk.at - due))
            start = max(chunk.at, due)
    return StreamMetrics(
        sample_rate=sample_rate, chunks=len(audio), frames=sum(c.frames for c in audio),
        ttfa_s=audio[0].at if audio else None, end_s=end, gaps_s=gaps, underruns=tuple(underruns),
        chunk_frames=tuple(c.frames for c in audio),
    )


def frames_of(byte_counts: Sequence[int], frame_bytes: int) -> list[int]:
    """Frames carried by each of a byte stream's pieces: a frame counts in the piece where its last
    byte arrived (a read can end inside a sample), so the frames add up to ``total // frame_bytes``."""
    if frame_bytes <= 0:
        raise StreamError(f"bytes per frame must be positive, got {frame_bytes!r}")
    out, total = [], 0
    for n in byte_counts:
        if n < 0:
            raise StreamError(f"a piece of {n} bytes")
        before = total // frame_bytes
        total += n
        out.append(total // frame_bytes - before)
    return out


def stream_failure(frames: int, codec_frames: int, samples_per_frame: int, end_trim: int = 0) -> str | None:
    """Why a streamed answer with audio is still a failed request: it is shorter than the codec stream
    the Talker produced decodes to (``codec_frames`` x ``samples_per_frame``, less ``end_trim``: samples a
    family's decoder never emits at the stream's right edge, under one frame); None when it is whole.
    (An answer with no audio at all is already an error of the client's.)"""
    want = codec_frames * samples_per_frame
    if frames < want - end_trim:
        return (f"truncated audio: {frames} samples, its {codec_frames} codec frames decode to {want} "
                f"({(want - frames) / samples_per_frame:g} frames missing)")
    return None
