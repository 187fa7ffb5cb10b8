"""Deterministic, identifiable rows for the simulation.

A row is a float32 vector of ``DIM`` = 64. Text rows (Thinker embeddings and hidden states,
special text tokens) live in the first ``TEXT_DIMS`` dimensions; codec embeddings in the
last ``CODEC_DIMS``. A Talker input row is a sum of at most one of each, so any row the arm
produces (including another request's row, a zero row, or a stale one) can be decomposed and
identified exactly: the first dimension of each part carries ``id + 1`` (integers are exact in
float32) and the whole part must then equal that registered row; anything else (a scaled,
mixed or stale row) is ``UNKNOWN``, a zero part is ``NONE``.

Lookups run in NumPy on views of the same float32 memory: the runner identifies every span
of every step, and per-call torch dispatch overhead dominated the sim's wall time. The
arithmetic is the same float32 arithmetic, so the ids are identical.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

DIM = 64
TEXT_DIMS = 48
CODEC_DIMS = DIM - TEXT_DIMS
CODEC_VOCAB = 8448  # Qwen2.5-Omni Talker vocab size

NONE = -1  # no component (all zeros)
UNKNOWN = -2  # a component that matches no row ever made

_TOL = 1e-4
_ONE_ROW = torch.Size((1, DIM))


def _seed(*tag: object) -> int:
    digest = hashlib.sha256(repr(tag).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tagged_rows(count: int, first_id: int, *tag: object) -> torch.Tensor:
    """``count`` distinct text rows for one (request, source), deterministic in the tag."""
    gen = torch.Generator().manual_seed(_seed(*tag))
    rows = torch.zeros(count, DIM)
    rows[:, :TEXT_DIMS] = torch.randn(count, TEXT_DIMS, generator=gen)
    rows[:, 0] = torch.arange(first_id + 1, first_id + 1 + count, dtype=torch.float32)
    return rows


def tagged_index(row: torch.Tensor, first_id: int = 0) -> int:
    """Which row of a ``tagged_rows(..., first_id, ...)`` block ``row`` would be (its first column), -1 if none:
    where to look it up, to compare it whole."""
    first = float(row.detach().reshape(-1)[0]) if row.numel() else math.nan
    return round(first) - 1 - first_id if math.isfinite(first) else -1


@dataclass(frozen=True)
class TextMeaning:
    """What a registered text row is: its kind, the word it carries, and whose it is."""

    kind: str  # prompt | output | spk | text_bos | text_eos | text_pad
    word: str | None
    request: str | None
    index: int


class RowSpace:
    """Registry of every text row made in a cell, and the codec embedding table."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(_seed("codec-table", seed))
        self.codec_table = torch.zeros(CODEC_VOCAB, DIM)
        self.codec_table[:, TEXT_DIMS:] = torch.randn(CODEC_VOCAB, CODEC_DIMS, generator=gen)
        self.codec_table[:, TEXT_DIMS] = torch.arange(1, CODEC_VOCAB + 1, dtype=torch.float32)
        self._text_chunks: list[torch.Tensor] = []
        self._text: torch.Tensor | None = None
        self._text_np: np.ndarray | None = None
        self._codec_np = self.codec_table.numpy()  # shares memory with codec_table
        self._codec_parts_np = self._codec_np[:, TEXT_DIMS:]
        self.meanings: list[TextMeaning] = []
        self._seed = seed
        self._pair = np.zeros(DIM, dtype=np.float32)  # identify_one's scratch row

    # ----------------------------------------------------------------- registration
    def register(self, rows: torch.Tensor, meanings: list[TextMeaning]) -> int:
        """Adds text rows (made by ``tagged_rows`` with this id); returns the first registry id."""
        first = len(self.meanings)
        assert rows.shape[0] == len(meanings) and (rows.shape[0] == 0 or int(rows[0, 0]) == first + 1)
        self._text_chunks.append(rows[:, :TEXT_DIMS].clone())
        self._text = None
        self._text_np = None
        self.meanings.extend(meanings)
        return first

    def make(self, kind: str, words: list[str | None], request: str | None) -> tuple[torch.Tensor, int]:
        rows = tagged_rows(len(words), len(self.meanings), self._seed, request, kind)
        first = self.register(rows, [TextMeaning(kind, w, request, i) for i, w in enumerate(words)])
        return rows, first

    @property
    def text_matrix(self) -> torch.Tensor:
        if self._text is None:
            self._text = torch.cat(self._text_chunks) if self._text_chunks else torch.zeros(0, TEXT_DIMS)
        return self._text

    # ----------------------------------------------------------------- lookups
    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec embedding rows of ``ids`` (a new tensor, as ``codec_table[ids]`` would be)."""
        if isinstance(ids, torch.Tensor):
            idx = ids.numpy() if ids.dtype == torch.int64 and not ids.requires_grad else ids.long().numpy()
        else:
            idx = np.asarray(ids, dtype=np.int64)
        return torch.from_numpy(self._codec_np[idx])

    def embed_numpy(self, ids: np.ndarray) -> torch.Tensor:
        """``embed_codec`` of int64 ``ids`` already in a NumPy array (the runner's span ids)."""
        return torch.from_numpy(self._codec_np[ids])

    def identify(self, rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(text ids, codec ids) per row: registry/codec index, ``NONE`` or ``UNKNOWN`` (int64 arrays)."""
        if rows.requires_grad:
            rows = rows.detach()
        flat = rows.to(torch.float32).reshape(-1, DIM).numpy()
        if self._text_np is None:
            self._text_np = np.ascontiguousarray(self.text_matrix.numpy())
        if flat.shape[0] == 1:  # a decode step: scalar path, a third of the array calls
            row = flat[0]
            return (np.array([_match_row(row[:TEXT_DIMS], self._text_np)], dtype=np.int64),
                    np.array([_match_row(row[TEXT_DIMS:], self._codec_parts_np)], dtype=np.int64))
        ids = _match_segments(flat, (0, TEXT_DIMS), (self._text_np, self._codec_parts_np))
        return ids[:, 0].copy(), ids[:, 1].copy()

    def identify_one(self, rows: torch.Tensor) -> tuple[int, int]:
        """``identify`` of a single row, as two ints (a decode step: most spans of a run).

        The usual row is a registered text row plus a codec row: both candidate ids are read from
        the parts' first columns; a row whose parts are those rows bit for bit is theirs (compared
        as bytes: a difference of zero is within ``_TOL``), otherwise the whole row is checked
        against their sum within ``_TOL`` in one pass; any other row takes ``_match_row`` part by
        part, as ``identify`` does."""
        if rows.requires_grad:
            rows = rows.detach()
        if rows.dtype != torch.float32:
            rows = rows.to(torch.float32)
        row = rows.numpy()[0] if rows.shape == _ONE_ROW else rows.reshape(DIM).numpy()
        if self._text_np is None:
            self._text_np = np.ascontiguousarray(self.text_matrix.numpy())
        text, codec = self._text_np, self._codec_parts_np
        first_t, first_c = float(row[0]), float(row[TEXT_DIMS])
        if math.isfinite(first_t) and math.isfinite(first_c):
            t, k = round(first_t) - 1, round(first_c) - 1
            if -1 <= t < text.shape[0] and 0 <= k < codec.shape[0]:
                if t >= 0 and row[:TEXT_DIMS].tobytes() == text[t].tobytes() \
                        and row[TEXT_DIMS:].tobytes() == codec[k].tobytes():
                    return t, k
                want = self._pair
                if t >= 0:
                    want[:TEXT_DIMS] = text[t]
                else:  # no text row here (a zero text part, as 0.30.0 feeds after the reply): NONE if all zero
                    want[:TEXT_DIMS] = 0.0
                want[TEXT_DIMS:] = codec[k]
                np.subtract(row, want, out=want)
                if float(np.abs(want, out=want).max()) < _TOL:  # both parts within _TOL of their rows
                    return (t if t >= 0 else NONE), k
        return _match_row(row[:TEXT_DIMS], text), _match_row(row[TEXT_DIMS:], codec)


def _match_row(part: np.ndarray, table: np.ndarray) -> int:
    """``_match_segments`` for one part of one row."""
    first = float(part[0])
    if math.isfinite(first):
        cand = round(first) - 1  # half to even, as np.rint
        if 0 <= cand < table.shape[0] and float(np.abs(part - table[cand]).max()) < _TOL:
            return cand
    return NONE if float(np.abs(part).max()) < _TOL else UNKNOWN


def _match_segments(rows: np.ndarray, starts: tuple[int, ...], tables: tuple[np.ndarray, ...]) -> np.ndarray:
    """Per row and segment (columns ``starts[k]`` up to the next start), the id of the table row
    the segment equals within ``_TOL``, ``NONE`` for an all-zero segment, else ``UNKNOWN``.

    The id is read from the segment's first column (``id + 1``) and confirmed by the whole
    segment; all segments are handled by the same few array operations (one per step, not per
    segment), which is what makes the per-span lookup cheap.
    """
    n = rows.shape[0]
    limits = np.array([t.shape[0] for t in tables], dtype=np.float32)
    guess = np.rint(rows[:, list(starts)]) - 1  # NaN/inf fail the range test below
    valid = (guess >= 0) & (guess < limits)
    cand = np.where(valid, guess, 0).astype(np.int64)
    expected = np.concatenate(
        [t[cand[:, k]] if t.shape[0] else np.zeros((n, t.shape[1]), dtype=np.float32) for k, t in enumerate(tables)],
        axis=1)
    diff = np.maximum.reduceat(np.abs(rows - expected), list(starts), axis=1)
    size = np.maximum.reduceat(np.abs(rows), list(starts), axis=1)
    out = np.where(valid & (diff < _TOL), cand, UNKNOWN)
    out[size < _TOL] = NONE
    return out
