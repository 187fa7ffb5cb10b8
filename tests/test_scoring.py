"""Scoring: Whisper's English normaliser, jiwer WER, corpus summary."""

from __future__ import annotations

import math

import pytest

from harness.audio.scoring import WerSummary, normalize, summarize, wer


@pytest.mark.parametrize("text, expected", [
    ("Hello, World!", "hello world"),  # punctuation and case
    ("I can't go; it's late.", "i can not go it is late"),  # contractions
    ("twenty-five dollars", "$25"),  # spelled numbers and currency
    ("one hundred and two", "102"),
    ("Mr. Smith  arrived", "mister smith arrived"),  # abbreviations, extra spaces
    ("the colour grey", "the color gray"),  # British spellings
    ("", ""),
])
def test_normalize(text: str, expected: str) -> None:
    assert normalize(text) == expected


def test_wer_exact_values() -> None:
    assert wer("the cat sat on the mat", "the cat sat on the mat") == 0.0
    assert wer("the cat sat on the mat", "the cat sat on a mat") == pytest.approx(1 / 6)
    assert wer("a b c d", "a b") == 0.5  # two deletions of four words
    assert wer("a b", "a b c d") == 1.0  # two insertions of two words
    assert wer("a b", "a b c d e f") == 2.0  # insertions can exceed 1.0


def test_wer_compares_normalised_text() -> None:
    assert wer("It's twenty-five dollars.", "it is $25") == 0.0
    assert wer("Wait four minutes, then pour.", "wait 4 minutes then pour") == 0.0


def test_wer_empty_sides() -> None:
    assert wer("hello there", "") == 1.0
    assert wer("hello there", "  ,.  ") == 1.0  # nothing left after normalisation
    assert wer("", "") == 0.0
    assert wer("", "something") == 1.0


def test_summarize() -> None:
    s = summarize([0.0, 0.25, 0.5, 0.75, 1.5])
    assert s == WerSummary(mean=0.6, median=0.5, over_half=2, n=5)  # 0.5 itself is not over half
    assert summarize([1.0, 0.0]) == WerSummary(mean=0.5, median=0.5, over_half=1, n=2)


def test_summarize_empty() -> None:
    s = summarize([])
    assert s.n == 0 and s.over_half == 0 and math.isnan(s.mean) and math.isnan(s.median)
