"""WER scoring as the seed did it: Whisper's English normaliser, then jiwer. Pure, no I/O.

Both sides go through ``EnglishTextNormalizer`` (openai-whisper's, no weights needed), so
"twenty-five" and "25", "it's" and "it is", punctuation and case all compare equal.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _normalizer() -> Any:
    from whisper.normalizers import EnglishTextNormalizer  # imports torch: load only when scoring

    return EnglishTextNormalizer()


def normalize(text: str) -> str:
    """Whisper's English normalisation, with whitespace collapsed."""
    return " ".join(_normalizer()(text).split())


@lru_cache(maxsize=4096)  # a run asks once per request, of a few distinct replies (a sweep: 800 asks, 16 texts)
def measurable(reference: str) -> bool:
    """Whether WER can judge speech against ``reference``: it keeps at least one word after
    normalisation. A reference of special tokens, symbols or emoji only normalises to nothing, and
    ``wer`` would score any empty transcript 0.0 against it: perfect speech for noise (issue 24,
    case 15). Such a request is "not measurable" (``RequestRecord.not_measurable``)."""
    return bool(normalize(reference))


def spoken_mismatch(reference: str, spoken: str) -> tuple[str, str] | None:
    """``(reference, spoken)`` normalised when a Talker that says exactly ``spoken`` would not score
    WER 0 against ``reference``; None when it would, or when ``reference`` is not measurable (it
    normalises to no words: such a request is recorded as not measurable, never scored)."""
    ref = normalize(reference)
    if not ref:
        return None
    hyp = normalize(spoken)
    return None if ref == hyp else (ref, hyp)


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate of ``hypothesis`` against ``reference`` after normalisation.

    An empty hypothesis scores 1.0 (nothing intelligible was said). An empty reference scores
    0.0 if the hypothesis is empty too, else 1.0 (jiwer cannot divide by zero words).
    Insertions can push WER above 1.0; that is kept, as jiwer and the seed report it.
    """
    import jiwer

    ref, hyp = normalize(reference), normalize(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    if not hyp:
        return 1.0
    return float(jiwer.wer(ref, hyp))


@dataclass(frozen=True)
class WerSummary:
    """Corpus view of per-request WERs: mean (the seed's column), median, count over 0.5."""

    mean: float
    median: float
    over_half: int
    n: int


def summarize(wers: Sequence[float]) -> WerSummary:
    values = [float(w) for w in wers]
    if not values:
        return WerSummary(mean=float("nan"), median=float("nan"), over_half=0, n=0)
    return WerSummary(mean=statistics.fmean(values), median=statistics.median(values),
                      over_half=sum(1 for w in values if w > 0.5), n=len(values))
