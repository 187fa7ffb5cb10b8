"""Row identities that survive bfloat16: the sim's rows for a hook that casts to bf16.

Why: Qwen3-Omni's ``talker_preprocess`` (and every method it reaches) casts the Thinker's rows and the
codec rows to ``torch.bfloat16`` before it assembles them, as the release runs on the GPU.
``harness.sim.rows.RowSpace`` carries a row's identity as ``id + 1`` in one float32 column, which bf16
(8 significant bits) rounds away above 256, and its other columns are float32 randoms bf16 rounds too.
This space makes every value of every row exactly representable in bf16, so a cast changes nothing:

* each part's identity is written in **two** columns, ``id // 128 + 1`` and ``id % 128 + 1`` (integers
  up to 256: exact in bf16), for text ids up to 32767 and every codec id;
* the other columns are the same deterministic normals as ``RowSpace``'s, rounded to bf16 once, when
  the row is made.

Sums of a text part and a codec part stay exact (their columns are disjoint), as do bf16 -> float32
casts. A row an arm really changes (scaled, mixed, from another request) is still ``UNKNOWN`` or another
id: the comparison is the same whole-part check within ``_TOL`` as ``RowSpace``'s.
"""

from __future__ import annotations

import numpy as np
import torch

from harness.sim.rows import CODEC_VOCAB, DIM, NONE, TEXT_DIMS, UNKNOWN, RowSpace, TextMeaning, _seed

BASE = 128  # an id is (id // BASE + 1, id % BASE + 1) in a part's first two columns
MAX_TEXT_ROWS = BASE * 255  # the high column stays <= 256
assert CODEC_VOCAB <= MAX_TEXT_ROWS  # every codec id fits the two columns too
_TOL = 1e-4


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def _encode(rows: torch.Tensor, start: int, first_id: int) -> None:
    ids = torch.arange(first_id, first_id + rows.shape[0])
    rows[:, start] = (ids // BASE + 1).to(torch.float32)
    rows[:, start + 1] = (ids % BASE + 1).to(torch.float32)


class BF16RowSpace(RowSpace):
    """``RowSpace`` whose text rows and codec table are exact in bfloat16 (see the module docstring)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        table = _bf16(self.codec_table)
        table[:, :TEXT_DIMS] = 0.0
        _encode(table[:, TEXT_DIMS:], 0, 0)
        self.codec_table = table
        self._codec_np = self.codec_table.numpy()
        self._codec_parts_np = self._codec_np[:, TEXT_DIMS:]

    def make(self, kind: str, words: list[str | None], request: str | None) -> tuple[torch.Tensor, int]:
        first = len(self.meanings)
        if first + len(words) > MAX_TEXT_ROWS:
            raise ValueError(f"the bf16 row space holds {MAX_TEXT_ROWS} text rows; a cell asked for more")
        gen = torch.Generator().manual_seed(_seed(self._seed, request, kind, "bf16"))
        rows = torch.zeros(len(words), DIM)
        rows[:, :TEXT_DIMS] = _bf16(torch.randn(len(words), TEXT_DIMS, generator=gen))
        _encode(rows, 0, first)
        self.register(rows, [TextMeaning(kind, w, request, i) for i, w in enumerate(words)])
        return rows, first

    def register(self, rows: torch.Tensor, meanings: list[TextMeaning]) -> int:
        first = len(self.meanings)
        self._text_chunks.append(rows[:, :TEXT_DIMS].clone())
        self._text = None
        self._text_np = None
        self.meanings.extend(meanings)
        return first

    def _table(self) -> np.ndarray:
        if self._text_np is None:
            self._text_np = np.ascontiguousarray(self.text_matrix.numpy())
        return self._text_np

    def identify(self, rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        flat = rows.detach().to(torch.float32).reshape(-1, DIM).numpy()
        text = _match(flat[:, :TEXT_DIMS], self._table())
        codec = _match(flat[:, TEXT_DIMS:], self._codec_parts_np)
        return text, codec

    def identify_one(self, rows: torch.Tensor) -> tuple[int, int]:
        text, codec = self.identify(rows)
        return int(text[0]), int(codec[0])


def _match(parts: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Per row: the id its two identity columns name when the whole part equals that table row within
    ``_TOL``; ``NONE`` for an all-zero part; else ``UNKNOWN``."""
    n = parts.shape[0]
    out = np.full(n, UNKNOWN, dtype=np.int64)
    with np.errstate(invalid="ignore"):
        hi, lo = np.rint(parts[:, 0]) - 1, np.rint(parts[:, 1]) - 1
        cand = hi * BASE + lo
        valid = np.isfinite(cand) & (hi >= 0) & (lo >= 0) & (lo < BASE) & (cand < table.shape[0])
    idx = np.where(valid, cand, 0).astype(np.int64)
    if table.shape[0]:
        diff = np.abs(parts - table[idx]).max(axis=1)
        out[valid & (diff < _TOL)] = idx[valid & (diff < _TOL)]
    out[np.abs(parts).max(axis=1) < _TOL] = NONE
    return out

