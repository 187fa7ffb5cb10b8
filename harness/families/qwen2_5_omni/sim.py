"""Qwen2.5-Omni on the sim: the cell its prompt set makes, and its contract over row identities.

``build_cell`` is what ``run_cell`` (``harness.sim.steploop``) did before the family seam, moved here
unchanged: the scripted Thinker's outputs (word tokens for the ``words`` Talker, bytes for the
``speaking`` Talker), the arm bound onto the Qwen2.5-Omni stand-in model, the Talker, and how a
codec stream reads back as words. ``check_prompts`` refuses, before a run, a reply the ``words`` Talker would say so that Whisper's
normaliser mis-scores it. ``SimContract`` is the runner's array form of
``harness.families.qwen2_5_omni.contract.expected_rows`` (a Python loop over RowRefs cost more than
the arm itself).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from harness.config import Deploy, PromptSet, SamplingSettings
from harness.contract import misaligned_regions
from harness.errors import UserError
from harness.sim.cell import SimCell
from harness.sim.codec import CODEC_BOS, CODEC_EOS, CODEC_PAD, CodecVocab, collapse, oracle_transcript
from harness.families.qwen2_5_omni.model import VOICE, bind_arm
from harness.sim.rows import NONE, RowSpace
from harness.sim.talker import TalkerKV, check_words
from harness.families.qwen2_5_omni.thinker import ThinkerOutput, run_thinker, token_id_table


def build_cell(impl: Any, deploy: Deploy, prompts: PromptSet, seed: int, talker_mode: str) -> SimCell:
    """``talker_mode``: ``words`` (the sim's own Talker, ``harness/sim/talker.py``) or ``speaking``
    (the speaking tiny model's rules and tokenizer, ``harness/sim/speaking_talker.py``)."""
    space = RowSpace(seed)
    model = bind_arm(impl, space)
    frames = deploy.sim.frames_per_text_token
    if talker_mode == "speaking":
        from harness.sim.speaking_talker import SpeakingKV, speaking_parts
        from harness.families.qwen2_5_omni import speaking
        from harness.tokenizer import byte_tokenize

        outputs = run_thinker(prompts, space, deploy.sim.thinker_steps_per_token, byte_tokenize,
                              deploy.thinker.max_num_seqs)
        # the speaking model's oracle: its codec stream read back through the table
        talker, speak = speaking_parts(space, speaking, frames, byte_kinds=("prompt", "output"))
        kv_class: type[TalkerKV] = SpeakingKV
    elif talker_mode == "words":
        from harness.sim.talker import SimTalker

        outputs = run_thinker(prompts, space, deploy.sim.thinker_steps_per_token,
                              thinker_seqs=deploy.thinker.max_num_seqs)
        vocab = CodecVocab.build(t for o in outputs for t in o.prompt_tokens + o.reply_tokens)
        sampling = SamplingSettings(**{**deploy.sampling.__dict__, "seed": seed})
        talker = SimTalker(space, vocab, sampling, frames)
        talker.freeze()
        kv_class = TalkerKV

        def speak(codes: list[int]) -> tuple[list[int], str, list[str]]:
            units = collapse(codes, vocab, frames)
            return codes, oracle_transcript(units), units
    else:
        raise UserError(f"--sim-talker {talker_mode!r}: unknown sim Talker (choose words or speaking)")
    token_ids = token_id_table(outputs)
    return SimCell(requests=outputs, token_ids=token_ids, space=space, model=model, talker=talker,
                   contract=SimContract(model, space, kv_class), stop_token_ids=[CODEC_EOS], speak=speak)


class SimContract:
    """Qwen2.5-Omni's expected rows as (text id, codec id) identities, and the KV the Talker reads."""

    def __init__(self, model: Any, space: RowSpace, kv_class: type[TalkerKV] = TalkerKV) -> None:
        self.kv_class = kv_class
        self.spk_id = int(space.identify(model.embed_text_spk_tokens[VOICE])[0][0])
        self.eos_id = int(space.identify(model.embed_text_eos_token)[0][0])
        self.pad_id = int(space.identify(model.embed_text_pad_token)[0][0])

    def text_len(self, out: ThinkerOutput) -> int:
        """``len(thinker_result[1:])``: the reply rows after the prompt before text-EOS (``misaligned_regions``)."""
        return out.output_rows.shape[0] - 1

    def new_kv(self, out: ThinkerOutput, capacity: int) -> TalkerKV:
        return self.kv_class(out.request_id, out.P, self.spk_id, out.output_first_id, capacity)

    def misaligned_one(self, kv: TalkerKV, out: ThinkerOutput, span_id: int, c: int, t_id: int,
                       k_id: int) -> tuple[int, int]:
        """``misaligned`` of a one-position span, in scalars (``expected_ids`` of that position)."""
        eos_k = out.output_rows.shape[0] - 1  # len(thinker_result[1:])
        P = out.P
        if c >= P:  # a decode position
            k = c - P
            want = out.output_first_id + 1 + k if k < eos_k else self.eos_id if k == eos_k else self.pad_id
            bad = int(t_id != want or k_id != span_id)
            return (bad, 0) if k <= eos_k else (0, bad)
        exp_text, exp_codec = self.expected_ids(kv, out, np.array((span_id,), dtype=np.int64), c, 1)
        bad = int(int(exp_text[0]) != t_id or int(exp_codec[0]) != k_id)
        return (bad, 0) if c < P + eos_k + 1 else (0, bad)

    def misaligned(self, kv: TalkerKV, out: ThinkerOutput, span_ids: np.ndarray, c: int, n: int,
                   text_ids: np.ndarray, codec_ids: np.ndarray) -> tuple[int, int]:
        """Positions whose row differs from the contract's expected row (exact, by identity), as
        (text region, end region) counts (``contract.misaligned_regions``)."""
        eos_k = out.output_rows.shape[0] - 1  # len(thinker_result[1:])
        exp_text, exp_codec = self.expected_ids(kv, out, span_ids, c, n)
        wrong = (exp_text != text_ids) | (exp_codec != codec_ids)
        return misaligned_regions(np.flatnonzero(wrong) + c, out.P, eos_k)

    def expected_ids(self, kv: TalkerKV, out: ThinkerOutput, span_ids: np.ndarray, c: int,
                     n: int) -> tuple[np.ndarray, np.ndarray]:
        """(text id, codec id) the contract names for each position of the span: prompt rows
        ``p < P-2``, speaker + codec-PAD at ``P-2``, ``thinker_result[0]`` + codec-BOS at ``P-1``,
        then ``reply[k]`` / text-EOS / text-PAD on the position's own codec id."""
        P, Pt, eos_k = out.P, out.P - 2, out.output_rows.shape[0] - 1
        p = np.arange(c, c + n)
        k = p - P
        exp_text = np.select(
            [p < Pt, p == Pt, k < 0, k < eos_k, k == eos_k],
            [out.prompt_first_id + p, kv.spk_id, out.output_first_id, out.output_first_id + 1 + k, self.eos_id],
            self.pad_id)
        exp_codec = np.where(p < Pt, NONE, np.where(p == Pt, CODEC_PAD, CODEC_BOS))
        return exp_text, np.where(k >= 0, span_ids, exp_codec)


def check_prompts(prompts: PromptSet, talker_mode: str) -> None:
    """``words``: each reply as the words Talker says it must score WER 0 (``harness.sim.talker.check_words``).
    The ``speaking`` Talker says each reply byte for byte: nothing to check."""
    if talker_mode == "words":
        check_words(prompts)
