"""``omni-stress tiny-model DIR --family qwen3-tts``: a tiny speaking Qwen3-TTS CustomVoice checkpoint, offline
(``--variant base``: the Base checkpoint).

Why: vLLM-Omni 0.30.0's unmodified Qwen3-TTS (Talker with its code predictor, then Code2Wav, the
Qwen3-TTS-Tokenizer-12Hz decoder) then runs on a CPU, in CI, and its Talker says what its rows say
(``harness.families.qwen3_tts.speaking_model``), so the real server's WER means something.

What it is (deterministic in ``seed``; run in the real environment, which has vLLM-Omni's classes):

* ``config.json``: ``Qwen3TTSConfig`` (``tts_model_type: custom_voice``), Talker hidden 64, one
  layer, two heads of 32 (a head size vLLM's CPU attention takes), rope theta 1e6 without M-RoPE;
  text hidden 64; Qwen's text ids for the special tokens; the codec ids of
  ``harness.families.qwen3_tts.speaking`` (Qwen3-TTS's real specials: PAD/BOS/EOS 2148-2150, which
  the release's pipeline stops on); a code predictor of one layer over a 2050-code book
  (``speaking.CODEBOOK``), 16 code groups as the real one; a tiny speaker encoder (CustomVoice never
  runs it, nor does a Base request that gives its speaker embedding).
  ``--variant base`` (``base=True``): ``tts_model_type: base`` and no CustomVoice speakers (``spk_id`` empty), as
  a real Base checkpoint: the server then takes only Base requests, whose voice is a speaker embedding of 64
  values (``speaking_model.base_voice``); the weights are the same.
* ``model.safetensors``: every Talker weight under its HF name (``talker.``), random under
  ``torch.manual_seed(seed)`` and then overwritten by the construction; float32.
* ``speech_tokenizer/``: ``Qwen3TTSTokenizerV2Config`` (a one-layer Mimi encoder, only used for
  reference audio; a decoder of hidden 64 whose upsampling gives the real 1920 samples per frame at
  24 kHz), their random weights (``encoder.``, ``decoder.``) and the Encodec feature extractor.
* a byte-level tokenizer: byte ``b`` is token ``b``; ``<|endoftext|>``, ``<|im_start|>``,
  ``<|im_end|>`` on Qwen's ids 151643-151645, ``assistant`` one token (151646: the release slices
  the role header as three tokens), ``tts_pad``/``tts_bos``/``tts_eos`` on 151671-151673.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.families.qwen3_tts import speaking as sp
from harness.families.qwen3_tts import speaking_model as sm
from harness.speaking.checkpoint import (
    builder_main,
    byte_level_tokenizer,
    folder_bytes,
    fresh_folder,
    needs,
    save_state,
    write_json,
    write_marker,
)
from harness.speaking.weights import byte_chars

LAYERS = 1
INTERMEDIATE = 128
NUM_CODE_GROUPS = 16
INIT_STD = 0.02
SPECIAL_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": sp.IM_START, "<|im_end|>": sp.IM_END,
                  "assistant": sp.ASSISTANT, "<|tts_pad|>": sp.TTS_PAD, "<|tts_text_bos|>": sp.TTS_BOS,
                  "<|tts_text_eod|>": sp.TTS_EOS}


def config_dict(base: bool = False) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (Qwen3TTSConfig's fields); ``base``: the Base variant's."""
    code_predictor = dict(vocab_size=sp.CODEBOOK, hidden_size=sm.HIDDEN, intermediate_size=INTERMEDIATE,
                          num_hidden_layers=LAYERS, num_attention_heads=sm.HEADS, num_key_value_heads=sm.HEADS,
                          head_dim=sm.HEAD_DIM, max_position_embeddings=65536, rope_theta=sm.ROPE_THETA,
                          num_code_groups=NUM_CODE_GROUPS, attention_bias=False, rms_norm_eps=1e-6)
    talker = dict(code_predictor_config=code_predictor, vocab_size=sp.TALKER_VOCAB, hidden_size=sm.HIDDEN,
                  intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=sm.HEADS,
                  num_key_value_heads=sm.HEADS, head_dim=sm.HEAD_DIM, max_position_embeddings=65536,
                  rope_theta=sm.ROPE_THETA, rope_scaling=None, attention_bias=True, rms_norm_eps=1e-6,
                  num_code_groups=NUM_CODE_GROUPS, text_hidden_size=sm.TEXT_HIDDEN, text_vocab_size=sp.TEXT_VOCAB,
                  codec_eos_token_id=sp.CODEC_EOS, codec_think_id=sp.CODEC_THINK, codec_nothink_id=sp.CODEC_NOTHINK,
                  codec_think_bos_id=sp.CODEC_THINK_BOS, codec_think_eos_id=sp.CODEC_THINK_EOS,
                  codec_pad_id=sp.CODEC_PAD, codec_bos_id=sp.CODEC_BOS, spk_id={} if base else dict(sp.SPEAKERS),
                  spk_is_dialect={} if base else {name: False for name in sp.SPEAKERS},
                  codec_language_id={"english": 2160, "chinese": 2161},
                  hidden_act="silu", tie_word_embeddings=False)
    speaker = dict(mel_dim=128, enc_dim=sm.HIDDEN, enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
                   enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=8, enc_se_channels=8,
                   sample_rate=24000)
    return dict(architectures=["Qwen3TTSForConditionalGeneration"], model_type="qwen3_tts", talker_config=talker,
                speaker_encoder_config=speaker, tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="tiny",
                tts_model_type="base" if base else "custom_voice", im_start_token_id=sp.IM_START, im_end_token_id=sp.IM_END,
                tts_pad_token_id=sp.TTS_PAD, tts_bos_token_id=sp.TTS_BOS, tts_eos_token_id=sp.TTS_EOS,
                torch_dtype="float32")


def speech_tokenizer_config() -> dict[str, Any]:
    """``speech_tokenizer/config.json``: 24 kHz in and out, 1920 samples per frame (12.5 Hz), the real 16 codebooks."""
    encoder = dict(sampling_rate=24000, frame_rate=12.5, audio_channels=1, hidden_size=16, num_filters=2,
                   num_residual_layers=1, upsampling_ratios=[8, 6, 5, 4], codebook_size=2048, codebook_dim=16,
                   num_quantizers=NUM_CODE_GROUPS, num_semantic_quantizers=1, vector_quantization_hidden_dimension=16,
                   upsample_groups=16, num_hidden_layers=1, intermediate_size=32, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=8, sliding_window=250, max_position_embeddings=8000)
    decoder = dict(codebook_size=sp.CODEBOOK, codebook_dim=16, hidden_size=sm.HIDDEN, latent_dim=sm.HIDDEN,
                   max_position_embeddings=8000, rope_theta=10000, num_attention_heads=2, num_key_value_heads=2,
                   head_dim=32, attention_bias=False, sliding_window=72, intermediate_size=INTERMEDIATE,
                   hidden_act="silu", num_hidden_layers=1, num_quantizers=NUM_CODE_GROUPS, upsample_rates=[8, 5, 4, 3],
                   upsampling_ratios=[2, 2], decoder_dim=64)
    return dict(model_type="qwen3_tts_tokenizer_12hz", encoder_config=encoder, decoder_config=decoder,
                encoder_valid_num_quantizers=NUM_CODE_GROUPS, input_sample_rate=24000, output_sample_rate=24000,
                decode_upsample_rate=1920, encode_downsample_rate=1920)


def talker_shapes() -> dict[str, tuple[int, ...]]:
    """Every Talker weight the release loads (HF names), with its shape."""
    h, hd, heads, inter = sm.HIDDEN, sm.HEAD_DIM, sm.HEADS, INTERMEDIATE
    out: dict[str, tuple[int, ...]] = {
        "talker.model.codec_embedding.weight": (sp.TALKER_VOCAB, h),
        "talker.model.text_embedding.weight": (sp.TEXT_VOCAB, sm.TEXT_HIDDEN),
        "talker.text_projection.linear_fc1.weight": (sm.TEXT_HIDDEN, sm.TEXT_HIDDEN),
        "talker.text_projection.linear_fc1.bias": (sm.TEXT_HIDDEN,),
        "talker.text_projection.linear_fc2.weight": (h, sm.TEXT_HIDDEN),
        "talker.text_projection.linear_fc2.bias": (h,),
        "talker.model.norm.weight": (h,),
        "talker.codec_head.weight": (sp.TALKER_VOCAB, h),
    }

    def layer(prefix: str, bias: bool) -> None:
        for p in ("q", "k", "v"):
            out[f"{prefix}.self_attn.{p}_proj.weight"] = (heads * hd, h)
            if bias:
                out[f"{prefix}.self_attn.{p}_proj.bias"] = (heads * hd,)
        out[f"{prefix}.self_attn.o_proj.weight"] = (h, heads * hd)
        out[f"{prefix}.self_attn.q_norm.weight"] = (hd,)
        out[f"{prefix}.self_attn.k_norm.weight"] = (hd,)
        out[f"{prefix}.mlp.gate_proj.weight"] = (inter, h)
        out[f"{prefix}.mlp.up_proj.weight"] = (inter, h)
        out[f"{prefix}.mlp.down_proj.weight"] = (h, inter)
        out[f"{prefix}.input_layernorm.weight"] = (h,)
        out[f"{prefix}.post_attention_layernorm.weight"] = (h,)

    for i in range(LAYERS):
        layer(f"talker.model.layers.{i}", bias=True)
        layer(f"talker.code_predictor.model.layers.{i}", bias=False)
    for g in range(NUM_CODE_GROUPS - 1):
        out[f"talker.code_predictor.model.codec_embedding.{g}.weight"] = (sp.CODEBOOK, h)
        out[f"talker.code_predictor.lm_head.{g}.weight"] = (sp.CODEBOOK, h)
    out["talker.code_predictor.model.norm.weight"] = (h,)
    return out


def talker_state(seed: int) -> dict[str, Any]:
    """Random Talker weights (norms 1, the rest N(0, 0.02)) in name order, then the speaking construction."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for name, shape in sorted(talker_shapes().items()):
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        else:
            state[name] = torch.randn(shape, generator=gen) * INIT_STD
    with torch.no_grad():
        sm.apply(state)
    return state


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer (no merges: one token per byte, byte ``b`` = id ``b``) with Qwen's ids."""
    from tokenizers.pre_tokenizers import ByteLevel

    chars = byte_chars()
    if set(chars.values()) != set(ByteLevel.alphabet()):
        raise RuntimeError("tiny tokenizer: the byte-level alphabet is not GPT-2's byte map")
    vocab = {chars[b]: b for b in range(sp.BYTES)}
    by_id = {v: k for k, v in SPECIAL_TOKENS.items()}
    texts = [by_id.get(tid, f"<|tts_unused_{tid}|>") for tid in range(min(by_id), max(by_id) + 1)]
    added = [(text, tid, text != "assistant") for tid, text in enumerate(texts, start=min(by_id))]
    return byte_level_tokenizer(vocab, added, as_special=False, model_max_length=65536)


def build(out: Path, seed: int = 0, base: bool = False) -> dict[str, Any]:
    """Writes the checkpoint into ``out`` (created; must be empty or absent); returns a summary. ``base``: the
    Base variant (``--base``)."""
    out = fresh_folder(out)
    with needs("tiny-model --family qwen3-tts: vLLM-Omni 0.30.0 is needed"):
        import torch
        from transformers import EncodecFeatureExtractor

        from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
            Qwen3TTSTokenizerV2Config,
        )
        from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
            Qwen3TTSTokenizerV2Decoder,
            Qwen3TTSTokenizerV2Encoder,
        )
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config_dict(base))
    state = talker_state(seed)
    save_state(state, out / "model.safetensors")
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    ids = tokenizer("<|im_start|>assistant\nHi.<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    if ids[3:-5] != list(b"Hi.") or len(ids) != 11:
        raise RuntimeError(f"tiny tokenizer: the assistant template tokenizes as {ids}")
    st = out / "speech_tokenizer"
    st.mkdir()
    st_config = speech_tokenizer_config()
    write_json(st / "config.json", st_config)
    cfg = Qwen3TTSTokenizerV2Config(**{k: v for k, v in st_config.items() if k != "model_type"})
    torch.manual_seed(seed + 1)
    encoder = Qwen3TTSTokenizerV2Encoder._from_config(cfg.encoder_config)
    decoder = Qwen3TTSTokenizerV2Decoder._from_config(cfg.decoder_config)
    codec = {f"encoder.{k}": v.detach().float() for k, v in encoder.state_dict().items()}
    codec.update({f"decoder.{k}": v.detach().float() for k, v in decoder.state_dict().items()})
    save_state(codec, st / "model.safetensors")
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000, padding_value=0.0).save_pretrained(st)
    params = sum(int(v.numel()) for v in state.values())
    return write_marker(out, {"path": str(out), "family": "qwen3-tts", "seed": seed, "parameters": params,
                              "bytes": folder_bytes(out), "hidden_size": sm.HIDDEN, "layers": LAYERS,
                              "head_dim": sm.HEAD_DIM, "codebook": sp.CODEBOOK, "speaking": True,
                              **({"variant": "base"} if base else {})})


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.families.qwen3_tts.tiny_model DIR [--seed N] [--base]`` (run by ``omni-stress tiny-model
    --family qwen3-tts [--variant base]`` in the real environment's interpreter)."""
    return builder_main(argv, "python -m harness.families.qwen3_tts.tiny_model", build, flags=("base",))


if __name__ == "__main__":
    raise SystemExit(main())
