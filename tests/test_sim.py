"""The sim backend: vLLM's scheduler driven step by step, rows, the Talker's rules, Code2Wav."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.config import SamplingSettings, load_arms, load_deploy, load_prompts
from harness.sim.steploop import run_cell
from harness.sim.codec import CODEC_EOS, PAUSE, WORD_BASE, CodecVocab, babble_unit, collapse, oracle_transcript
from harness.sim.rows import NONE, TEXT_DIMS, UNKNOWN, RowSpace
from harness.sim.scheduler import make_scheduler, resolve_talker
from harness.sim.talker import SimTalker, TalkerKV

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def prompts():
    return load_prompts(str(DATA / "prompts_e2e.yaml"))


def test_resolve_talker_fills_vllm_defaults():
    ref = resolve_talker(load_deploy("reference"))
    assert (ref.max_num_batched_tokens, ref.max_model_len, ref.num_blocks, ref.enable_chunked_prefill) == \
        (32768, 32768, 4 * 2048 + 1, True)
    stress = resolve_talker(load_deploy("stress"))
    assert (stress.max_num_batched_tokens, stress.max_model_len, stress.num_blocks, stress.block_size) == \
        (32, 1984, 128, 16)


def test_real_vllm_scheduler_reserves_block_zero():
    scheduler, resolved = make_scheduler(load_deploy("stress"))
    assert type(scheduler).__module__ == "vllm.v1.core.sched.scheduler"
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 127
    assert scheduler.scheduler_config.max_num_batched_tokens == 32


def test_rows_identify_exactly():
    space = RowSpace(0)
    rows_a, first_a = space.make("output", ["hello", "world"], "a")
    rows_b, first_b = space.make("output", ["other"], "b")
    codec = space.embed_codec(torch.tensor([5, 8292]))
    mixed = torch.cat([rows_a + codec, rows_b, codec[:1], torch.zeros(1, 64), rows_a[:1] * 0.5])
    text, codec_ids = space.identify(mixed)
    assert text.tolist() == [first_a, first_a + 1, first_b, NONE, NONE, UNKNOWN]
    assert codec_ids.tolist() == [5, 8292, NONE, 5, NONE, NONE]
    again = RowSpace(0)  # rows are deterministic in (seed, request, source, index)
    assert torch.equal(again.make("output", ["hello", "world"], "a")[0][:, 1:TEXT_DIMS], rows_a[:, 1:TEXT_DIMS])


def test_collapse_codes_into_words_pauses_and_babble():
    vocab = CodecVocab.build(["the", "cat", "sat", ","])
    assert vocab.words == ("cat", "sat", "the")
    assert vocab.word_id("The") == vocab.word_id("the") == 2 and vocab.word_id(",") is None
    on = lambda w: WORD_BASE + 4 * vocab.word_id(w)
    codes = [8293, on("the"), on("the") + 2, on("the") + 3, on("cat") + 2, 0, 0, on("cat"), on("cat"),
             5, 6, 7, 8, 9, CODEC_EOS]
    units = collapse(codes, vocab, frames_per_token=4)
    # noise frames: one babble unit per 4 frames, holding its first code and its frame count
    assert units == ["the", "cat", PAUSE, "cat", "cat", babble_unit(5, 4), babble_unit(9, 1)]
    # babble is not words: the oracle transcript holds only what is spoken as words
    assert oracle_transcript(units) == "the cat cat cat"


def _talker(space, words):
    vocab = CodecVocab.build(words)
    t = SimTalker(space, vocab, SamplingSettings(), frames_per_token=2)
    return t, vocab


def test_talker_speaks_aligned_row_and_stops_at_end_of_text():
    space = RowSpace(0)
    from harness.families.qwen2_5_omni.model import SimTalkerModelBase

    model = SimTalkerModelBase(space)
    spk = int(space.identify(model.embed_text_spk_tokens["Chelsie"])[0][0])
    eos = int(space.identify(model.embed_text_eos_token)[0][0])
    _, out0 = space.make("output", ["hi", "there", "."], "r")
    talker, vocab = _talker(space, ["hi", "there"])
    talker.freeze()
    P = 4
    kv = TalkerKV("r", P, spk, out0, 64)
    kv.write(0, torch.tensor([NONE, NONE, spk, out0, out0 + 1, out0 + 2, eos]),
             torch.tensor([NONE, NONE, 8292, 8293, 300, 301, 302]))
    assert kv.started()
    tokens = [talker.next_token(kv, g) for g in range(8)]
    hi, there = vocab.word_id("hi"), vocab.word_id("there")
    assert tokens[0] in vocab.onset_codes(hi) and tokens[1] in vocab.sustain_codes(hi)
    assert tokens[2] in vocab.onset_codes(there) and tokens[3] in vocab.sustain_codes(there)
    assert tokens[4] == tokens[5] == 0  # "." is silence
    assert tokens[6] == CODEC_EOS  # text-EOS at the aligned position
    # same KV, same position -> same token (batch invariance)
    assert [talker.next_token(kv, g) for g in range(8)] == tokens
    # a wrong start row -> babble (noise codes); the end of the text no longer ends it (rule 4)
    kv.write(0, torch.tensor([NONE, NONE, out0, out0, out0 + 1, out0 + 2, eos]),
             torch.tensor([NONE, NONE, 8292, 8293, 300, 301, 302]))
    assert not kv.started()
    babble = [talker.next_token(kv, g) for g in range(7)]
    stop = next(g for g in range(10_000) if talker.babble_ends_at(kv, g))
    assert all(1 <= t <= 64 for t in babble[:min(7, stop)])


def test_scheduler_driver_forces_preemption_and_replays(prompts):
    arms = load_arms()
    deploy = load_deploy(str(DATA / "deploy_tiny_kv.yaml"))
    results = {}
    for arm in ("main", "pr"):
        got = []
        stats = run_cell(arms[arm], deploy, prompts, 1, 42, got.append)
        results[arm] = (stats, {r.record.prompt_id: r.record for r in got})
    pr_stats, pr = results["pr"]
    assert pr_stats.preemptions > 0
    assert sum(s.cross_boundary for s in pr_stats.spans) > 0
    assert sum(s.nonzero_offset for s in pr_stats.spans) > 0
    assert all(s.misaligned == 0 and not s.row_mismatch for s in pr_stats.spans)
    assert set(pr) == {"p01-weather", "p03-sleep", "p05-garden"}
    assert all(r.oracle_wer == 0.0 for r in pr.values())
    main_stats, main = results["main"]
    assert all(s.row_mismatch for s in main_stats.spans if s.c < s.P and s.n != s.P)
    assert sum(s.misaligned for s in main_stats.spans) > 0
    assert all(r.oracle_wer > 0.5 for r in main.values())


def test_specdec_verify_spans_carry_k_plus_one_positions(prompts):
    arms = load_arms()
    specdec, reference = load_deploy("specdec"), load_deploy("reference")
    got: dict[tuple[str, str], dict] = {}
    spans = {}
    for arm in ("main", "pr"):
        for deploy in (reference, specdec):
            recs = []
            stats = run_cell(arms[arm], deploy, prompts, 1, 42, recs.append)
            got[arm, deploy.name] = {r.record.prompt_id: r.record for r in recs}
            spans[arm, deploy.name] = stats.spans
    pr_spans = spans["pr", "specdec"]
    verify = [s for s in pr_spans if s.multi_decode]
    # k = 2 drafts + 1; a drafter that proposes codec EOS stops drafting there (n = 2)
    assert verify and {s.n for s in verify} == {2, 3}
    assert sum(s.n == 3 for s in verify) > sum(s.n == 2 for s in verify)
    assert all(s.misaligned == 0 for s in pr_spans)
    pr_spec, pr_ref = got["pr", "specdec"], got["pr", "reference"]
    assert {k: r.oracle_transcript for k, r in pr_spec.items()} == {k: r.oracle_transcript for k, r in pr_ref.items()}
    assert {k: r.codec_tokens for k, r in pr_spec.items()} == {k: r.codec_tokens for k, r in pr_ref.items()}
    assert all(1.0 < r.accepted_tokens_per_step <= 3.0 for r in pr_spec.values())
    assert all(r.accepted_tokens_per_step is None for r in pr_ref.values())
    # main routes every verify span into its prefill branch (P rows back, prompt rows at decode positions)
    main_verify = [s for s in spans["main", "specdec"] if s.multi_decode]
    assert main_verify and all(s.rows == s.P for s in main_verify)
    assert all(r.oracle_wer > 0.5 for r in got["main", "specdec"].values())


def test_long_input_prompts_expand_audio_placeholders():
    from harness.tokenizer import tokenize

    ps = load_prompts("long_inputs")
    first = ps.prompts[0]
    tokens = tokenize(first.thinker_prompt(ps.system_prompt))
    assert first.audio_seconds == 8
    assert tokens.count("<|AUDIO|>") == 200 and tokens.count("<|audio_bos|>") == 1
    plain = tokenize(ps.prompts[0].__class__(first.id, first.user, first.reply).thinker_prompt(ps.system_prompt))
    assert len(tokens) == len(plain) + 202


def test_runner_expected_ids_follow_the_contract_on_every_span():
    """The runner's array form of the expected rows names, position for position, the row
    ``contract.expected_rows`` names: prompt rows, speaker/PAD, thinker_result[0]/BOS, reply,
    text-EOS, then text-PAD for every later position."""
    from types import SimpleNamespace

    import numpy as np

    from harness.families.qwen2_5_omni.contract import expected_rows
    from harness.families.qwen2_5_omni.sim import SimContract
    from harness.sim.codec import CODEC_BOS, CODEC_PAD

    runner = SimContract.__new__(SimContract)
    runner.eos_id, runner.pad_id = 900, 901
    P, T = 7, 4  # Talker prompt of 7 rows, 4 Thinker output tokens
    out = SimpleNamespace(P=P, output_rows=torch.zeros(T, 1), prompt_first_id=100, output_first_id=200)
    kv = SimpleNamespace(spk_id=50)
    want_text = {"reply": lambda k: 201 + k, "text_eos": lambda k: 900, "text_pad": lambda k: 901}
    for c in range(0, 14):
        for n in range(1, 6):
            span_ids = np.arange(5000 + c, 5000 + c + n)
            text, codec = runner.expected_ids(kv, out, span_ids, c, n)
            for i, ref in enumerate(expected_rows(P, c, n, T)):
                if ref.source == "prompt":
                    exp = ((100 + ref.index, NONE) if ref.index < P - 2 else (50, CODEC_PAD) if ref.index == P - 2
                           else (200, CODEC_BOS))
                else:
                    exp = (want_text[ref.source](ref.index), 5000 + c + i)
                assert (int(text[i]), int(codec[i])) == exp, (c, n, i, ref)


def test_filtered_distributions_are_shared_across_cells_only_when_everything_they_depend_on_matches():
    """Two cells' Talkers with the same words and sampling reuse one distribution (the sweep's cells);
    another temperature or another word's codes is another distribution, computed afresh."""
    from harness.sim import talker as talker_mod

    talker_mod._DIST_CACHE.clear()
    a, vocab = _talker(RowSpace(0), ["hi", "there"])
    b, _ = _talker(RowSpace(1), ["hi", "there"])
    hi, there = vocab.word_id("hi"), vocab.word_id("there")
    first = a._dist((talker_mod._ONSET, hi))
    assert b._dist((talker_mod._ONSET, hi)) is first
    assert len(talker_mod._DIST_CACHE) == 1
    other_word = b._dist((talker_mod._ONSET, there))
    assert other_word is not first and other_word.codes != first.codes
    warm = SimTalker(RowSpace(0), vocab, SamplingSettings(temperature=0.5), frames_per_token=2)
    assert warm._dist((talker_mod._ONSET, hi)) is not first
    assert len(talker_mod._DIST_CACHE) == 3
    # the shared one is the one a fresh computation gives
    talker_mod._DIST_CACHE.clear()
    fresh = _talker(RowSpace(2), ["hi", "there"])[0]._dist((talker_mod._ONSET, hi))
    assert fresh.codes == first.codes and fresh.cum == first.cum and torch.equal(fresh.full, first.full)
