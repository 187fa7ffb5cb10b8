"""Qwen3-TTS on the real server (``--backend vllm-omni --family qwen3-tts``): what differs from Qwen2.5-Omni.

Server side (omni-stress's process):

* **The deploy** (:func:`translate`): 0.30.0's ``--stage-overrides`` cannot switch the runner, and the
  shipped ``deploy/qwen3_tts.yaml`` runs MRV2 (CUDA only) with ``async_chunk: true``; so the server
  gets a whole deploy YAML (``--deploy-config``, :func:`deploy_yaml`): the shipped file's two stages
  (Talker, Code2Wav) with ``model_runner: v1``, the deploy's ``async_chunk`` (the shipped CPU deploys say
  ``false``: the full-payload path, Code2Wav decodes a request's codes once it is done; ``true`` is the
  release's streaming path, with the release's own connector settings read from its vendored YAML,
  :func:`release_streaming`: Code2Wav decodes windows while the Talker runs, several audio chunks per
  request; it runs on the CPU platform as shipped), the deploy's Talker scheduler and KV settings and its
  ``sampling:`` as the Talker's ``default_sampling_params`` (the speech API takes no per-stage
  sampling), eager stages, prefix caching off. On CPU also the CPU profile of
  ``harness.serve.deploy_args`` (32-token KV blocks, the pinned Talker block count converted to them,
  fixed KV bytes, Code2Wav in float32, the thread variables). An MRV2 deploy is refused before
  (``harness.serve.entry.check_deploys``).
* **Requests** (:func:`speech_body`): ``POST /v1/audio/speech`` with the prompt's text, CustomVoice,
  the prompt's ``speaker`` as ``voice`` (the default speaker where it names none), or, for a prompt whose voice
  is a ``speaker_embedding`` (a Base checkpoint's), ``task_type: Base`` and the vector as ``speaker_embedding``
  (the serving layer makes it ``voice_clone_prompt.ref_spk_embedding`` with ``x_vector_only_mode``), ``language: Auto``,
  ``non_streaming_mode: false`` (the streaming-text layout docs/families/qwen3_tts.md's contract is written
  for), WAV (or, with ``--stream``, SSE of PCM chunks); sent and measured by ``harness.serve.speech.send_speech``.
* **Matching trace lines**: the speech endpoint names its engine requests ``speech-<uuid>`` and
  ignores ``X-Request-Id``, so the worker writes each call's text (``tts_text``) and lines are filed
  by it (texts are unique within a prompt set).

Worker side (inside the Talker worker, from the trace plugin; only the standard library at import):

* :func:`wrap` traces ``preprocess`` and ``preprocess_decode_batch`` (the runner sends one-token
  decode spans through the batched hook; every other span through ``preprocess``): one line per
  request and call, a batch's requests one line each, and a ``preprocess`` called from inside the
  batched hook (the fix builds its batch from it) is not traced again, so every position is traced
  once per schedule.
* :func:`contract_keys`, the worker's contract check for this family: the delivered row of each
  position (``preprocess``'s rows, ``req_embeds[:min(n, rows)]``; a one-token decode's codec row plus
  its ``text_step``, which ``talker_mtp`` adds) against the contract's row built with the *release's*
  prompt builder from the same payload: ``p < P`` the builder's prompt row (``tts_pad`` past it),
  ``p >= P`` the codec embedding of the position's id plus ``trailing_text[p - P]`` (``tts_pad`` past
  it); tolerance as ``harness.serve.worker_contract`` (``ULPS`` units of the delivered dtype).
  The residual codebooks' embeddings ``talker_mtp`` adds later are not part of the comparison (the
  speaking checkpoint makes them zero).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from harness.families.qwen3_tts.contract import DEFAULT_SPEAKER, flatten_payload
from harness.physics import QWEN3_TTS_UPSAMPLE

TALKER, CODE2WAV = "0", "1"
SPEECH_LANGUAGE, SPEECH_TASK = "Auto", "CustomVoice"
SPEECH_VOICE = DEFAULT_SPEAKER
CODE2WAV_BATCHED_TOKENS = 65536  # the shipped qwen3_tts.yaml's: Q x frames exceeds 32k
BY_TEXT = True  # the speech endpoint ignores X-Request-Id: trace lines are filed by the request's text
WRAPPER = "harness.families.qwen3_tts.serve:wrap"  # what the trace plugin wraps the Talker class with
HOOK = "preprocess"
# async_chunk: the release's Talker -> Code2Wav window builder, traced at the connector (harness.serve.chunk_trace)
CHUNKER = "vllm_omni.model_executor.stage_input_processors.qwen3_tts:talker2code2wav_async_chunk"
SAMPLES_PER_CODEC_FRAME = QWEN3_TTS_UPSAMPLE  # Code2Wav's samples per codec frame: a stream's audio length


# ------------------------------------------------------------------------------------------ server side


def deploy_yaml(deploy: Any, platform: str) -> dict[str, Any]:
    """The whole deploy YAML the server is started with (module docstring)."""
    from harness.serve.deploy_args import talker_stage

    talker_cfg = deploy.talker
    s = deploy.sampling
    talker: dict[str, Any] = {
        "stage_id": 0, "enforce_eager": True, "trust_remote_code": True, "async_scheduling": False, "devices": "0",
        "default_sampling_params": {k: v for k, v in (("temperature", s.temperature), ("top_p", s.top_p),
                                                      ("top_k", s.top_k), ("seed", s.seed),
                                                      ("max_tokens", s.max_tokens)) if v is not None},
        **talker_stage(talker_cfg),
    }
    code2wav: dict[str, Any] = {
        "stage_id": 1, "max_num_seqs": deploy.code2wav.max_num_seqs, "enforce_eager": True,
        "trust_remote_code": True, "enable_prefix_caching": False, "async_scheduling": False, "devices": "0",
        "max_num_batched_tokens": CODE2WAV_BATCHED_TOKENS, "max_model_len": CODE2WAV_BATCHED_TOKENS,
        "default_sampling_params": {"temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                    "max_tokens": CODE2WAV_BATCHED_TOKENS, "repetition_penalty": 1.0},
    }
    if platform == "cpu":
        from harness.serve.deploy_args import (
            CODE2WAV_STAGE, CPU_BLOCK_SIZE, CPU_KV_BYTES, TALKER_STAGE, cpu_stage_devices,
        )

        blocks = talker.get("num_gpu_blocks_override")
        if blocks is not None:
            talker["num_gpu_blocks_override"] = -(-blocks * talker_cfg.block_size // CPU_BLOCK_SIZE)
        talker.pop("gpu_memory_utilization", None)
        # Qwen2.5-Omni's CPU sizes per stage kind (deploy_args.CPU_KV_BYTES: the tiny checkpoints' KV is 1 KiB a token or less
        # 1 KiB a token, 256 MiB hold far more than any CPU deploy's max_model_len)
        for stage, kv in ((talker, CPU_KV_BYTES[TALKER_STAGE]), (code2wav, CPU_KV_BYTES[CODE2WAV_STAGE])):
            stage["block_size"] = max(CPU_BLOCK_SIZE, -(-stage.get("block_size", CPU_BLOCK_SIZE) // CPU_BLOCK_SIZE)
                                      * CPU_BLOCK_SIZE)
            stage["kv_cache_memory_bytes"] = kv
        code2wav["dtype"] = "float32"
        for stage in (talker, code2wav):  # both on device 0 in the release's YAML: side by side on CPU
            stage["devices"] = cpu_stage_devices(stage["stage_id"])
    content = {"model_runner": "v1", "async_chunk": bool(deploy.async_chunk), "stages": [talker, code2wav]}
    if deploy.async_chunk:  # the release's streaming path: its connectors, as it ships them
        shipped = release_streaming()
        content["connectors"] = shipped["connectors"]
        talker["output_connectors"] = shipped["output_connectors"]
        code2wav["input_connectors"] = shipped["input_connectors"]
    return content


# The release's own deploy YAML, vendored for ``conform``: an ``async_chunk: true`` deploy takes its connector
# settings (SharedMemoryConnector, codec_chunk_frames 25, codec_left_context_frames 72, initial_codec_chunk_frames
# 1, ...) from there, so they are the release's and not restated here (issue 42).
RELEASE_DEPLOY = "qwen3_tts.yaml"  # the release's deploy the streaming connectors are read from


def release_streaming() -> dict[str, Any]:
    """The release's ``connectors:`` and the connectors its Talker sends on and its Code2Wav reads from."""
    from harness.serve.deploy_args import release_deploy

    shipped = release_deploy(RELEASE_DEPLOY)
    stages = {stage["stage_id"]: stage for stage in shipped["stages"]}
    return {"connectors": shipped["connectors"], "output_connectors": stages[0]["output_connectors"],
            "input_connectors": stages[1]["input_connectors"]}


def chunk_rule() -> Any:
    """The window rule the release's connector settings give (``harness.chunk_contract``): its first and
    steady window sizes from the vendored YAML; no left context is resent (CustomVoice, no ICL codes)."""
    from harness.chunk_contract import ChunkRule

    extra = release_streaming()["connectors"]["connector_of_shared_memory"]["extra"]
    return ChunkRule(chunk_frames=int(extra["codec_chunk_frames"]),
                     initial_frames=int(extra.get("initial_codec_chunk_frames") or 0), left_context=0)


def translate(deploy: Any, platform: str, speaking: bool = True) -> Any:
    """The deploy as ``vllm serve`` arguments: ``--deploy-config`` (the cell's file, written from
    ``deploy_yaml``) and the platform's environment (the same for a speaking checkpoint and any other)."""
    from harness.serve.deploy_args import yaml_translation

    return yaml_translation(deploy, platform, lambda: deploy_yaml(deploy, platform))


def request_body(model: str, prompts: Any, prompt: Any, deploy: Any, tag: str, speaking: bool,
                 stream: bool) -> dict[str, Any]:
    """The family's request for one prompt: its text to say (``speech_body``); the tag is not sent."""
    return speech_body(model, prompt.reply, stream, deploy, voice=prompt.speaker,
                       speaker_embedding=prompt.speaker_embedding)


def speech_body(model: str, text: str, stream: bool = False, deploy: Any = None,
                voice: str | None = None, speaker_embedding: Any = None) -> dict[str, Any]:
    """One ``/v1/audio/speech`` request (module docstring); ``deploy``: its sampling's ``max_tokens`` and
    ``seed`` become the request's ``max_new_tokens`` and ``seed`` (the serving layer's own default is
    2048 new tokens, more than a small deploy's ``max_model_len`` holds); ``voice``: the prompt's speaker
    (None: the family's default); ``speaker_embedding``: a Base voice instead (no ``voice`` is sent)."""
    from harness.serve.streaming import speech_body as body

    if speaker_embedding is not None:
        extra: dict[str, Any] = {"speaker_embedding": list(speaker_embedding), "language": SPEECH_LANGUAGE,
                                 "task_type": "Base", "non_streaming_mode": False}
    else:
        extra = {"voice": voice or SPEECH_VOICE, "language": SPEECH_LANGUAGE, "task_type": SPEECH_TASK,
                 "non_streaming_mode": False}
    if deploy is not None and deploy.sampling.max_tokens is not None:
        extra["max_new_tokens"] = deploy.sampling.max_tokens
    if deploy is not None and deploy.sampling.seed is not None:
        extra["seed"] = deploy.sampling.seed
    return body(model, text, mode="sse" if stream else "none", response_format="pcm" if stream else "wav",
                extra=extra)


def check_model_voices(model: str, prompts: Any) -> str | None:
    """Why ``model`` (a local checkpoint folder) cannot say ``prompts`` in their voices, or None: the release's
    serving layer refuses a task the checkpoint's ``tts_model_type`` is not (a Base checkpoint takes only speaker
    embeddings, a CustomVoice one only speakers) and a speaker embedding of another size than the Talker's hidden
    size. A model that is not a local folder with a ``config.json`` is not checked (its server says)."""
    import json
    from pathlib import Path

    config_path = Path(model) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    kind = str(config.get("tts_model_type") or "").lower().replace("-", "_")
    hidden = (config.get("talker_config") or {}).get("hidden_size")
    base = [(i, p) for i, p in enumerate(prompts.prompts) if p.speaker_embedding is not None]
    if base and kind and kind != "base":
        return (f"{prompts.path}: prompts[{base[0][0]}].speaker_embedding: {model} is a {kind} checkpoint "
                f"({config_path.name}: tts_model_type), which takes no speaker embedding (serve a Base checkpoint, "
                "e.g. tiny-model --family qwen3-tts --variant base)")
    if not base and kind == "base":
        return (f"{prompts.path}: {model} is a Base checkpoint ({config_path.name}: tts_model_type base), which takes "
                "no CustomVoice speaker: give every prompt a speaker_embedding (e.g. --prompts qwen3_tts_base_cpu_smoke)")
    for i, p in base:
        if isinstance(hidden, int) and len(p.speaker_embedding) != hidden:
            return (f"{prompts.path}: prompts[{i}].speaker_embedding: {len(p.speaker_embedding)} values; {model}'s "
                    f"Talker takes {hidden} ({config_path.name}: talker_config.hidden_size)")
    return None


def oracle(codes: list[int]) -> str:
    """The speaking tiny Qwen3-TTS's codec stream read back (``speaking.decode``)."""
    from harness.families.qwen3_tts.speaking import decode

    return decode(codes).text


# ------------------------------------------------------------------------------------------ worker side

_local = threading.local()
_CACHE_SIZE = 64


def _text_of(info: dict[str, Any]) -> str | None:
    text = info.get("text")
    if isinstance(text, list) and text and isinstance(text[0], str):
        return text[0]
    return text if isinstance(text, str) else None


class _Tables:
    """The release builder's prompt and whole ``trailing_text`` per request (float32), built once."""

    def __init__(self) -> None:
        self._by_request: OrderedDict[str, tuple[Any, Any]] = OrderedDict()

    def get(self, view: Any, info: dict[str, Any]) -> tuple[Any, Any]:
        key = f"{info.get('request_id')}|{_text_of(info)}"
        got = self._by_request.get(key)
        if got is None:
            import torch

            task = (info.get("task_type") or ["CustomVoice"])[0]
            with torch.no_grad():
                prompt, trailing, _len, _ref = view._prompt_builder.build_prompt_embeds(task_type=task,
                                                                                        info_dict=dict(info))
            got = (prompt.detach().float().reshape(prompt.shape[-2], -1),
                   trailing.detach().float().reshape(-1, prompt.shape[-1]))
            self._by_request[key] = got
            while len(self._by_request) > _CACHE_SIZE:
                self._by_request.popitem(last=False)
        return got


_tables = _Tables()


def expected_rows(model: Any, info: dict[str, Any], ids: Any, P: int, c: int, n: int) -> tuple[Any, int]:
    """The contract's rows (float32) for positions ``c..c+n-1``, and ``T`` (the ``trailing_text`` rows)."""
    import torch

    from harness.serve.worker_contract import release_view

    view = release_view(model)
    prompt, trailing = _tables.get(view, info)
    device = ids.device
    pad = view._tts_pad_embed.detach().float().reshape(1, -1).to(device)
    rows = pad.expand(n, -1).clone()
    pos = torch.arange(c, c + n, device=device)
    in_prompt = pos < min(P, prompt.shape[0])
    if bool(in_prompt.any()):
        rows[in_prompt] = prompt.to(device)[pos[in_prompt]]
    gen = pos >= P
    if bool(gen.any()):
        k = pos[gen] - P
        text = pad.expand(int(gen.sum()), -1).clone()
        inside = k < trailing.shape[0]
        if bool(inside.any()):
            text[inside] = trailing.to(device)[k[inside]]
        with torch.no_grad():
            codec = view.embed_input_ids(ids.reshape(-1)[gen].reshape(-1, 1).long()).float().reshape(-1, rows.shape[1])
        rows[gen] = codec + text
    return rows, int(trailing.shape[0])


def contract_keys(model: Any, info: dict[str, Any], ids: Any, delivered: Any,
                  past: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """``misaligned_text``/``misaligned_end`` (and ``first_misaligned``) for one request's span, or
    ``contract_error``. ``delivered``: the rows the Talker runs the span with ([n, H]). ``past``: a one-token
    decode's ``(past hidden state handed to the code predictor, the buffer's hidden_states.last before the
    call)``; a decode whose row is right but whose code predictor reads another position's hidden state
    (zeroed, stale, another request's: ``harness.contract.same_hidden``) is a misaligned position too, as on
    the sim."""
    try:
        import torch

        from harness.contract import misaligned_regions, same_hidden
        from harness.serve.worker_contract import ULPS

        P, c = int(info["_omni_prompt_len"]), int(info["_omni_num_computed_tokens"])
        n = int(ids.reshape(-1).shape[0])
        want, T = expected_rows(model, info, ids, P, c, n)
        got = delivered[:n]
        eps = torch.finfo(got.dtype).eps if got.dtype.is_floating_point else 0.0
        got = got.float()
        want = want[: got.shape[0]].to(got.device)
        tol = ULPS * eps * (want.abs() + want.abs().mean(dim=1, keepdim=True))
        close = ((got - want).abs() <= tol).all(dim=1).tolist()
        bad = [c + i for i, ok in enumerate(close) if not ok] + list(range(c + len(close), c + n))
        if past is not None and n == 1 and c >= P and not bad and not same_hidden(*past):
            bad = [c]
        text, end = misaligned_regions(bad, P, T - 1)
        out: dict[str, Any] = {"misaligned_text": text, "misaligned_end": end, "text_len": T - 1}
        if bad:
            out["first_misaligned"] = bad[0]
        return out
    except Exception as exc:  # noqa: BLE001 - the check must never break the server
        return {"contract_error": f"{type(exc).__name__}: {exc}"}


class _One:
    """A batch member's ids as the trace writer sees them: one position, no storage offset (the batch's
    ids are a new tensor, whose offsets say nothing of the step)."""

    shape = (1,)


def wrap(cls: type, writer: Any) -> bool:
    """Trace ``cls.preprocess`` and ``cls.preprocess_decode_batch`` (module docstring); False if done already."""
    from harness.serve.trace_plugin import _MARK, _codec_ids, _safe_record, _warn

    pre = cls.__dict__.get("preprocess") or getattr(cls, "preprocess", None)
    batch = cls.__dict__.get("preprocess_decode_batch") or getattr(cls, "preprocess_decode_batch", None)
    if pre is None or getattr(pre, _MARK, False):
        return False
    failed: list[Any] = []

    def line_keys(model: Any, info: dict[str, Any], ids: Any, delivered: Any,
                  check: bool, past: tuple[Any, Any] | None = None) -> tuple[dict[str, Any], list[Any]]:
        keys: dict[str, Any] = {}
        parts: list[Any] = []
        text = _text_of(info)
        if text is not None:
            keys["tts_text"] = text
        if check and delivered is not None:
            keys.update(contract_keys(model, info, ids, delivered, past))
        got = _codec_ids(info, ids)
        if isinstance(got, dict):
            keys.update(got)
        elif got is not None:
            parts.append(got)
        return keys, parts

    def traced_pre(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "depth", 0):  # called by the batched hook: that call traces the position
            return pre(self, *args, **kwargs)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        input_embeds = kwargs.get("input_embeds", args[1] if len(args) > 1 else None)
        info = flatten_payload(kwargs)
        ids_before = input_ids.clone() if hasattr(input_ids, "clone") else None
        last = _last_hidden(info) if writer.check else None
        try:
            result = pre(self, *args, **kwargs)
        except BaseException as exc:
            _safe_record(writer, info, input_ids, None, f"{type(exc).__name__}: {exc}", failed)
            raise
        delivered = None
        check = writer.check and ids_before is not None
        if check:
            try:
                delivered = _delivered(result, input_embeds, int(ids_before.shape[0]))
            except Exception as exc:  # noqa: BLE001
                check = False
                _warn(f"contract: {type(exc).__name__}: {exc}")
        keys, parts = line_keys(self, info, ids_before, delivered, check, _mtp_past(result, last) if check else None)
        _safe_record(writer, info, input_ids, result, None, failed, keys, parts)
        return result

    def traced_batch(self: Any, *, input_ids: Any, req_infos: list[dict[str, Any]],
                     input_embeds: Any = None) -> Any:
        ids_before = input_ids.reshape(-1).clone()
        lasts = [_last_hidden(flatten_payload(info)) for info in req_infos] if writer.check else []
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            result = batch(self, input_ids=input_ids, req_infos=req_infos, input_embeds=input_embeds)
        except BaseException as exc:
            for info in req_infos:
                _safe_record(writer, flatten_payload(info), _One(), None, f"{type(exc).__name__}: {exc}", failed)
            raise
        finally:
            _local.depth -= 1
        check = writer.check
        embeds, past_hidden, text_step = result[1], result[2], result[3]
        for i, info in enumerate(req_infos):
            info = flatten_payload(info)
            delivered = past = None
            if check:
                delivered = (embeds[i:i + 1].float() + text_step[i:i + 1].float()).to(embeds.dtype)
                past = (past_hidden[i:i + 1], lasts[i])
            keys, parts = line_keys(self, info, ids_before[i:i + 1], delivered, check, past)
            _safe_record(writer, info, _One(), (None, embeds[i:i + 1]), None, failed, keys, parts)
        return result

    for fn, orig in ((traced_pre, pre), (traced_batch, batch)):
        if orig is not None:
            fn.__name__, fn.__qualname__, fn.__doc__ = orig.__name__, orig.__qualname__, orig.__doc__
            fn.__wrapped__ = orig  # type: ignore[attr-defined]
            setattr(fn, _MARK, True)
    cls.preprocess = traced_pre  # type: ignore[attr-defined]
    if batch is not None:
        cls.preprocess_decode_batch = traced_batch  # type: ignore[attr-defined]
    return True


def _last_hidden(info: dict[str, Any]) -> Any:
    """The request's ``hidden_states.last`` before the call (a copy: the hook may replace or write it), None
    if the release's ``postprocess`` has left none yet."""
    hs = info.get("hidden_states")
    last = hs.get("last") if isinstance(hs, dict) else None
    return last.detach().clone() if hasattr(last, "detach") else None


def _mtp_inputs(result: Any) -> tuple[Any, Any] | None:
    """``preprocess``'s ``mtp_inputs`` (past hidden state, text step): a scalar decode's; None for a span that
    hands the code predictor nothing."""
    seq = isinstance(result, (tuple, list)) and len(result) > 2
    update = result[2] if seq and isinstance(result[2], dict) else {}
    mtp = update.get("mtp_inputs")
    return mtp if isinstance(mtp, tuple) and len(mtp) == 2 else None


def _mtp_past(result: Any, last: Any) -> tuple[Any, Any] | None:
    """A scalar decode's ``(mtp_inputs[0], last)``; None for a span that hands the code predictor nothing."""
    mtp = _mtp_inputs(result)
    return None if mtp is None else (mtp[0], last)


def _delivered(result: Any, input_embeds: Any, n: int) -> Any:
    """What the Talker runs the span with: ``req_embeds[:min(n, rows)]`` then the runner's own rows; a
    one-token decode (``mtp_inputs`` in the update) plus its ``text_step``."""
    import torch

    rows = result[1]
    mtp = _mtp_inputs(result)
    if n == 1 and mtp is not None:
        return (rows[:1].float() + mtp[1].reshape(1, -1).float()).to(rows.dtype)
    seg = min(n, int(rows.shape[0]))
    parts = [rows[:seg]]
    if seg < n and isinstance(input_embeds, torch.Tensor) and input_embeds.shape[0] >= n:
        parts.append(input_embeds[seg:n].to(rows.dtype))
    return torch.cat(parts, dim=0)


def server_env() -> dict[str, str]:
    """What the Talker worker's environment adds for this family: the hook the arm binds and the wrapper."""
    from harness.serve.arm_binding import ENV_HOOK
    from harness.serve.trace_plugin import ENV_WRAPPER

    return {ENV_HOOK: HOOK, ENV_WRAPPER: WRAPPER}

