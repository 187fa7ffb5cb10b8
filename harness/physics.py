"""Every number the simulated Talker and Code2Wav rules use, with where it comes from.

Nothing here was chosen by looking at the seed's table; each constant is either a property of
Qwen2.5-Omni (its released config), a property of the sim's own TTS voice, or a count of the
sim's own tokenizer rule on the shipped prompt set. docs/simulation.md repeats
the derivations and ``tests/test_physics.py`` recomputes them from the code.

Speaking rate R (codec frames per text token)::

    R = CODEC_FRAME_RATE_HZ * 60 / (SPEAKING_RATE_WPM * TOKENS_PER_WORD)
      = 50 * 60 / (140 * 1011/903) = 19.14  ->  19

A correctly conditioned Talker holds each text token for R codec frames, so a reply of T
tokens lasts R * T frames = R * T / 50 s, the time the sim's TTS needs to say its words at
140 words per minute.
"""

from __future__ import annotations

import math

# Qwen2.5-Omni's codec runs at 50 frames per second. Source: Hugging Face transformers,
# models/qwen2_5_omni/configuration_qwen2_5_omni.py: the Token2Wav DiT repeats each codec
# token into ``repeats = 2`` mel frames, and BigVGAN upsamples each mel frame by
# 5*3*2*2*2*2 = 240 samples at 24 kHz (100 mel frames/s), so 100 / 2 = 50 codec frames/s.
# The seed's author says the same ("one 50 Hz audio frame per token").
CODEC_FRAME_RATE_HZ = 50
CODE2WAV_SAMPLE_RATE = 24_000  # BigVGAN output rate, same config file
MEL_REPEATS = 2  # Qwen2_5OmniDiTConfig.repeats
BIGVGAN_UPSAMPLE = (5, 3, 2, 2, 2, 2)  # Qwen2_5OmniBigVGANConfig.upsample_rates
assert CODE2WAV_SAMPLE_RATE == CODEC_FRAME_RATE_HZ * MEL_REPEATS * math.prod(BIGVGAN_UPSAMPLE)

# The sim's TTS voice speaks 140 words per minute (espeak-ng ``rate``; harness.audio.tts.Voice
# takes it from here). It was chosen for Whisper round trips with bench/asr.py (docs/audio.md),
# before and independently of this derivation.
SPEAKING_RATE_WPM = 140

# Tokens per spoken word under the sim's tokenizer rule (harness/tokenizer.py: a word, a
# punctuation mark and a newline are one token each), counted on the 16 replies of
# prompts/default.yaml: 1011 tokens, 903 words. Punctuation tokens take their share of the
# speaking time as silence frames.
REPLY_TOKENS, REPLY_WORDS = 1011, 903
TOKENS_PER_WORD = REPLY_TOKENS / REPLY_WORDS

FRAMES_PER_TEXT_TOKEN = round(CODEC_FRAME_RATE_HZ * 60 / (SPEAKING_RATE_WPM * TOKENS_PER_WORD))  # R = 19

# Qwen3-TTS's codec (Qwen3-TTS-Tokenizer-12Hz) runs at 12.5 frames per second. Source: vLLM-Omni
# 0.30.0, models/qwen3_tts/tokenizer_12hz/configuration_qwen3_tts_tokenizer_v2.py: output_sample_rate
# 24000 and decode_upsample_rate 1920 samples per codec frame, 24000 / 1920 = 12.5.
QWEN3_TTS_SAMPLE_RATE, QWEN3_TTS_UPSAMPLE = 24_000, 1920
QWEN3_TTS_FRAME_RATE_HZ = QWEN3_TTS_SAMPLE_RATE / QWEN3_TTS_UPSAMPLE  # 12.5
# The same speaking rate and tokenizer rule: R = 12.5 * 60 / (140 * 1011/903) = 4.79 -> 5 frames per text token.
QWEN3_TTS_FRAMES_PER_TEXT_TOKEN = round(QWEN3_TTS_FRAME_RATE_HZ * 60 / (SPEAKING_RATE_WPM * TOKENS_PER_WORD))  # R = 5
