"""Qwen3-Omni's talker (stage 1), from the real upstream code.

Hook: ``Qwen3OmniMoeForConditionalGeneration.talker_preprocess`` in
``vllm_omni/model_executor/models/qwen3_omni/qwen3_omni.py`` (0.30.0: l.764) and every method it
reaches (``talker_preprocess_prefill``, ``_thinker_to_talker_prefill``, ``_get_talker_user_parts``,
``_get_talker_assistant_parts``, ``_get_tts_embed``, ``talker_preprocess_decode``, ...). The model
has ``talker_mtp``, so vLLM-Omni's runner takes its MTP path for one-token decode spans: it pops
``update_dict["mtp_inputs"] = (last_talker_hidden, text_step)`` and the position runs with the
codec embedding plus ``text_step`` (what ``talker_mtp`` adds); a decode span of ``n > 1`` gets no
text step (gpu_model_runner.py l.1899). The driver reproduces exactly that.

Payload: the real stage input processor, ``thinker2talker_full_payload`` in
``vllm_omni/model_executor/stage_input_processors/qwen3_omni.py`` (what the connector ships for
``async_chunk: false``), fed a Thinker ``pooling_output`` of deterministic rows (layer-0
embeddings and accept-layer hidden states per token, ``embed.tts_bos/eos/pad``); the prompt
length ``P`` is that file's ``_compute_talker_prompt_ids_length``, as ``thinker2talker_token_only``
sizes the Talker's placeholder prompt (``[0] * P``). Thinker ids are ChatML (system, user,
assistant turns) around the words of the first prompts of ``prompts/default.yaml``.

Stand-in (``Qwen3OmniStandIn``): a codec embedding table, ``text_projection`` and
``hidden_projection`` as fixed random linear maps (Thinker width 48 -> Talker width 64), the
ChatML role ids of the Qwen3-Omni tokenizer, codec special ids and speaker ids inside the
table (values do not matter to the check, only that they are distinct), ``async_chunk`` False.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from harness.conform.reach import ModelDeploys
from harness.conform.adapter import Adapter, ConformRequest, Provenance, _file_info, fixed_tokens, read_model_source, tagged

THINKER_DIM = 48
HIDDEN = 64
CODEC_TABLE = 3072
IM_START, IM_END, NEWLINE = 151644, 151645, 198
SYSTEM, USER, ASSISTANT = 8948, 872, 77091
TTS_PAD_TOKEN = 151671
ACCEPT_HIDDEN_LAYER = 24
SIP_MEMBER = "vllm_omni/model_executor/stage_input_processors/qwen3_omni.py"
SIP_FUNCTIONS = ("thinker2talker_full_payload", "_compute_talker_prompt_ids_length")
# 0.32.0rc1+: the prefill cuts the Thinker text at a <tool_call> token (model code, compiled from the release)
TOOL_SPEECH_MEMBER = "vllm_omni/model_executor/models/qwen3_omni/tool_speech.py"
TOOL_SPEECH_FUNCTIONS = ("spoken_span_end", "tool_call_start_offset")


class _Linear:
    def __init__(self, tag: str) -> None:
        self.weight = tagged(THINKER_DIM, HIDDEN, "qwen3-omni", tag) / THINKER_DIM ** 0.5

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # in the input's dtype, as a bf16 nn.Linear on bf16
        return (x.float() @ self.weight).to(x.dtype)


class _Talker:
    def __init__(self) -> None:
        self.codec_table = tagged(CODEC_TABLE, HIDDEN, "qwen3-omni", "codec")
        self.text_projection = _Linear("text_projection")
        self.hidden_projection = _Linear("hidden_projection")
        self.num_code_groups = 16

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codec_table[ids.long().clamp(0, CODEC_TABLE - 1)]


class Qwen3OmniStandIn:
    """What the talker preprocess path of ``Qwen3OmniMoeForConditionalGeneration`` touches."""

    def __init__(self) -> None:
        self.talker = _Talker()
        tc = SimpleNamespace(codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
                             codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150,
                             text_config=SimpleNamespace(hidden_size=HIDDEN),
                             speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303})
        self.talker_config = tc
        self.config = SimpleNamespace(im_start_token_id=IM_START, system_token_id=SYSTEM, user_token_id=USER,
                                      assistant_token_id=ASSISTANT, tts_pad_token_id=TTS_PAD_TOKEN, talker_config=tc)
        self.thinker_config = SimpleNamespace(audio_token_id=151675, image_token_id=151655, video_token_id=151656)
        # what upstream's _init_special_tokens_embeddings sets from talker_config.speaker_id
        self.tts_text_spk_token_ids = dict(tc.speaker_id)
        self.default_tts_text_spk_type = "chelsie"
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(async_chunk=False))

    @staticmethod
    def _module_device(module: Any) -> torch.device:
        return torch.device("cpu")


def special_thinker_rows() -> dict[str, torch.Tensor]:
    """``embed.tts_bos`` / ``tts_eos`` / ``tts_pad``: the Thinker's embeddings of the TTS tokens, shaped
    ``[1, 1, H]`` (an embedding of a ``[1, 1]`` id tensor: ``_get_tts_embed`` takes ``x[0, -1:, :]``)."""
    rows = tagged(3, THINKER_DIM, "qwen3-omni", "tts-special")
    return {"tts_bos": rows[0:1].view(1, 1, -1), "tts_eos": rows[1:2].view(1, 1, -1),
            "tts_pad": rows[2:3].view(1, 1, -1)}


class Qwen3OmniAdapter(Adapter):
    name = "qwen3-omni"
    # the Talker is stage 1; max_model_len: the shipped deploys set none (32768 assumed for the model config)
    deploys = ModelDeploys(
        ("qwen3_omni_moe.yaml", "qwen3_omni_duplex.yaml", "qwen3_omni_moe_mori_intranode.yaml", "qwen3_omni*.yaml"),
        stage=1,
        max_model_len=32768,
        unmodelled=(("runner+async_chunk", ("v2", True), "MRV2 with async_chunk: true (0.32.0rc1 *_mrv2.yaml: "
                     "how MRV2 rebuilds a resumed request's streamed cached_decode rows is not modelled)"),))
    # the shipped deploys stream (async_chunk: true): one row for that decode path; the async_chunk: false
    # full-payload path (trailing_text queue) is checked too, though no shipped deploy runs it
    chunk_modes = True
    extra_modes = (("v1", False),)
    unmodelled_modes = {("v2", True): "MRV2 with async_chunk"}
    title = "Qwen3-Omni talker"
    member = "vllm_omni/model_executor/models/qwen3_omni/qwen3_omni.py"
    class_name = "Qwen3OmniMoeForConditionalGeneration"
    module_name = "vllm_omni.model_executor.models.qwen3_omni.qwen3_omni"
    entries = ("talker_preprocess",)
    has_mtp = True
    codec_vocab = 2048
    hidden = HIDDEN
    notes = ("stand-in: codec table, text/hidden projections as fixed random maps, ChatML and codec ids; payload: "
             "the real thinker2talker_full_payload and _compute_talker_prompt_ids_length (stage input processor); "
             "decode n == 1 through the runner's talker_mtp path (codec row + text_step)")

    def __init__(self) -> None:
        self._sip: dict[str, Any] | None = None
        self._tool_speech: dict[str, Any] = {}
        self._tool_speech_src: Any = None
        self._streams: dict[str, torch.Tensor] = {}  # async_chunk: the Thinker rows streamed after chunk 0
        self._thinker_embed: dict[str, torch.Tensor] = {}  # every Thinker token's layer-0 row, for naming rows

    def make_model(self, impl: Any) -> Any:
        model = super().make_model(impl)
        model.vllm_config = SimpleNamespace(model_config=SimpleNamespace(async_chunk=self.async_chunk))
        return model

    def deliver(self, req: ConformRequest, state: dict[str, Any], calls: int, c: int = 0) -> dict[str, Any] | None:
        """``async_chunk: true``: after chunk 0 (the payload), ``thinker2talker_async_chunk`` sends one chunk per
        Thinker step, ``{"embed": {"decode": row [1, D]}, "meta": {"finished": ...}}``, and the runner merges
        it into the buffer (``_update_intermediate_buffer``). Modelled: the Thinker runs ahead and the
        Talker's connector hands over one chunk before each of the request's calls after the first, so no
        chunk is late and none overwrites another."""
        stream = self._streams.get(req.request_id)
        if not self.async_chunk or stream is None or calls < 1:
            return None
        k = state.get("next", 0)
        if k >= stream.shape[0]:
            return None
        state["next"] = k + 1
        return {"embed": {"decode": stream[k:k + 1]}, "meta": {"finished": torch.tensor(k == stream.shape[0] - 1)}}

    def stand_in_class(self) -> type:
        return Qwen3OmniStandIn

    def load(self, spec: str, base_dir: Path | None = None, wheel_dir: Path | None = None) -> tuple[Any, Provenance]:
        """Releases from 0.32.0rc1 import ``spoken_span_end`` from ``tool_speech.py``: compile it from the
        same release (it decides where the spoken Thinker text ends), when the release has that file."""
        from harness.errors import ConfigError
        from harness.talkers.upstream import build_functions

        self._tool_speech, self._tool_speech_src = {}, None
        try:
            src = read_model_source(spec, TOOL_SPEECH_MEMBER, base_dir, wheel_dir)
        except ConfigError:
            src = None
        if src is not None and src.kind != "file":
            self._tool_speech = build_functions(src, TOOL_SPEECH_FUNCTIONS, module_name="vllm_omni.model_executor."
                                                "models.qwen3_omni.tool_speech")
            self._tool_speech_src = src
        impl, prov = super().load(spec, base_dir, wheel_dir)
        if self._tool_speech_src is not None:
            prov.files.append(_file_info(self._tool_speech_src, TOOL_SPEECH_FUNCTIONS, self._tool_speech["__stubbed__"]))
        return impl, prov

    def shims(self) -> dict[tuple[str, str], Any]:
        mod = "vllm_omni.model_executor.models.qwen3_omni.tool_speech"
        return {(mod, k): self._tool_speech[k] for k in TOOL_SPEECH_FUNCTIONS if k in self._tool_speech}

    def extra_sources(self, spec: str, base_dir: Path | None, wheel_dir: Path | None, prov: Provenance) -> None:
        from harness.talkers.upstream import build_functions

        src = read_model_source(spec, SIP_MEMBER, base_dir, wheel_dir)
        tts_utils = "vllm_omni.model_executor.stage_input_processors.tts_utils"
        self._sip = build_functions(src, SIP_FUNCTIONS, module_name="vllm_omni.model_executor.stage_input_processors."
                                    "qwen3_omni", shims={(tts_utils, "extract_speaker_from_request"): _none,
                                                         (tts_utils, "extract_language_from_request"): _none})
        prov.files.append(_file_info(src, SIP_FUNCTIONS, self._sip["__stubbed__"]))

    def requests(self, count: int, generated: int) -> list[ConformRequest]:
        if self._sip is None:
            raise RuntimeError("load() first: the payload comes from the upstream stage input processor")
        from harness.config import load_prompts
        from harness.tokenizer import tokenize

        ps = load_prompts("default")
        vocab: dict[str, int] = {}

        def ids(text: str) -> list[int]:
            return [vocab.setdefault(w, 1000 + len(vocab)) for w in tokenize(text)]

        system = ids(ps.system_prompt)[:6]
        out = []
        for prompt in ps.prompts[:count]:
            rid = prompt.id
            prompt_ids = ([IM_START, SYSTEM, NEWLINE, *system, IM_END, NEWLINE, IM_START, USER, NEWLINE,
                           *ids(prompt.user), IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE])
            output_ids = [*ids(prompt.reply), IM_END]
            all_ids = prompt_ids + output_ids
            pooling = {
                "hidden_states.layer_0": tagged(len(all_ids), THINKER_DIM, rid, "embedding"),
                f"hidden_states.layer_{ACCEPT_HIDDEN_LAYER}": tagged(len(all_ids), THINKER_DIM, rid, "accept-hidden"),
                **{f"embed.{k}": v for k, v in special_thinker_rows().items()},
            }
            thinker_request = SimpleNamespace(request_id=rid, prompt_token_ids=prompt_ids, all_token_ids=all_ids,
                                              output_token_ids=output_ids)
            transfer = SimpleNamespace(config=SimpleNamespace(hf_config=SimpleNamespace(
                talker_config=SimpleNamespace(accept_hidden_layer=ACCEPT_HIDDEN_LAYER))))
            payload = self._sip["thinker2talker_full_payload"](transfer, pooling, thinker_request)
            self._thinker_embed[rid] = pooling["hidden_states.layer_0"]
            if self.async_chunk:
                payload = self._async_chunk0(pooling, prompt_ids, all_ids, rid)
            P = self._sip["_compute_talker_prompt_ids_length"]({"ids": {"all": all_ids, "prompt": prompt_ids}},
                                                               device="cpu")
            out.append(ConformRequest(rid, [0] * int(P), payload, fixed_tokens(rid, generated + 1, self.codec_vocab)))
        return out

    def _async_chunk0(self, pooling: dict[str, Any], prompt_ids: list[int], all_ids: list[int],
                      rid: str) -> dict[str, Any]:
        """Chunk 0 of ``thinker2talker_async_chunk`` (0.30.0 l.427-456): the Thinker's prompt rows plus the first
        generated token's (it holds the prompt back until that one arrives), its accept-layer rows, the ids so
        far and the TTS special rows, in the Thinker's bf16. The later tokens' layer-0 rows stream one chunk
        each (``deliver``)."""
        n = len(prompt_ids) + 1
        emb = pooling["hidden_states.layer_0"].to(torch.bfloat16)
        self._streams[rid] = emb[n:]
        return {
            "embed": {"prefill": emb[:n], **{k: pooling[f"embed.{k}"].to(torch.bfloat16)
                                             for k in ("tts_bos", "tts_eos", "tts_pad")}},
            "hidden_states": {"output": pooling[f"hidden_states.layer_{ACCEPT_HIDDEN_LAYER}"][:n].to(torch.bfloat16)},
            "ids": {"all": all_ids[:n], "prompt": list(prompt_ids)},
            "meta": {"finished": torch.tensor(False)},
        }

    def request_tables(self, req: ConformRequest) -> dict[str, torch.Tensor]:
        """Row ``j``: the Thinker's embedding of token ``j`` projected as the talker does (bf16), which is
        what user-turn prompt positions and the ``trailing_text`` (or streamed ``cached_decode``) decode rows
        carry."""
        proj = _Linear("text_projection")
        rows = self._thinker_embed.get(req.request_id, req.payload["embed"]["prefill"])
        return {"the projected Thinker embedding of token": proj(rows.to(torch.bfloat16))}

    def named_rows(self, model: Any) -> dict[str, torch.Tensor]:
        proj = model.talker.text_projection
        return {f"the projected {k} row": proj(v.to(torch.bfloat16)).reshape(1, -1)
                for k, v in special_thinker_rows().items()}


def _none(*_args: Any, **_kwargs: Any) -> None:
    """``extract_speaker_from_request`` / ``extract_language_from_request``: no speaker, no language."""
    return None
