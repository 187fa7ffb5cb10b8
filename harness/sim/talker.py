"""The simulated Talker: its speech depends only on the rows in its per-request KV.

Rules (arm-agnostic; README "How the simulation works"):

1. KV: writing a span ``[c, c+n)`` stores the identified input row of each position and
   truncates the KV at ``c+n``; a preempted request's replay starts again at ``c = 0``, so
   its KV is rebuilt from whatever the replay supplies.
2. Start rows: the Talker speaks only if position ``P-2`` holds this request's speaker row +
   codec-PAD and ``P-1`` holds this request's ``thinker_result[0]`` + codec-BOS. Otherwise it
   babbles (noise codes).
3. Alignment: the codec token at generated count ``g`` speaks the text of the row at position
   ``P - 1 + floor(g / R)`` (where, correctly conditioned, reply token ``floor(g / R)`` sits).
   A Thinker row speaks its word (a prompt row the prompt's word, another request's row that
   request's word); punctuation, template tokens and the speaker/BOS rows are silence; an
   unidentifiable text component is noise; the end of the text (text-EOS, text-PAD, or a row
   with no text component) makes it emit codec EOS, which ends the request.
4. Sampling: temperature / top-k / top-p over the sim codec vocabulary with a generator seeded
   by (seed, request, position), so identical KV rows give identical tokens under any schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.config import SamplingSettings
from harness.sim.codec import CODEC_BOS, CODEC_EOS, CODEC_PAD, NOISE_CODES, SILENCE, WORD_BASE, CodecVocab
from harness.sim.rows import NONE, UNKNOWN, RowSpace, _seed

# Speech class of a registered text row.
WORD, QUIET, END = 0, 1, 2
TARGET_LOGIT = 8.0  # target codes; noise codes sit at 0 as the background the filters cut


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
        self.text = torch.full((self.capacity,), NONE, dtype=torch.long)
        self.codec = torch.full((self.capacity,), NONE, dtype=torch.long)

    def write(self, c: int, text_ids: torch.Tensor, codec_ids: torch.Tensor) -> None:
        n = text_ids.shape[0]
        self.text[c:c + n] = text_ids
        self.codec[c:c + n] = codec_ids
        self.length = c + n

    def started(self) -> bool:
        P = self.P
        return bool(self.length >= P and self.text[P - 2] == self.spk_id and self.codec[P - 2] == CODEC_PAD
                    and self.text[P - 1] == self.out0_id and self.codec[P - 1] == CODEC_BOS)


class SimTalker:
    def __init__(self, space: RowSpace, vocab: CodecVocab, sampling: SamplingSettings, frames_per_token: int) -> None:
        self.space, self.vocab, self.sampling, self.R = space, vocab, sampling, frames_per_token
        self.vocab_size = WORD_BASE + 4 * len(vocab.words)
        self._classes: tuple[torch.Tensor, torch.Tensor] | None = None

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
        self._classes = (cls, word)

    def next_token(self, kv: TalkerKV, generated: int) -> int:
        assert self._classes is not None, "freeze() first"
        pos = kv.P - 1 + generated // self.R
        tid = int(kv.text[pos]) if pos < kv.length else UNKNOWN
        if tid == NONE:
            return CODEC_EOS
        cls, word = self._classes
        if tid >= 0 and cls[tid] == END:
            return CODEC_EOS
        logits = torch.full((self.vocab_size,), float("-inf"))
        logits[1:NOISE_CODES + 1] = 0.0
        if kv.started() and tid != UNKNOWN:
            if cls[tid] == WORD:
                w = int(word[tid])
                codes = self.vocab.onset_codes(w) if generated % self.R == 0 else self.vocab.sustain_codes(w)
                logits[codes] = TARGET_LOGIT
            else:
                logits[SILENCE] = TARGET_LOGIT
        return self._sample(logits, kv.request_id, kv.P + generated)

    def _sample(self, logits: torch.Tensor, request_id: str, position: int) -> int:
        s = self.sampling
        gen = torch.Generator().manual_seed(_seed(s.seed, request_id, position))
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
        return int(torch.multinomial(filtered, 1, generator=gen))
