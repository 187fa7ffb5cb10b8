"""``omni-stress tiny-model DIR``: a tiny, randomly initialised Qwen2.5-Omni checkpoint, built offline.

Why: the real backend's whole path (``vllm serve --omni``, its three stages, vLLM-Omni's runner and
scheduler, this package's plugins) can then run on a CPU, in CI, with nothing downloaded. Random
weights make the speech meaningless, but not the spans, events and misaligned positions the trace
records: those depend on the scheduler and the arm, not on what the weights say.

What it is (deterministic in ``seed``):

* transformers' ``Qwen2_5OmniConfig`` with every stack shrunk (hidden size 64, 2 layers, head size
  32, a one-layer audio and vision encoder, a two-layer DiT and a small BigVGAN), but Qwen's real
  152,064-token vocabulary, the Talker's 8,448-token codec vocabulary and every special token id
  (text BOS/EOS/PAD 151860/151861/151859, codec PAD/BOS/EOS/mask 8292/8293/8294/8296), so
  vLLM-Omni's ``thinker2talker`` and ``talker_preprocess`` see the ids they see on the real model;
  head size 32 because vLLM's CPU attention takes only some head sizes (32, 64, 80, ...);
* random weights from the model class's ``_from_config`` under ``torch.manual_seed(seed)``, saved
  as float32 safetensors;
* a byte-level BPE tokenizer (``tokenizers``; no merges, so one token per byte) whose vocabulary is
  padded so that Qwen's special tokens land on their real ids (151643 onward);
* Qwen2.5-Omni's processor (Whisper feature extractor, Qwen2-VL image/video processors, a ChatML
  chat template) and a ``spk_dict.pt`` with the two voices vLLM-Omni knows (Chelsie, Ethan).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.speaking.checkpoint import (
    builder_main,
    byte_level_tokenizer,
    folder_bytes,
    fresh_folder,
    needs,
    write_marker,
)

HIDDEN = 64
HEAD_DIM = 32
LAYERS = 2
VOCAB = 152064
# Qwen2.5-Omni's added tokens and their ids (its tokenizer_config.json)
SPECIAL_TOKENS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|AUDIO|>": 151646,
    "<|audio_bos|>": 151647, "<|audio_eos|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_bos|>": 151652, "<|vision_eos|>": 151653, "<|vision_pad|>": 151654,
    "<|IMAGE|>": 151655, "<|VIDEO|>": 151656,
}
# what Qwen2.5-Omni's processor reads off its tokenizer (``tokenizer.image_token``, ...)
EXTRA_SPECIAL_TOKENS = {
    "image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
}
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
    "<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'text' %}{{ content['text'] }}"
    "{% elif content['type'] == 'audio' or content['type'] == 'audio_url' or 'audio' in content %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'image' or content['type'] == 'image_url' or 'image' in content %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'video' or content['type'] == 'video_url' or 'video' in content %}"
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}  # sums to HEAD_DIM / 2


def tiny_config() -> object:
    from transformers import Qwen2_5OmniConfig

    text = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HIDDEN // HEAD_DIM, num_key_value_heads=HIDDEN // HEAD_DIM,
                max_position_embeddings=32768, max_window_layers=LAYERS, rope_parameters=dict(ROPE),
                tie_word_embeddings=False)
    thinker = dict(
        text_config=text,
        audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=2 * HIDDEN,
                          d_model=HIDDEN, output_dim=HIDDEN, max_source_positions=1500, n_window=100),
        vision_config=dict(depth=1, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_heads=2,
                           out_hidden_size=HIDDEN, fullatt_block_indexes=[0]),
    )
    talker = dict(vocab_size=8448, embedding_size=HIDDEN, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                  num_hidden_layers=LAYERS, num_attention_heads=HIDDEN // HEAD_DIM,
                  num_key_value_heads=HIDDEN // HEAD_DIM, head_dim=HEAD_DIM, max_window_layers=LAYERS,
                  max_position_embeddings=32768, rope_parameters=dict(ROPE))
    token2wav = dict(
        dit_config=dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, head_dim=HEAD_DIM, ff_mult=2,
                        emb_dim=32, enc_emb_dim=32, enc_dim=32, enc_channels=[32, 32, 32, 32, 96],
                        enc_attention_channels=16, enc_se_channels=16, look_ahead_layers=[1],
                        look_backward_layers=[0, 1], mel_dim=80, num_embeds=8193, block_size=24, repeats=2),
        # BigVGAN halves its channels at each of its 6 upsampling stages: 128 leaves 2 at the end
        bigvgan_config=dict(mel_dim=80, upsample_initial_channel=128, resblock_kernel_sizes=[3],
                            resblock_dilation_sizes=[[1, 3, 5]]),
    )
    config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, token2wav_config=token2wav,
                               enable_audio_output=True)
    # read by vLLM-Omni's Qwen2.5-Omni for M-RoPE positions (qwen2_5_omni.py:451-452); the real
    # checkpoint's thinker config carries them, transformers' class does not
    config.thinker_config.vision_start_token_id = SPECIAL_TOKENS["<|vision_bos|>"]
    config.thinker_config.vision_end_token_id = SPECIAL_TOKENS["<|vision_eos|>"]
    config.torch_dtype = "float32"
    return config


def build_tokenizer(out: Path) -> object:
    """A byte-level BPE tokenizer with Qwen's special tokens on their real ids."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    added = [(text, want, True) for text, want in sorted(SPECIAL_TOKENS.items(), key=lambda kv: kv[1])]
    fast = byte_level_tokenizer(vocab, added, as_special=True, model_max_length=32768,
                                extra_special_tokens=EXTRA_SPECIAL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out: Path, seed: int = 0, speaking: bool = False) -> dict[str, Any]:
    """Writes the checkpoint into ``out`` (created; must be empty or absent); returns a summary.

    ``speaking``: the Thinker and Talker weights of ``harness.families.qwen2_5_omni.speaking_model`` replace the
    random ones (the audio encoders, vision encoder and Code2Wav stay random)."""
    out = fresh_folder(out)
    with needs("tiny-model: transformers with Qwen2.5-Omni is needed"):
        import torch
        from transformers import (
            Qwen2_5OmniForConditionalGeneration,
            Qwen2_5OmniProcessor,
            Qwen2VLImageProcessor,
            WhisperFeatureExtractor,
        )
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = tiny_config()
    model = Qwen2_5OmniForConditionalGeneration._from_config(config, dtype=torch.float32)
    model.eval()
    tokenizer = build_tokenizer(out)
    if speaking:
        from harness.families.qwen2_5_omni import speaking_model

        with torch.no_grad():
            speaking_model.apply(model.state_dict(), tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    video = None
    try:
        from transformers import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor()
    except Exception:  # noqa: BLE001 - an environment without torchvision: no video processor
        video = None
    processor = Qwen2_5OmniProcessor(image_processor=Qwen2VLImageProcessor(), video_processor=video,
                                     feature_extractor=WhisperFeatureExtractor(feature_size=128),
                                     tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    gen = torch.Generator().manual_seed(seed + 1)
    dit = config.token2wav_config.dit_config
    spk = {name: {"cond": torch.randn(1, dit.enc_emb_dim, generator=gen),
                  "ref_mel": torch.randn(1, 300, dit.mel_dim, generator=gen)} for name in ("Chelsie", "Ethan")}
    torch.save(spk, out / "spk_dict.pt")
    params = sum(p.numel() for p in model.parameters())
    return write_marker(out, {"path": str(out), "seed": seed, "parameters": params, "bytes": folder_bytes(out),
                              "hidden_size": HIDDEN, "layers": LAYERS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
                              "speaking": speaking})


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.families.qwen2_5_omni.tiny_model DIR [--seed N] [--speaking]``: run by ``omni-stress
    tiny-model`` in the real environment's interpreter, whose transformers has the processors the server loads."""
    return builder_main(argv, "python -m harness.families.qwen2_5_omni.tiny_model", build, flags=("speaking",))


if __name__ == "__main__":
    raise SystemExit(main())
