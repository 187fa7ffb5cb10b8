"""The simulated Talker: its speech depends only on the rows in its per-request KV.

Rules (arm-agnostic; docs/simulation.md):

1. KV: writing a span ``[c, c+n)`` stores the identified input row of each position and
   truncates the KV at ``c+n``; a preempted request's replay starts again at ``c = 0``, so
   its KV is rebuilt from whatever the replay supplies.
2. Start rows: the Talker speaks only if position ``P-2`` holds this request's speaker row +
   codec-PAD and ``P-1`` holds this request's ``thinker_result[0]`` + codec-BOS. Otherwise it
   babbles (noise codes).
3. Alignment (a Talker that started): the codec token at generated count ``g`` speaks the
   text of the row at position ``P - 1 + floor(g / R)`` (where, correctly conditioned, reply
   token ``floor(g / R)`` sits). A Thinker row speaks its word (a prompt row the prompt's word,
   another request's row that request's word); punctuation, template tokens and the
   speaker/BOS rows are silence; an unidentifiable text component is noise; the end of the text
   (text-EOS, text-PAD, or a row with no text component) makes it emit codec EOS, which ends
   the request. ``R`` comes from physics (``harness/physics.py``: 50 Hz codec, the TTS's
   140 words per minute, the tokenizer rule's tokens per word).
4. Duration of a babbling Talker: it has no alignment between frames and text, so nothing it
   reads tells it where the text ends, and its stopping does not follow the rows it reads. It
   ends with a constant per-frame probability ``h = 1 / (R * T)`` (a memoryless hazard), ``T``
   the request's Thinker output length (the ``thinker_result`` rows it was given): its mean
   duration is the time the text takes to speak, with no information about where in the text
   it is. Position ``p``'s draw is a uniform keyed by (seed, request, p), so a never-started
   Talker stops at the same position under any schedule. Grounds: codec EOS (8294) is a token
   the real Talker samples like any other; the seed's author reports that a misconditioned Talker
   "keeps producing audio tokens, but the audio stops corresponding to the intended text", and its
   table's fewer stress events on main suggest shorter generations than the fix's, not runs to the
   1900-token limit (an inference from the table, not a measurement).
5. Sampling: temperature / top-k / top-p over the sim codec vocabulary with a generator seeded
   by (seed, request, position), so identical KV rows give identical tokens under any schedule.

Speed: the logits depend only on the target (noise, silence, or a word's onset / sustain
codes), so each target's filtered distribution is computed once per cell, as its support and
cumulative probabilities. A draw is the inverse CDF at one uniform number keyed by (seed,
request, position): a splitmix64 hash of the request's seed and the position (no generator
object per token), so the same position always gets the same number under any schedule.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np
import torch

from harness.config import PromptSet, SamplingSettings
from harness.sim.codec import CODEC_BOS, CODEC_EOS, CODEC_PAD, NOISE_CODES, SILENCE, WORD_BASE, CodecVocab
from harness.sim.rows import NONE, UNKNOWN, RowSpace, _seed

# Speech class of a registered text row.
WORD, QUIET, END = 0, 1, 2
# Target codes sit at 8, noise codes at 0 as the background the filters cut. Not a knob: any value
# >= 0.9 ln 256 = 4.99 gives the same tokens, since temperature 0.9 and top-p 0.8 then keep only the
# target codes against the 64 noise codes (tests/test_physics.py).
TARGET_LOGIT = 8.0


@dataclass
class TalkerKV:
    request_id: str
    P: int
    spk_id: int  # registry id of the speaker text row
    out0_id: int  # registry id of this request's thinker_result[0]
    capacity: int
    text: torch.Tensor = field(init=False)
    codec: torch.Tensor = field(init=False)
    length: int = 0

    def __post_init__(self) -> None:
        # NumPy arrays for the per-token reads; ``text``/``codec`` are torch views of the same memory.
        self._text_np = np.full(self.capacity, NONE, dtype=np.int64)
        self._codec_np = np.full(self.capacity, NONE, dtype=np.int64)
        self.text = torch.from_numpy(self._text_np)
        self.codec = torch.from_numpy(self._codec_np)
        self._started = False

    def write(self, c: int, text_ids: torch.Tensor, codec_ids: torch.Tensor) -> None:
        n = text_ids.shape[0]
        self._text_np[c:c + n] = _as_np(text_ids)
        self._codec_np[c:c + n] = _as_np(codec_ids)
        old = self.length
        self.length = c + n
        if c < self.P or old < self.P:  # only then can the start rows (P-2, P-1) or length < P change
            self._started = self._check_started()

    def write_one(self, c: int, text_id: int, codec_id: int) -> None:
        """``write`` of a one-position span ``[c, c+1)``, from two ints."""
        self._text_np[c] = text_id
        self._codec_np[c] = codec_id
        old = self.length
        self.length = c + 1
        if c < self.P or old < self.P:
            self._started = self._check_started()

    def _check_started(self) -> bool:
        P, text, codec = self.P, self._text_np, self._codec_np
        return bool(self.length >= P and text[P - 2] == self.spk_id and codec[P - 2] == CODEC_PAD
                    and text[P - 1] == self.out0_id and codec[P - 1] == CODEC_BOS)

    def started(self) -> bool:
        return self._started


def _as_np(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    return ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)


@dataclass(frozen=True)
class _Dist:
    """One target's filtered distribution: its support and cumulative probabilities."""

    codes: tuple[int, ...]  # supported codes, ascending
    cum: list[float]  # cumulative probability after each code (last = 1.0)
    full: torch.Tensor  # the whole filtered vector (tests, inspection)


_NOISE, _SILENCE, _ONSET, _SUSTAIN = 0, 1, 2, 3
_M64 = (1 << 64) - 1
# Filtered distributions by everything they depend on, across cells of one process (bounded).
_DIST_CACHE: dict[tuple, _Dist] = {}
_DIST_CACHE_MAX = 65536


class SimTalker:
    def __init__(self, space: RowSpace, vocab: CodecVocab, sampling: SamplingSettings, frames_per_token: int) -> None:
        self.space, self.vocab, self.sampling, self.R = space, vocab, sampling, frames_per_token
        self.vocab_size = WORD_BASE + 4 * len(vocab.words)
        self._cls_np: np.ndarray | None = None  # speech class of each registered text row (freeze)
        self._word_np = np.zeros(0, dtype=np.int64)
        self._cls: list[int] = []
        self._word: list[int] = []
        self._dists: dict[tuple[int, int], _Dist] = {}
        self._draw_seeds: dict[str, int] = {}  # per request: the key of its sampling uniforms
        self._text_len: dict[str, int] = {}  # T per request: its Thinker output rows (freeze)
        self._end_draws: dict[str, np.ndarray] = {}  # per request: the babble-end uniform of each position

    def freeze(self) -> None:
        """Speech class and word of every registered text row (call once all rows exist)."""
        meanings = self.space.meanings
        cls = torch.full((len(meanings),), QUIET, dtype=torch.long)
        word = torch.full((len(meanings),), -1, dtype=torch.long)
        for i, m in enumerate(meanings):
            if m.kind in ("text_eos", "text_pad"):
                cls[i] = END
            elif m.kind in ("prompt", "output") and m.word is not None:
                w = self.vocab.word_id(m.word)
                if w is not None:
                    cls[i], word[i] = WORD, w
        self._cls_np, self._word_np = cls.numpy(), word.numpy()
        self._cls, self._word = cls.tolist(), word.tolist()  # next_token's per-token reads, as Python ints
        self._text_len = {}
        for m in meanings:
            if m.kind == "output" and m.request is not None:
                self._text_len[m.request] = self._text_len.get(m.request, 0) + 1

    def end_hazard(self, request_id: str) -> float:
        """Rule 4: a babbling Talker's per-frame probability of emitting codec EOS, ``1 / (R * T)``."""
        return 1.0 / (self.R * max(1, self._text_len.get(request_id, 0)))

    def babble_ends_at(self, kv: TalkerKV, generated: int) -> bool:
        """Rule 4's draw at position ``P + generated``: a uniform keyed by (seed, request, position)."""
        draws = self._end_draws.get(kv.request_id)
        position = kv.P + generated
        if draws is None or draws.shape[0] <= position:
            size = max(kv.capacity, position + 1)
            rng = np.random.Generator(np.random.PCG64(_seed(self.sampling.seed, "babble-end", kv.request_id)))
            draws = rng.random(size)  # prefix-consistent: a longer draw starts with the same numbers
            self._end_draws[kv.request_id] = draws
        return bool(draws[position] < self.end_hazard(kv.request_id))

    def next_token(self, kv: TalkerKV, generated: int) -> int:
        assert self._cls_np is not None, "freeze() first"
        if not kv.started():  # rule 4: babble, ended by the memoryless hazard alone
            if self.babble_ends_at(kv, generated):
                return CODEC_EOS
            return self._draw(self._dist((_NOISE, 0)), kv.request_id, kv.P + generated)
        pos = kv.P - 1 + generated // self.R
        tid = int(kv._text_np[pos]) if pos < kv.length else UNKNOWN
        if tid == NONE:
            return CODEC_EOS
        cls = self._cls
        if tid >= 0 and cls[tid] == END:
            return CODEC_EOS
        key = (_NOISE, 0)
        if tid != UNKNOWN:
            if cls[tid] == WORD:
                key = (_ONSET if generated % self.R == 0 else _SUSTAIN, self._word[tid])
            else:
                key = (_SILENCE, 0)
        return self._draw(self._dist(key), kv.request_id, kv.P + generated)

    def _logits(self, key: tuple[int, int]) -> torch.Tensor:
        kind, w = key
        logits = torch.full((self.vocab_size,), float("-inf"))
        logits[1:NOISE_CODES + 1] = 0.0
        if kind == _ONSET:
            logits[self.vocab.onset_codes(w)] = TARGET_LOGIT
        elif kind == _SUSTAIN:
            logits[self.vocab.sustain_codes(w)] = TARGET_LOGIT
        elif kind == _SILENCE:
            logits[SILENCE] = TARGET_LOGIT
        return logits

    def _dist(self, key: tuple[int, int]) -> _Dist:
        dist = self._dists.get(key)
        if dist is None:
            kind, w = key
            targets = (tuple(self.vocab.onset_codes(w)) if kind == _ONSET else
                       tuple(self.vocab.sustain_codes(w)) if kind == _SUSTAIN else (SILENCE,) if kind == _SILENCE else ())
            s = self.sampling
            # The filtered distribution is a function of these alone (``_logits``, ``_filtered``): cells
            # with the same words and sampling share it (a sweep's fifty cells, the main job's four).
            shared = (self.vocab_size, s.temperature, s.top_k, s.top_p, kind, targets)
            dist = _DIST_CACHE.get(shared)
            if dist is None:
                full = self._filtered(self._logits(key)).double()
                codes = torch.nonzero(full).flatten()
                cum = torch.cumsum(full[codes], dim=0)
                cum = (cum / cum[-1]).tolist()
                cum[-1] = 1.0
                dist = _Dist(tuple(int(c) for c in codes), cum, full.float())
                if len(_DIST_CACHE) >= _DIST_CACHE_MAX:
                    _DIST_CACHE.clear()
                _DIST_CACHE[shared] = dist
            self._dists[key] = dist
        return dist

    def _filtered(self, logits: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k, then top-p (smallest set reaching ``top_p``); zeros elsewhere."""
        s = self.sampling
        logits = logits / max(s.temperature, 1e-5)
        if s.top_k and s.top_k > 0:
            kth = torch.topk(logits, min(s.top_k, logits.shape[0])).values[-1]
            logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
        probs = torch.softmax(logits, dim=0)
        order = torch.argsort(probs, descending=True, stable=True)
        cum = torch.cumsum(probs[order], dim=0)
        keep = cum - probs[order] < s.top_p  # smallest set reaching top_p
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = probs[order[keep]]
        return filtered

    def uniform(self, request_id: str, position: int) -> float:
        """The sampling uniform of (seed, request, position), in [0, 1): splitmix64 of the
        request's key plus the position times the golden-ratio increment."""
        base = self._draw_seeds.get(request_id)
        if base is None:
            base = self._draw_seeds[request_id] = _seed(self.sampling.seed, "sample", request_id)
        z = (base + (position + 1) * 0x9E3779B97F4A7C15) & _M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        z ^= z >> 31
        return (z >> 11) * (1.0 / (1 << 53))

    def _draw(self, dist: _Dist, request_id: str, position: int) -> int:
        """One code from ``dist`` at the uniform of (seed, request, position) (inverse CDF)."""
        i = bisect_right(dist.cum, self.uniform(request_id, position))
        return dist.codes[min(i, len(dist.codes) - 1)]


def check_words(prompts: PromptSet) -> None:
    """Each reply's words as the words Talker says them (``harness.tokenizer``) must score WER 0
    against the reply under Whisper's normaliser, else a correct arm is mis-scored (issue 24 case
    14). ``load_prompts`` already refuses the characters known to differ, naming each; this catches
    what only the normaliser's context shows (text in brackets it drops, ...). A reply that
    normalises to no words is left to the run: not measurable, recorded as such."""
    from harness.errors import ConfigError, short_repr
    from harness.audio.scoring import spoken_mismatch
    from harness.tokenizer import is_spoken, tokenize

    for i, prompt in enumerate(prompts.prompts):
        spoken = " ".join(t for t in tokenize(prompt.reply) if is_spoken(t))
        if (bad := spoken_mismatch(prompt.reply, spoken)) is not None:
            ref, said = (_around(words, _first_difference(*(b.split() for b in bad))) for words in bad)
            raise ConfigError(f"{prompts.path}: prompts[{i}].reply: WER scoring reads {short_repr(ref)} where the sim "
                              f"says {short_repr(said)}, so a correct arm would not score 0 (prompt {prompt.id!r}); "
                              "rewrite the reply as plain words")


def _first_difference(a: list[str], b: list[str]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _around(text: str, k: int) -> str:
    """Words ``k - 2`` to ``k + 3`` of ``text``, with '...' where words are left out."""
    words = text.split()
    lo, hi = max(0, k - 2), min(len(words), k + 4)
    return ("... " if lo else "") + " ".join(words[lo:hi]) + (" ..." if hi < len(words) else "")
