"""MiniCPM-o 4.5's TTS talker, from the real upstream code.

Hook: ``MiniCPMO45OmniTTSForConditionalGeneration.preprocess`` in
``vllm_omni/model_executor/models/minicpmo_4_5/minicpmo_4_5_omni_tts.py`` (0.30.0: l.425), with
``_build_condition_embeddings`` and ``_boundary_embeddings``. No MTP path and no batched decode
hook, so every span goes through ``preprocess``.

Payload: the AR stage's handoff stored with the real ``set_tts_handoff`` and read back by the
real ``get_tts_handoff`` (``vllm_omni/engine/duplex/intermediate.py``): ``ids.tts``, the speech
segment's text token ids, and ``hidden_states.tts``, their hidden states (deterministic rows).
The scheduler prompt is the real ``_build_tts_scheduler_prompt_token_ids``
(``stage_input_processors/minicpmo_4_5_omni.py``), i.e. the segment's token ids. Offline (not
native duplex) requests.

Stand-in (``MiniCPMoStandIn``): ``emb_text`` (a deterministic row per id), ``emb_code[0]`` (the
codec table, 6562 audio tokens), ``projector_semantic`` as a fixed random linear map (hidden
width 48 -> 64), ``normalize_projected_hidden``, the special ids of the 4.5 config and
``max_position_embeddings``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from harness.conform.reach import ModelDeploys
from harness.conform.adapter import (
    Adapter,
    ConformRequest,
    Provenance,
    _file_info,
    fixed_tokens,
    read_model_source,
    tagged,
)

HIDDEN = 64
LLM_DIM = 48
NUM_AUDIO_TOKENS = 6562
SIP_MEMBER = "vllm_omni/model_executor/stage_input_processors/minicpmo_4_5_omni.py"
HANDOFF_MEMBER = "vllm_omni/engine/duplex/intermediate.py"


class _EmbText:
    """``nn.Embedding`` of the 150k-id text vocabulary: one deterministic row per id, made on use."""

    def __init__(self) -> None:
        self.weight = torch.zeros(1, HIDDEN)  # device and dtype, as the hook reads them
        self._rows: dict[int, torch.Tensor] = {}

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        out = []
        for i in ids.reshape(-1).tolist():
            if i not in self._rows:
                self._rows[i] = tagged(1, HIDDEN, "minicpmo", "emb_text", i)[0]
            out.append(self._rows[i])
        return torch.stack(out).reshape(*ids.shape, HIDDEN)


class _EmbCode:
    def __init__(self) -> None:
        self.weight = tagged(NUM_AUDIO_TOKENS, HIDDEN, "minicpmo", "emb_code")

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids.long()]


class _Projector:
    def __init__(self) -> None:
        self.weight = tagged(LLM_DIM, HIDDEN, "minicpmo", "projector_semantic") / LLM_DIM ** 0.5

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.weight


class MiniCPMoStandIn:
    """What the offline preprocess path of the MiniCPM-o 4.5 talker touches."""

    _shared: dict[str, Any] = {}

    def __init__(self) -> None:
        if not self._shared:  # the tables are constants: build them once per process
            MiniCPMoStandIn._shared.update(emb_text=_EmbText(), emb_code=[_EmbCode()], proj=_Projector())
        self.emb_text = self._shared["emb_text"]
        self.emb_code = self._shared["emb_code"]
        self.projector_semantic = self._shared["proj"]
        self._normalize = True
        self._tts_bos_id = 151687
        self._text_eos_id = 151692
        self._codec_eos_id = NUM_AUDIO_TOKENS - 1
        self._tts_config = SimpleNamespace(max_position_embeddings=4096)
        self._request_audio_states: dict[str, dict[str, Any]] = {}
        self._request_condition_states: dict[str, dict[str, Any]] = {}
        # 0.32.0rc1: K codec frames per decode step (multi-frame decode), 0 unless stage 1 carries the ngram
        # speculative_config that arms it; the offline path under test reads it only for native duplex
        self._k_step_frames = 0
        self.supports_multi_frame_decode = False

    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.emb_code[0](input_ids)


class MiniCPMoAdapter(Adapter):
    stale_rows = True  # not SupportsMultiModal: V1 hands it the persistent inputs_embeds rows
    name = "minicpmo-4.5"
    # the TTS Talker is stage 1. KV bytes per token (bf16 K and V): 20 layers x 12 KV heads x 64 x 2 x 2 = 61440,
    # assumed from the MiniCPM-o TTS config (hidden 768); minicpmo_4_5.yaml's own comment says its 2 GiB CUDA
    # cap holds more than max_num_seqs x max_model_len = 4 x 4096 tokens
    deploys = ModelDeploys(
        ("minicpmo_4_5.yaml", "minicpmo_4_5_turn.yaml", "minicpmo_4_5_2gpu.yaml", "minicpmo_4_5_3gpu.yaml",
         "minicpmo_4_5_3gpu_stage1_replicas.yaml", "minicpmo_4_5_4gpu_stage1_replicas.yaml",
         "minicpmo_4_5_8x4090.yaml", "minicpmo_4_5_8x4090_stage1_replicas.yaml", "minicpmo_4_5*.yaml"), stage=1, max_model_len=4096,
        kv_bytes_per_token=61440)
    title = "MiniCPM-o 4.5 TTS talker"
    member = "vllm_omni/model_executor/models/minicpmo_4_5/minicpmo_4_5_omni_tts.py"
    class_name = "MiniCPMO45OmniTTSForConditionalGeneration"
    module_name = "vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_tts"
    entries = ("preprocess",)
    codec_vocab = 2048
    hidden = HIDDEN
    notes = ("stand-in: emb_text / emb_code tables, projector_semantic as a fixed random map, 4.5 config ids; "
             "payload: the real set_tts_handoff / get_tts_handoff and _build_tts_scheduler_prompt_token_ids")

    def __init__(self) -> None:
        self._fns: dict[str, Any] = {}

    def stand_in_class(self) -> type:
        return MiniCPMoStandIn

    def embed(self, model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model.embed_input_ids(ids).float()

    def _handoff(self, spec: str, base_dir: Path | None, wheel_dir: Path | None) -> tuple[Any, dict[str, Any]]:
        from harness.talkers.upstream import build_functions

        src = read_model_source(spec, HANDOFF_MEMBER, base_dir, wheel_dir)
        return src, build_functions(src, ("get_tts_handoff", "set_tts_handoff"),
                                    module_name="vllm_omni.engine.duplex.intermediate")

    def load(self, spec: str, base_dir: Path | None = None, wheel_dir: Path | None = None) -> tuple[Any, Provenance]:
        # the hook imports get_tts_handoff: give it the real one before compiling the hook
        src, fns = self._handoff(spec, base_dir, wheel_dir)
        self._fns.update(fns)
        impl, prov = super().load(spec, base_dir, wheel_dir)
        prov.files.append(_file_info(src, ("get_tts_handoff", "set_tts_handoff"), fns["__stubbed__"]))
        return impl, prov

    def shims(self) -> dict[tuple[str, str], Any]:
        return {("vllm_omni.engine.duplex.intermediate", "get_tts_handoff"): self._fns["get_tts_handoff"]}

    def extra_sources(self, spec: str, base_dir: Path | None, wheel_dir: Path | None, prov: Provenance) -> None:
        src = read_model_source(spec, SIP_MEMBER, base_dir, wheel_dir)
        self._fns["prompt_of"], lines = llm2tts_prompt(src)
        prov.files.append(_file_info(src, (f"llm2tts (l.{lines})",), ()))

    def requests(self, count: int, generated: int) -> list[ConformRequest]:
        from harness.config import load_prompts
        from harness.tokenizer import tokenize

        vocab: dict[str, int] = {}
        out = []
        for prompt in load_prompts("default").prompts[:count]:
            ids = [vocab.setdefault(w, 1000 + len(vocab)) for w in tokenize(prompt.reply)]
            token_ids = torch.tensor(ids, dtype=torch.long)
            payload: dict[str, Any] = {}
            hidden = tagged(len(ids), LLM_DIM, prompt.id, "tts-hidden")
            self._fns["set_tts_handoff"](payload, token_ids, hidden)
            # llm2tts's own branch for a handoff with both ids and hidden states (offline, not native duplex)
            prompt_ids, condition_length = self._fns["prompt_of"](ids, hidden.tolist(), False)
            payload.setdefault("meta", {})["next_stage_prompt_len"] = condition_length
            out.append(ConformRequest(prompt.id, [int(i) for i in prompt_ids], payload,
                                      fixed_tokens(prompt.id, generated + 1, self.codec_vocab)))
        return out


_PROMPT_TARGETS = ("condition_suffix_length", "condition_length", "scheduler_prompt_token_ids")


def llm2tts_prompt(src: Any) -> tuple[Any, str]:
    """The scheduler prompt ``llm2tts`` builds when the handoff has both ids and hidden states, from the
    release's own lines (0.30.0 l.1044-1049): ``condition_suffix_length = 1 if is_native_duplex_handoff
    else 2``, ``condition_length = max(len(handoff_ids), len(handoff_hidden)) + condition_suffix_length``,
    ``scheduler_prompt_token_ids = [0] * condition_length``. Those assignments are compiled unchanged (with
    their line numbers) into ``f(handoff_ids, handoff_hidden, is_native_duplex_handoff) -> (prompt ids,
    condition_length)``. Returns it and the line range."""
    import ast

    from harness.errors import ConfigError

    tree = ast.parse(src.text)
    fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "llm2tts"), None)
    if fn is None:
        raise ConfigError(f"{src.location}: no function llm2tts")
    found: dict[str, ast.Assign] = {}
    for node in ast.walk(fn):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in _PROMPT_TARGETS and node.targets[0].id not in found):
            if node.targets[0].id == "scheduler_prompt_token_ids" and not isinstance(node.value, ast.BinOp):
                continue  # the other branch (_build_tts_scheduler_prompt_token_ids)
            found[node.targets[0].id] = node
    missing = [t for t in _PROMPT_TARGETS if t not in found]
    if missing:
        raise ConfigError(f"{src.location}: llm2tts no longer assigns {', '.join(missing)} (the scheduler prompt of "
                          f"a handoff with ids and hidden states); update harness/conform/models/minicpmo.py")
    body = [found[t] for t in _PROMPT_TARGETS]
    ret = ast.Return(ast.Tuple([ast.Name("scheduler_prompt_token_ids", ast.Load()),
                                ast.Name("condition_length", ast.Load())], ast.Load()))
    args = ast.arguments(posonlyargs=[], args=[ast.arg(a) for a in ("handoff_ids", "handoff_hidden",
                                                                      "is_native_duplex_handoff")],
                         kwonlyargs=[], kw_defaults=[], defaults=[])
    func = ast.FunctionDef("llm2tts_prompt", args, [*body, ret], [], None)
    ast.copy_location(func, body[0])
    ast.copy_location(ret, body[-1])
    module = ast.fix_missing_locations(ast.Module([func], []))
    namespace: dict[str, Any] = {}
    exec(compile(module, src.location, "exec"), namespace)  # noqa: S102 -- upstream's own lines, unchanged
    return namespace["llm2tts_prompt"], f"{body[0].lineno}-{body[-1].lineno}"

