"""``omni-stress tiny-model DIR --family qwen3-omni``: a tiny, randomly initialised Qwen3-Omni MoE checkpoint, offline.

Why: vLLM-Omni 0.30.0's unmodified Qwen3-Omni (MoE Thinker -> MoE Talker with its code predictor -> Code2Wav)
then runs on a CPU, in CI, with nothing downloaded (issue 44, item 1). Random weights make what it says
meaningless; the server's path (its three stages, both Thinker-to-Talker paths, the release's
``talker_preprocess``) does not depend on them. The speaking weights make it say a reply (``speaking``, below).

What it is (deterministic in ``seed``; run in the real environment, whose transformers has the Qwen3-Omni classes):

* ``config.json``: transformers' ``Qwen3OmniMoeConfig`` with every stack shrunk: Thinker text hidden 64, one
  MoE layer of :data:`NUM_EXPERTS` experts (top :data:`TOP_K`), two heads of 32 (a head size vLLM's CPU
  attention takes), interleaved M-RoPE ``[6, 5, 5]`` (sums to 16 = 32 / 2), Qwen's real 152,064-token
  vocabulary; ``accept_hidden_layer`` 0 (the Talker's "hidden" input is captured at the input of Thinker layer
  ``accept_hidden_layer``, so it must name an existing layer); a one-layer audio encoder and vision encoder
  (deepstack on its one block); a Talker of one MoE layer with a shared expert, hidden 64, Qwen3-Omni's
  3,072-id codec vocabulary and codec ids (PAD/BOS/EOS 2148-2150, nothink/think-BOS/think-EOS 2155-2157,
  speakers 2301-2303); a one-layer code predictor over the real 16 code groups of 2,048 codes; a Code2Wav of
  one transformer layer, hidden 64, whose upsampling gives the real 1,920 samples per frame at 24 kHz;
* ``model.safetensors``: every weight under the original checkpoint's names (per-expert
  ``mlp.experts.{e}.{gate,up,down}_proj.weight``, as vLLM's loader and transformers' conversion mapping
  expect), norms 1, every other tensor N(0, 0.02) from one ``torch.Generator`` in name order: the names and
  shapes come from transformers' own model class built on the meta device, so nothing depends on its
  initialisers; float32;
* a byte-level tokenizer (byte ``b`` is token ``b``), whose role words ``system``/``user``/``assistant`` are
  single tokens on Qwen's ids 8948/872/77091 (the release and its stage input processor find the turns by
  ``<|im_start|>`` and those ids), and Qwen3-Omni's added tokens on their real ids 151643-151675;
* Qwen3-Omni's processor (Whisper feature extractor, Qwen2-VL image and video processors, a ChatML chat
  template with Qwen3-Omni's audio/vision placeholders) and a ``generation_config.json``.

Speaking: ``build(..., speaking=True)`` sets the Talker's ``attention_bias`` (the construction's heads are
biases) and hands the random state dict to ``harness.families.qwen3_omni.speaking_model.apply`` before it is
saved (the Thinker's embedding table becomes the Talker's text side, the Talker says its rows:
``harness.families.qwen3_omni.speaking``); the config's sizes are the ones that construction needs (hidden 64,
head size 32, one Talker layer). ``python -m harness.families.qwen3_omni.speaking_check DIR`` checks it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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
from harness.families.qwen3_omni.speaking import (  # noqa: F401 - the ids the rules name, part of this module's API
    CODE2WAV_CODEBOOK as CODEBOOK, CODEC, ROLE_TOKENS, SPEAKERS, SPECIAL_TOKENS, TALKER_VOCAB,
)

HIDDEN = 64
HEAD_DIM = 32
HEADS = 2
THINKER_LAYERS = 1
TALKER_LAYERS = 1
NUM_EXPERTS = 2
TOP_K = 1
MOE_INTERMEDIATE = 32  # vLLM's CPU MoE pads the expert width to 32
INTERMEDIATE = 128
VOCAB = 152064
BYTES = 256
INIT_STD = 0.02
ACCEPT_HIDDEN_LAYER = 0
ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [6, 5, 5], "interleaved": True,
        "mrope_interleaved": True}
EXTRA_SPECIAL_TOKENS = {  # what Qwen3-Omni's processor reads off its tokenizer (``tokenizer.image_token``, ...)
    "image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
}
NUM_CODE_GROUPS = 16
# the vision processors' patching matches the vision config (patch 16, merge 2), as Qwen3-Omni's own
VISION_PROCESSOR = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5],
                    "image_std": [0.5, 0.5, 0.5]}
GENERATION = {"eos_token_id": [151645, 151643], "pad_token_id": 151643}  # <|im_end|>, <|endoftext|>
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'text' %}{{ content['text'] }}"
    "{% elif content['type'] == 'audio' or content['type'] == 'audio_url' or 'audio' in content %}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif content['type'] == 'image' or content['type'] == 'image_url' or 'image' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or content['type'] == 'video_url' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _text(layers: int, vocab: int, intermediate: int, **more: Any) -> dict[str, Any]:
    return dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                max_position_embeddings=65536, rope_parameters=dict(ROPE), rms_norm_eps=1e-6, hidden_act="silu",
                attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=MOE_INTERMEDIATE,
                num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, tie_word_embeddings=False,
                **more)


def config_dict(speaking: bool = False) -> dict[str, Any]:
    """The sub-configs of ``config.json`` as ``Qwen3OmniMoeConfig`` takes them (module docstring); ``speaking``:
    the Talker's attention has q/k/v (and, in transformers' class, o) biases."""
    thinker = dict(
        text_config=_text(THINKER_LAYERS, VOCAB, INTERMEDIATE, shared_expert_intermediate_size=0),
        audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=HEADS, encoder_ffn_dim=INTERMEDIATE,
                          d_model=HIDDEN, output_dim=HIDDEN, downsample_hidden_size=32, max_source_positions=1500,
                          n_window=50, n_window_infer=800, conv_chunksize=500),
        vision_config=dict(depth=1, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_heads=HEADS,
                           out_hidden_size=HIDDEN, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           num_position_embeddings=2304, deepstack_visual_indexes=[0], image_size=768,
                           apply_vit_abs_pos_embed=True),
        audio_token_id=SPECIAL_TOKENS["<|audio_pad|>"], image_token_id=SPECIAL_TOKENS["<|image_pad|>"],
        video_token_id=SPECIAL_TOKENS["<|video_pad|>"], audio_start_token_id=SPECIAL_TOKENS["<|audio_start|>"],
        audio_end_token_id=SPECIAL_TOKENS["<|audio_end|>"], vision_start_token_id=SPECIAL_TOKENS["<|vision_start|>"],
        vision_end_token_id=SPECIAL_TOKENS["<|vision_end|>"], user_token_id=ROLE_TOKENS["user"],
        position_id_per_seconds=13, tie_word_embeddings=False,
    )
    code_predictor = dict(vocab_size=CODEBOOK, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=1,
                          num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                          max_position_embeddings=65536, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                          rms_norm_eps=1e-6, num_code_groups=NUM_CODE_GROUPS, attention_bias=False)
    talker_text = _text(TALKER_LAYERS, TALKER_VOCAB, INTERMEDIATE, shared_expert_intermediate_size=MOE_INTERMEDIATE)
    talker_text["attention_bias"] = speaking
    talker = dict(
        text_config=talker_text,
        code_predictor_config=code_predictor, num_code_groups=NUM_CODE_GROUPS, thinker_hidden_size=HIDDEN,
        accept_hidden_layer=ACCEPT_HIDDEN_LAYER, speaker_id=dict(SPEAKERS), **CODEC,
        audio_token_id=SPECIAL_TOKENS["<|audio_pad|>"], image_token_id=SPECIAL_TOKENS["<|image_pad|>"],
        video_token_id=SPECIAL_TOKENS["<|video_pad|>"], vision_start_token_id=SPECIAL_TOKENS["<|vision_start|>"],
        audio_start_token_id=SPECIAL_TOKENS["<|audio_start|>"], position_id_per_seconds=13, spatial_merge_size=2,
    )
    code2wav = dict(codebook_size=CODEBOOK, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                    num_hidden_layers=1, intermediate_size=INTERMEDIATE, decoder_dim=HIDDEN,
                    num_quantizers=NUM_CODE_GROUPS, sliding_window=72, upsample_rates=[8, 5, 4, 3],
                    upsampling_ratios=[2, 2], max_position_embeddings=8000,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return dict(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav)


def tiny_config(speaking: bool = False) -> Any:
    """transformers' ``Qwen3OmniMoeConfig`` of :func:`config_dict` (Qwen's top-level token ids are its defaults)."""
    from transformers import Qwen3OmniMoeConfig

    config = Qwen3OmniMoeConfig(**config_dict(speaking), enable_audio_output=True)
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    config.torch_dtype = "float32"
    return config


_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every weight of transformers' ``Qwen3OmniMoeForConditionalGeneration`` (built on the meta device) under
    the original checkpoint's names: its fused expert tensors ``experts.gate_up_proj`` [E, 2I, H] and
    ``experts.down_proj`` [E, H, I] as per-expert ``experts.{e}.{gate,up,down}_proj.weight``."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.float32)
    out: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        shape = tuple(int(s) for s in tensor.shape)
        fused = _FUSED.match(name)
        if fused is None:
            out[name] = shape
            continue
        experts, prefix = shape[0], fused["prefix"]
        for e in range(experts):
            if fused["kind"] == "gate_up_proj":
                out[f"{prefix}.{e}.gate_proj.weight"] = (shape[1] // 2, shape[2])
                out[f"{prefix}.{e}.up_proj.weight"] = (shape[1] // 2, shape[2])
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = (shape[1], shape[2])
    return out


def random_state(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, Any]:
    """Norms (``*norm*.weight``) 1, every other tensor N(0, INIT_STD), drawn in name order from one generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        leaf = name.rsplit(".", 2)
        if name.endswith(".weight") and "norm" in leaf[-2] and len(shape) == 1:
            state[name] = torch.ones(shape)
        else:
            state[name] = torch.randn(shape, generator=gen) * INIT_STD
    return state


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer (no merges: byte ``b`` = id ``b``), the role words on Qwen's ids, Qwen3-Omni's
    added tokens on theirs."""
    from tokenizers.pre_tokenizers import ByteLevel

    chars = byte_chars()
    if set(chars.values()) != set(ByteLevel.alphabet()):
        raise RuntimeError("tiny tokenizer: the byte-level alphabet is not GPT-2's byte map")
    vocab = {chars[b]: b for b in range(BYTES)}
    roles = {tid: word for word, tid in ROLE_TOKENS.items()}
    first = min(SPECIAL_TOKENS.values())
    for tid in range(BYTES, first):  # the role words in the model's vocabulary: add_tokens then keeps their ids
        vocab[roles.get(tid, f"<|unused_{tid}|>")] = tid
    added = [(word, tid, False) for word, tid in sorted(ROLE_TOKENS.items(), key=lambda kv: kv[1])]
    added += [(text, tid, True) for text, tid in sorted(SPECIAL_TOKENS.items(), key=lambda kv: kv[1])]
    fast = byte_level_tokenizer(vocab, added, as_special=False, model_max_length=65536,
                                extra_special_tokens=EXTRA_SPECIAL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def check_tokenizer(tokenizer: Any) -> list[int]:
    """The ChatML prompt a user turn ``Hi.`` gives: one token per byte, the roles and specials on their ids."""
    ids = tokenizer.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi."}],
                                        add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    im_start, im_end, nl = SPECIAL_TOKENS["<|im_start|>"], SPECIAL_TOKENS["<|im_end|>"], 10
    want = [im_start, ROLE_TOKENS["system"], nl, ord("S"), im_end, nl, im_start, ROLE_TOKENS["user"], nl,
            *b"Hi.", im_end, nl, im_start, ROLE_TOKENS["assistant"], nl]
    if list(ids) != want:
        raise RuntimeError(f"tiny tokenizer: the chat template tokenizes as {list(ids)}, want {want}")
    return want


def build(out: Path, seed: int = 0, speaking: bool = False) -> dict[str, Any]:
    """Writes the checkpoint into ``out`` (created; must be empty or absent); returns a summary."""
    out = fresh_folder(out)
    with needs("tiny-model --family qwen3-omni: transformers with Qwen3-Omni is needed"):
        import torch  # noqa: F401
        from transformers import (
            Qwen2VLImageProcessor,
            Qwen3OmniMoeProcessor,
            WhisperFeatureExtractor,
        )
    config = tiny_config(speaking)
    shapes = weight_shapes(config)
    tokenizer = build_tokenizer()
    check_tokenizer(tokenizer)
    state = random_state(shapes, seed)
    if speaking:
        from harness.families.qwen3_omni import speaking_model

        speaking_model.apply(state)
    out.mkdir(parents=True, exist_ok=True)
    config_json = config.to_dict()
    config_json.pop("transformers_version", None)
    write_json(out / "config.json", config_json)
    save_state(state, out / "model.safetensors")
    video = None
    try:
        from transformers import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor(**VISION_PROCESSOR)
    except Exception:  # noqa: BLE001 - an environment without torchvision: no video processor
        video = None
    processor = Qwen3OmniMoeProcessor(image_processor=Qwen2VLImageProcessor(**VISION_PROCESSOR), video_processor=video,
                                      feature_extractor=WhisperFeatureExtractor(feature_size=128),
                                      tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_json(out / "generation_config.json", GENERATION)
    params = sum(int(v.numel()) for v in state.values())
    return write_marker(out, {"path": str(out), "family": "qwen3-omni", "seed": seed, "parameters": params,
                              "bytes": folder_bytes(out), "hidden_size": HIDDEN, "head_dim": HEAD_DIM,
                              "thinker_layers": THINKER_LAYERS, "talker_layers": TALKER_LAYERS,
                              "num_experts": NUM_EXPERTS, "experts_per_token": TOP_K, "vocab_size": VOCAB,
                              "speaking": speaking})


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.families.qwen3_omni.tiny_model DIR [--seed N]`` (run by ``omni-stress tiny-model
    --family qwen3-omni --random`` in the real environment's interpreter)."""
    return builder_main(argv, "python -m harness.families.qwen3_omni.tiny_model", build, flags=("speaking",))


if __name__ == "__main__":
    raise SystemExit(main())
