"""The Code2Wav chunk contract: what each window the Talker's connector sends must carry (pure, no I/O).

Why: with ``async_chunk: true`` the audio a user hears is Code2Wav's decode of the windows the connector
sends, not the Talker's codec stream itself. A window with a frame dropped, repeated, out of order or
taken from another request is heard, and no WER on the codec stream sees it. So each request's windows
(``harness.serve.chunk_trace`` lines, or the sim's model) are checked against its codec stream (the
Talker's traced input ids at generated positions, ``RequestRecord.codec_tokens``).

The shipped rule (vLLM-Omni 0.30.0, ``stage_input_processors/qwen3_tts.py: talker2code2wav_async_chunk``,
with the release's ``deploy/qwen3_tts.yaml`` connector settings ``initial_codec_chunk_frames: 1``,
``codec_chunk_frames: 25``): a request's frames ``0..L-1`` go out in order, each exactly once: window 0
holds frame 0 alone (the early first packet), every later window the next 25 frames, the last window
what is left (fewer, or an empty window when the stream ended on a boundary), and only the last says
``finished``. No window repeats earlier frames: ``left_context_size`` is 0 for a request without ICL
reference codes (CustomVoice), because Code2Wav keeps each request's decoder context itself
(``codec_left_context_frames: 72`` sizes that context, it is not resent).

One ``Violation`` per window that breaks the rule, plus one at the end for frames never sent or a
missing ``finished``; the window is then re-aligned to where its frames do fit in the stream (a drop
or a repeat is counted once, not again for every window behind it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkRule:
    """The connector's window sizes and the left context each window repeats."""

    chunk_frames: int = 25
    initial_frames: int = 1
    left_context: int = 0

    def size(self, index: int) -> int:
        """The frames window ``index`` carries when the stream goes on past it."""
        early = 0 < self.initial_frames < self.chunk_frames
        return self.initial_frames if index == 0 and early else self.chunk_frames

    def boundaries(self, length: int) -> list[int]:
        """The new-frame count of each window for a stream of ``length`` frames (an empty last window
        when the stream ends on a boundary is not listed)."""
        out, pos = [], 0
        while pos < length:
            n = min(self.size(len(out)), length - pos)
            out.append(n)
            pos += n
        return out


SHIPPED = ChunkRule()  # 0.30.0's qwen3_tts.yaml (module docstring)


@dataclass(frozen=True)
class Window:
    """One window as sent: its frames (codebook 0, left context first), left context and finished flag."""

    frames: tuple[int, ...]
    left_context: int = 0
    finished: bool = False


@dataclass(frozen=True)
class Violation:
    window: int | None  # the window's index in sending order; None: the request's end
    kind: str  # left-context, dropped, duplicated, foreign, wrong-frames, size, unfinished, early-finish, missing
    text: str


@dataclass(frozen=True)
class ChunkCheck:
    windows: int  # windows that carried new frames
    frames_sent: tuple[int, ...]  # new frames per such window
    violations: tuple[Violation, ...]

    @property
    def count(self) -> int:
        return len(self.violations)

    @property
    def first(self) -> str | None:
        return self.violations[0].text if self.violations else None


def _find(stream: Sequence[int], part: Sequence[int], lo: int) -> int | None:
    """The first offset >= ``lo`` where ``part`` sits in ``stream``."""
    n = len(part)
    for o in range(max(lo, 0), len(stream) - n + 1):
        if list(stream[o:o + n]) == list(part):
            return o
    return None


def _subsequence(short: Sequence[int], long: Sequence[int]) -> bool:
    it = iter(long)
    return all(any(x == y for y in it) for x in short)


def _inside(stream: Sequence[int], new: Sequence[int], pos: int) -> tuple[str, int] | None:
    """A window that lost (``dropped``) or repeated (``duplicated``) ``d`` frames inside it, ending where
    the stream does: the kind and ``d``, the smallest that fits."""
    n = len(new)
    for d in range(1, n + 1):
        span = stream[pos:pos + n + d]
        if len(span) == n + d and span[-1] == new[-1] and _subsequence(new, span):
            return "dropped", d
        span = stream[pos:pos + n - d]
        if d < n and span and span[-1] == new[-1] and _subsequence(span, new):
            return "duplicated", d
    return None


def _wrong(stream: Sequence[int], new: Sequence[int], pos: int, i: int) -> str:
    """A window whose frames are nobody's: how many differ from the stream's at their places, and the first."""
    want = list(stream[pos:pos + len(new)])
    diff = [k for k, got in enumerate(new) if k >= len(want) or got != want[k]]
    k = diff[0]
    fed = f"where the Talker fed {want[k]}" if k < len(want) else "past the end of its stream"
    return (f"window {i}: {len(diff)} of {len(new)} frames wrong in frames {pos}-{pos + len(new) - 1} "
            f"(frame {pos + k}: {new[k]} {fed})")


def check_windows(windows: Sequence[Window], stream: Sequence[int], rule: ChunkRule = SHIPPED,
                  others: Mapping[str, Sequence[int]] | None = None) -> ChunkCheck:
    """Check one request's ``windows`` (sending order) against its codec ``stream``; ``others``: the other
    requests' streams (by name), to tell a foreign window from a wrong one."""
    violations: list[Violation] = []
    sent: list[int] = []
    pos = 0  # frames of the stream sent so far
    finished_at: int | None = None
    for i, w in enumerate(windows):
        left = max(0, min(w.left_context, len(w.frames)))
        context, new = list(w.frames[:left]), list(w.frames[left:])
        if finished_at is not None:
            violations.append(Violation(i, "early-finish", f"window {i}: sent after window {finished_at} said finished"))
        if w.finished and finished_at is None:
            finished_at = i
        want_left = min(rule.left_context, pos)
        if w.left_context != want_left or context != list(stream[pos - left:pos]):
            violations.append(Violation(i, "left-context", f"window {i}: left context {w.left_context} "
                                                            f"frames, want the {want_left} before frame {pos}"))
        if not new:
            continue
        sent.append(len(new))
        if list(stream[pos:pos + len(new)]) == new:
            last = pos + len(new) >= len(stream)
            if not last and not w.finished and len(new) != rule.size(len(sent) - 1):
                violations.append(Violation(i, "size", f"window {i}: {len(new)} new frames at frame {pos}, "
                                                        f"the rule sends {rule.size(len(sent) - 1)}"))
            pos += len(new)
            continue
        at = _find(stream, new, pos + 1)
        earlier = _find(stream, new, 0)
        if at is not None:
            violations.append(Violation(i, "dropped", f"window {i}: frames {pos}-{at - 1} never sent "
                                                       f"(it carries frames {at}-{at + len(new) - 1})"))
            pos = at + len(new)
        elif earlier is not None and earlier < pos:
            violations.append(Violation(i, "duplicated", f"window {i}: resends frames {earlier}-"
                                                          f"{earlier + len(new) - 1} (next new frame is {pos})"))
            pos = max(pos, earlier + len(new))
        elif (inside := _inside(stream, new, pos)) is not None:
            kind, d = inside
            gone = kind == "dropped"
            violations.append(Violation(i, kind, f"window {i}: {d} frame{'s' if d > 1 else ''} "
                                                  f"{'lost' if gone else 'repeated'} inside frames {pos}-"
                                                  f"{pos + len(new) + (d if gone else -d) - 1}"))
            pos += len(new) + (d if gone else -d)
        else:
            owner = next((name for name, s in sorted((others or {}).items()) if _find(s, new, 0) is not None), None)
            if owner is not None:
                violations.append(Violation(i, "foreign", f"window {i}: {len(new)} request {owner}'s frames where "
                                                          f"frames {pos}-{pos + len(new) - 1} belong"))
            else:
                violations.append(Violation(i, "wrong-frames", _wrong(stream, new, pos, i)))
            pos += len(new)
    if pos < len(stream):
        violations.append(Violation(None, "missing", f"frames {pos}-{len(stream) - 1} of {len(stream)} never sent"))
    if windows and finished_at is None:
        violations.append(Violation(None, "unfinished", "no window said finished"))
    return ChunkCheck(windows=len(sent), frames_sent=tuple(sent), violations=tuple(violations))
