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
        idx = ids.long().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids, dtype=np.int64)
        return torch.from_numpy(self._codec_np[idx])

    def identify(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(text ids, codec ids) per row: registry/codec index, ``NONE`` or ``UNKNOWN``."""
        flat = rows.detach().to(torch.float32).reshape(-1, DIM).numpy()
        if self._text_np is None:
            self._text_np = np.ascontiguousarray(self.text_matrix.numpy())
        return (torch.from_numpy(_match_np(flat[:, :TEXT_DIMS], self._text_np)),
                torch.from_numpy(_match_np(flat[:, TEXT_DIMS:], self._codec_parts_np)))

    @staticmethod
    def _match(parts: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Index of the table row each part equals (within ``_TOL``), ``NONE`` or ``UNKNOWN``."""
        return torch.from_numpy(_match_np(parts.detach().to(torch.float32).numpy(),
                                          table.detach().to(torch.float32).numpy()))


def _match_np(parts: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The id in dimension 0 (``id + 1``), confirmed by the whole part equalling that table row."""
    out = np.full(parts.shape[0], UNKNOWN, dtype=np.int64)
    zero = np.abs(parts).max(axis=1) < _TOL
    out[zero] = NONE
    first = parts[:, 0]
    # Out-of-range, inf and NaN ids can never match; clamp them before the integer cast.
    first = np.where(np.isfinite(first), np.clip(first, -2.0, table.shape[0] + 1.0), -2.0)
    ids = np.rint(first).astype(np.int64) - 1
    ok = ~zero & (ids >= 0) & (ids < table.shape[0])
    if ok.any():
        cand = ids[ok]
        same = np.abs(parts[ok] - table[cand]).max(axis=1) < _TOL
        out[ok] = np.where(same, cand, UNKNOWN)
    return out
