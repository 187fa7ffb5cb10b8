"""Fish Speech S2 Pro's Slow AR (stage 0), from the real upstream code (upstream issue #5018's list).

Hook: ``FishSpeechSlowARForConditionalGeneration.preprocess`` in
``vllm_omni/model_executor/models/fish_speech/fish_speech_slow_ar.py`` (0.30.0 and 0.32.0rc1: l.368, the file is
unchanged), with ``_build_structured_voice_clone_prefill_embeds`` and ``_apply_codebook_embeddings`` it reaches, and
``build_fish_voice_clone_prompt_ids`` from ``prompt_utils.py`` of the same release. The hook reads no phase metadata:
it routes on the span length (``span_len > 1``: prefill, l.385; ``1``: decode), and slices the prompt it built at
``meta.prefill_offset``, its own counter, after a first prefill that takes rows from 0 (l.393-425); it drops the
prompt once the counter reaches its end (``embed.prefill = None``), and a later prefill-routed span builds it again
and starts over from row 0.

Checked path: a voice-clone request as the serving layer builds it (``entrypoints/openai/tts_adapters/fish_speech.py``
``_build_prompt``): ``fish_structured_voice_clone``, ``text``, ``ref_text``, a stored voice (``voice_name``: the
speaker cache holds its DAC codes), and placeholder prompt ids ``[1] * P`` whose length comes from the real
``estimate_fish_voice_clone_prompt_len_from_normalized``. The hook builds the real prompt rows itself (text
embeddings, and the reference codes' codebook embeddings summed into the audio rows). The text-only path
(``build_fish_text_only_prompt_ids``) embeds the span's own ids in every branch, so its rows are the runner's own:
it conforms, up to what ``talker_mtp`` adds at decode positions, which is not modelled (docs/conform.md).

Decode (``n == 1``): the span's id embedding, and ``mtp_inputs`` whose text row is zeros (the runner's
``talker_mtp`` path). ``hidden_states.last`` is what ``postprocess`` stored after the previous step: model output,
fixed per position here (``deliver``).

Stand-in (``FishSpeechStandIn``): ``embed_input_ids`` (bf16 table), ``codebook_embeddings`` (10 codebooks of 64),
the config ids, a word-level tokenizer with the ChatML control tokens (``_get_tokenizer``), and the speaker cache with
the stored voice's codes. ``tensor.pin_memory()`` (l.398) needs an accelerator: on the CPU the host copy stays as it
is (``preprocess``). Not ``SupportsMultiModal``: under V1 a span starts from the runner's stale buffer rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from harness.conform.adapter import (
    Adapter,
    ConformRequest,
    PreprocessResult,
    UNRESOLVED,
    Provenance,
    _file_info,
    fixed_tokens,
    read_model_source,
    tagged,
)
from harness.conform.reach import ModelDeploys

HIDDEN = 64
TABLE = 6000
N_CODEBOOKS, CODEBOOK = 10, 64
SEMANTIC_BEGIN = 4000  # <|semantic:0|>; semantic ids run to SEMANTIC_BEGIN + CODEBOOK - 1
AUDIO_PAD = 3999
PLACEHOLDER = 1  # the serving layer's prompt ids: [1] * P
CONTROL = {"<|im_start|>": 3990, "<|im_end|>": 3991, "<|voice|>": 3992, "<|audio_start|>": 3993,
           "<|audio_end|>": 3994}
REF_FRAMES = 12
PROMPT_UTILS_MEMBER = "vllm_omni/model_executor/models/fish_speech/prompt_utils.py"
PROMPT_UTILS_FUNCTIONS = ("build_fish_voice_clone_prompt_ids", "normalize_fish_voice_clone_texts",
                          "estimate_fish_voice_clone_prompt_len_from_normalized")


class _Tokenizer:
    """Word-level ids below the control tokens; the control tokens at fixed ids."""

    unk_token_id = 0

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab.setdefault(w, 100 + len(self.vocab) % 3800) for w in text.replace("\n", " \n ").split(" ")
                if w]

    def convert_tokens_to_ids(self, token: str) -> int:
        return CONTROL.get(token, self.unk_token_id)


class _SpeakerCache:
    """``vllm_omni.utils.speaker_cache``: the stored voices' DAC codes (``ref_codes_fq``, [frames, codebooks])."""

    def __init__(self) -> None:
        self.voices: dict[tuple[str, str, int], dict[str, torch.Tensor]] = {}

    @staticmethod
    def make_cache_key(speaker_name: str, model_type: str, created_at: int = 0) -> tuple[str, str, int]:
        return (model_type, speaker_name.strip().lower(), int(created_at))

    def get(self, key: tuple[str, str, int]) -> dict[str, torch.Tensor] | None:
        return self.voices.get(key)

    def put(self, key: tuple[str, str, int], value: dict[str, torch.Tensor]) -> None:
        self.voices[key] = value


def ref_codes(voice: str) -> torch.Tensor:
    return torch.tensor(fixed_tokens(voice + "/dac", REF_FRAMES * N_CODEBOOKS, CODEBOOK),
                        dtype=torch.long).view(REF_FRAMES, N_CODEBOOKS)


class FishSpeechStandIn:
    """What ``FishSpeechSlowARForConditionalGeneration.preprocess`` touches."""

    _shared: dict[str, Any] = {}

    def __init__(self) -> None:
        if not self._shared:
            cb = torch.nn.Embedding(N_CODEBOOKS * CODEBOOK, HIDDEN)
            cb.weight.data = tagged(N_CODEBOOKS * CODEBOOK, HIDDEN, "fish-speech", "codebooks")
            cb.requires_grad_(False)
            FishSpeechStandIn._shared.update(table=tagged(TABLE, HIDDEN, "fish-speech", "embed").to(torch.bfloat16),
                                             codebooks=cb, tokenizer=_Tokenizer())
        self._table = self._shared["table"]
        self.codebook_embeddings = self._shared["codebooks"]
        self._tokenizer = self._shared["tokenizer"]
        self._speaker_cache = _SpeakerCache()
        self.model_path = "fishaudio/s2-pro"
        self._semantic_begin_id = SEMANTIC_BEGIN
        self._semantic_end_id = SEMANTIC_BEGIN + CODEBOOK - 1
        self._audio_pad_token_id = AUDIO_PAD
        self._codebook_size = CODEBOOK
        self._num_codebooks = N_CODEBOOKS
        self.text_config = SimpleNamespace(hidden_size=HIDDEN, codebook_size=CODEBOOK, num_codebooks=N_CODEBOOKS)

    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self._table[input_ids.long().clamp(0, TABLE - 1)]

    def _get_tokenizer(self) -> Any:
        return self._tokenizer


@contextlib.contextmanager
def _host_pinning() -> Iterator[None]:
    """``Tensor.pin_memory()`` raises without an accelerator; a pinned host copy holds the same values, so on the
    CPU the copy stays as it is while the hook runs."""
    original = torch.Tensor.pin_memory
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original  # type: ignore[method-assign]


class FishSpeechAdapter(Adapter):
    name = "fish-speech"
    title = "Fish Speech S2 Pro Slow AR (structured voice clone)"
    # stage 0: 4 or 64 sequences, budget 16384 = max_model_len, chunked prefill off, KV sized by the device
    deploys = ModelDeploys(("fish_qwen3_omni*.yaml",), stage=0, max_model_len=16384)
    member = "vllm_omni/model_executor/models/fish_speech/fish_speech_slow_ar.py"
    class_name = "FishSpeechSlowARForConditionalGeneration"
    module_name = "vllm_omni.model_executor.models.fish_speech.fish_speech_slow_ar"
    entries = ("preprocess",)
    has_mtp = True
    stale_rows = True
    codec_vocab = CODEBOOK
    hidden = HIDDEN
    notes = ("stand-in: embed_input_ids (bf16), codebook_embeddings, config ids, a word-level tokenizer, the speaker "
             "cache with the stored voice's codes; payload: the serving layer's structured voice-clone request; "
             "P from the real estimate_fish_voice_clone_prompt_len_from_normalized")

    def __init__(self) -> None:
        self._utils: dict[str, Any] = {}
        self._hidden: dict[str, torch.Tensor] = {}

    def stand_in_class(self) -> type:
        return FishSpeechStandIn

    def load(self, spec: str, base_dir: Path | None = None, wheel_dir: Path | None = None) -> tuple[Any, Provenance]:
        """``prompt_utils.py`` of the same release first: the hook imports ``build_fish_voice_clone_prompt_ids``."""
        from harness.talkers.upstream import build_functions

        src = read_model_source(spec, PROMPT_UTILS_MEMBER, base_dir, wheel_dir)
        self._utils = build_functions(src, PROMPT_UTILS_FUNCTIONS,
                                      module_name="vllm_omni.model_executor.models.fish_speech.prompt_utils")
        impl, prov = super().load(spec, base_dir, wheel_dir)
        prov.files.append(_file_info(src, PROMPT_UTILS_FUNCTIONS, self._utils["__stubbed__"]))
        return impl, prov

    def shims(self) -> dict[tuple[str, str], Any]:
        fn = self._utils.get("build_fish_voice_clone_prompt_ids")
        return {} if fn is None else {(".prompt_utils", "build_fish_voice_clone_prompt_ids"): fn}

    def make_model(self, impl: Any) -> Any:
        model = super().make_model(impl)
        for voice in self._voices:
            model._speaker_cache.put(model._speaker_cache.make_cache_key(voice, "fish_speech"),
                                     {"ref_codes_fq": ref_codes(voice)})
        return model

    def embed(self, model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model.embed_input_ids(ids).float()

    def preprocess(self, model: Any, ids: torch.Tensor, embeds: torch.Tensor, info: dict[str, Any],
                   is_prefill: bool, runner: str = "v1", decode_hook: Any = UNRESOLVED) -> PreprocessResult:
        with _host_pinning():
            return super().preprocess(model, ids, embeds, info, is_prefill, runner, decode_hook)

    def named_rows(self, model: Any) -> dict[str, torch.Tensor]:
        return {"the audio-pad embedding (<|audio_pad|>, the hook's padding)":
                model.embed_input_ids(torch.tensor([AUDIO_PAD])).float()[0]}

    def deliver(self, req: ConformRequest, state: dict[str, Any], calls: int, c: int = 0) -> dict[str, Any] | None:
        """``hidden_states.last``: the Slow AR's last hidden row, which ``postprocess`` stores after each step."""
        if calls < 1:
            return None
        hidden = self._hidden[req.request_id]
        return {"hidden_states": {"last": hidden[min(max(c - 1, 0), hidden.shape[0] - 1)]}}

    _voices: tuple[str, ...] = ()

    def requests(self, count: int, generated: int) -> list[ConformRequest]:
        if not self._utils:
            raise RuntimeError("load() first: the prompt length comes from the upstream prompt_utils")
        from harness.config import load_prompts

        normalize = self._utils["normalize_fish_voice_clone_texts"]
        estimate = self._utils["estimate_fish_voice_clone_prompt_len_from_normalized"]
        out, voices = [], []
        for prompt in load_prompts("default").prompts[:count]:
            voice = f"voice-{prompt.id}"
            voices.append(voice)
            text, ref_text = normalize(prompt.reply, prompt.user)
            P = int(estimate(FishSpeechStandIn._shared.get("tokenizer") or _Tokenizer(), text, ref_text, REF_FRAMES))
            payload = {"text": text, "ref_text": ref_text, "ref_audio_sr": 44100, "fish_structured_voice_clone": True,
                       "voice_name": voice, "voice_created_at": 0}
            self._hidden[prompt.id] = tagged(P + generated + 2, HIDDEN, "fish-speech", prompt.id, "hidden")
            gen = [SEMANTIC_BEGIN + t for t in fixed_tokens(prompt.id, generated + 1, self.codec_vocab)]
            out.append(ConformRequest(prompt.id, [PLACEHOLDER] * P, payload, gen))
        self._voices = tuple(voices)
        return out
