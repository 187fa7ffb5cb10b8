"""Issue 13: the sim's constants come from physics, and a babbling Talker's rules are exact.

* R (codec frames per text token) is recomputed from its sources: the codec frame rate in
  Qwen2.5-Omni's config, the TTS voice's speaking rate, the tokenizer rule on the prompt set;
  the README states the same derivation and the same numbers.
* A Talker that never received its start rows stops where its own (seed, request, position)
  draws say, whatever the schedule wrote into its KV, with mean duration R * T.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from harness.config import SamplingSettings, SimSettings, load_prompts
from harness import physics
from harness.sim.codec import CODEC_BOS, CODEC_EOS, CODEC_PAD, NOISE_CODES, CodecVocab
from harness.sim.rows import NONE, RowSpace
from harness.sim.talker import SimTalker, TalkerKV
from harness.tokenizer import is_spoken, tokenize

ROOT = Path(__file__).resolve().parent.parent


def test_frames_per_text_token_derivation():
    replies = [p.reply for p in load_prompts("default").prompts]
    tokens = [t for r in replies for t in tokenize(r)]
    words = [t for t in tokens if is_spoken(t)]
    assert (physics.REPLY_TOKENS, physics.REPLY_WORDS) == (len(tokens), len(words))
    exact = physics.CODEC_FRAME_RATE_HZ * 60 / (physics.SPEAKING_RATE_WPM * len(tokens) / len(words))
    assert physics.FRAMES_PER_TEXT_TOKEN == round(exact) == 19
    assert SimSettings().frames_per_text_token == physics.FRAMES_PER_TEXT_TOKEN  # the sim's default R


def test_tts_speaks_at_the_rate_r_is_derived_from():
    from harness.audio.tts import DEFAULT_VOICE, SAMPLE_RATE

    assert DEFAULT_VOICE.rate == physics.SPEAKING_RATE_WPM
    assert SAMPLE_RATE == physics.CODE2WAV_SAMPLE_RATE


def test_codec_frame_rate_matches_qwen2_5_omni_config():
    cfg = pytest.importorskip("transformers.models.qwen2_5_omni.configuration_qwen2_5_omni")
    dit, bigvgan = cfg.Qwen2_5OmniDiTConfig(), cfg.Qwen2_5OmniBigVGANConfig()
    assert dit.repeats == physics.MEL_REPEATS
    assert tuple(bigvgan.upsample_rates) == physics.BIGVGAN_UPSAMPLE
    samples_per_frame = physics.MEL_REPEATS * int(np.prod(bigvgan.upsample_rates))
    assert physics.CODE2WAV_SAMPLE_RATE / samples_per_frame == physics.CODEC_FRAME_RATE_HZ == 50


def test_the_simulation_doc_states_the_code_derivation():
    readme = (ROOT / "docs" / "simulation.md").read_text()
    p = physics
    line = (f"R = {p.CODEC_FRAME_RATE_HZ} * 60 / ({p.SPEAKING_RATE_WPM} * {p.REPLY_TOKENS}/{p.REPLY_WORDS}) = "
            f"{p.CODEC_FRAME_RATE_HZ * 60 / (p.SPEAKING_RATE_WPM * p.TOKENS_PER_WORD):.2f} -> {p.FRAMES_PER_TEXT_TOKEN}")
    assert line in readme
    from harness.audio import tts

    for name in ("BABBLE_F0_HZ", "BABBLE_VOICING", "BABBLE_RMS", "BABBLE_PULSE_DECAY", "BABBLE_F2_GAIN"):
        assert f"`{name} = {getattr(tts, name)}`" in readme, name  # every Code2Wav knob is listed
    assert f"`NOISE_CODES = {NOISE_CODES}`" in readme


# --------------------------------------------------------------------------- babble duration


def _setup(T: int = 30, R: int = 19):
    space = RowSpace(0)
    from harness.families.qwen2_5_omni.model import SimTalkerModelBase

    model = SimTalkerModelBase(space)
    spk = int(space.identify(model.embed_text_spk_tokens["Chelsie"])[0][0])
    words = [f"w{i}" for i in range(T)]
    _, prompt0 = space.make("prompt", words[:8], "r")
    _, out0 = space.make("output", words, "r")
    talker = SimTalker(space, CodecVocab.build(words), SamplingSettings(), frames_per_token=R)
    talker.freeze()
    return talker, spk, prompt0, out0


def _run_until_eos(talker, kv, limit=1900):
    tokens = []
    for g in range(limit):
        tokens.append(talker.next_token(kv, g))
        if tokens[-1] == CODEC_EOS:
            break
    return tokens


def test_babble_hazard_is_one_over_r_times_t():
    talker, *_ = _setup(T=30, R=19)
    assert talker.end_hazard("r") == pytest.approx(1 / (19 * 30))


def test_never_started_talker_stops_at_the_same_position_under_any_schedule():
    """Whatever rows a schedule leaves in the KV (prompt rows from row 0 as main's chunks give,
    zeros as 0.30.0's empty queue gives, a replay's rows), a never-started Talker emits the same
    tokens and stops at the first position whose draw falls under the hazard."""
    talker, spk, prompt0, out0 = _setup()
    P = 8
    kvs = []
    for variant in range(4):
        kv = TalkerKV("r", P, spk, out0, 2100)
        if variant == 0:  # chunked prefill from row 0: positions P-2, P-1 get prompt rows 6, 7
            kv.write(0, torch.arange(prompt0, prompt0 + P), torch.full((P,), CODEC_PAD))
        elif variant == 1:  # prompt rows, then zero text rows (no text component) at every later position
            kv.write(0, torch.arange(prompt0, prompt0 + P), torch.full((P,), CODEC_PAD))
            kv.write(P, torch.full((1500,), NONE), torch.full((1500,), 5))
        elif variant == 2:  # speaker row at P-2 but the wrong reply row at P-1, then the text-EOS region
            kv.write(0, torch.tensor([NONE] * (P - 2) + [spk, out0 + 3]),
                     torch.tensor([NONE] * (P - 2) + [CODEC_PAD, CODEC_BOS]))
        else:  # a replay: the reply rows at their positions, but still no start rows
            kv.write(0, torch.arange(prompt0, prompt0 + P), torch.full((P,), CODEC_PAD))
            kv.write(P, torch.arange(out0 + 1, out0 + 30), torch.full((29,), 7))
        assert not kv.started()
        kvs.append(kv)
    runs = [_run_until_eos(talker, kv) for kv in kvs]
    assert all(r == runs[0] for r in runs)
    stop = next(g for g in range(1900) if talker.babble_ends_at(kvs[0], g))
    assert runs[0][-1] == CODEC_EOS and len(runs[0]) == stop + 1
    assert all(1 <= t <= NOISE_CODES for t in runs[0][:-1])
    # the draw is keyed by position only: another Talker object (another cell) draws the same
    again, *_ = _setup()
    assert _run_until_eos(again, kvs[1]) == runs[0]


def test_babble_duration_has_mean_r_times_t():
    """Memoryless: over many requests the stop has the geometric law with mean ~ R * T."""
    talker, spk, prompt0, out0 = _setup(T=20, R=19)
    stops = []
    for i in range(400):
        kv = TalkerKV(f"q{i}", 8, spk, out0, 4000)
        talker._text_len[f"q{i}"] = 20
        stops.append(next(g for g in range(4000) if talker.babble_ends_at(kv, g)))
    mean = float(np.mean(stops))
    assert 0.85 * 380 < mean < 1.15 * 380
    # memoryless: the chance of going 380 more frames is the same from 0 and from 380
    p0 = np.mean(np.array(stops) >= 380)
    p1 = np.mean(np.array(stops) >= 760) / p0
    assert abs(p0 - p1) < 0.1 and abs(p0 - np.exp(-1)) < 0.07


def test_started_talker_is_not_cut_by_the_hazard():
    talker, spk, prompt0, out0 = _setup(T=30)
    P = 8
    kv = TalkerKV("r", P, spk, out0, 2100)
    kv.write(0, torch.tensor([NONE] * (P - 2) + [spk, out0]), torch.tensor([NONE] * (P - 2) + [CODEC_PAD, CODEC_BOS]))
    kv.write(P, torch.arange(out0 + 1, out0 + 30), torch.full((29,), 7))
    assert kv.started()
    # it speaks for R frames per reply token read; at position P-1+30 the KV holds nothing -> noise,
    # never EOS from the babble draw (a started Talker ends only at the end of its text)
    tokens = [talker.next_token(kv, g) for g in range(19 * 30)]
    assert CODEC_EOS not in tokens


def test_target_logit_is_not_a_knob(monkeypatch: pytest.MonkeyPatch):
    """Any target logit >= 0.9 ln 256 = 4.99 gives the same distributions (targets only) under the
    seed's sampling, hence the same tokens: the README's claim about TARGET_LOGIT."""
    from harness.sim import talker as talker_mod

    assert 0.9 * np.log(256) < 5.0 <= talker_mod.TARGET_LOGIT
    seen = []
    for logit in (5.0, talker_mod.TARGET_LOGIT, 30.0):
        monkeypatch.setattr(talker_mod, "TARGET_LOGIT", logit)
        talker, *_ = _setup()
        dists = [talker._dist(key) for key in ((1, 0), (2, 3), (3, 3))]  # silence, onset, sustain
        seen.append([(d.codes, [round(c, 12) for c in d.cum]) for d in dists])
    assert seen[0] == seen[1] == seen[2]
    assert [len(codes) for codes, _ in seen[0]] == [1, 2, 2]
