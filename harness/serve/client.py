"""Async OpenAI chat-completions client for vLLM-Omni: every prompt in flight at once.

Why all at once: the Talker only batches (up to its ``max_num_seqs``) and only preempts under the
stress deploy if several requests reach it together; the seed sent its 16 prompts concurrently.

Request format (vllm-omni 0.30.0, ``entrypoints/openai/serving_chat.py``):

* ``modalities: ["text", "audio"]`` is checked against the engine's output modalities.
* ``sampling_params_list`` is read with ``hasattr(request, "sampling_params_list")`` (vLLM's
  ``OpenAIBaseModel`` keeps extra fields) and each dict becomes ``SamplingParams(**dict)`` in
  ``_to_sampling_params_list``, one per stage (0 Thinker, 1 Talker, 2 Code2Wav); the pipeline's
  ``sampling_constraints`` (Talker ``stop_token_ids: [8294]``, ``detokenize``) are merged on top by
  ``entrypoints/omni_base.py: resolve_sampling_params_list``. The values mirror
  ``vllm_omni/deploy/qwen2_5_omni.yaml`` ``default_sampling_params`` except the seed's settings:
  Thinker ``max_tokens`` 80 (greedy), Talker from the deploy's ``sampling:`` (temperature 0.9,
  top-p 0.8, top-k 40, seed 42, max 1900). Code2Wav gets the deploy YAML's defaults verbatim.
* The request id comes from the ``X-Request-Id`` header (vLLM ``_base_request_id``; also sent as the
  body's ``request_id``); the response id is ``chatcmpl-<id>`` and the engines derive their internal
  request ids from it, which is how Talker trace lines are matched to prompts (``tag``).

Response format: non-streaming, the audio is base64 WAV (``DEFAULT_AUDIO_FORMAT = "wav"``,
``protocol/audio.py``) in ``choices[i].message.audio.data``. 0.30.0 merges it into the text choice of
the same index (``_merge_audio_choices``, #7376); older builds return a separate audio choice, so
the text is the first non-empty ``message.content`` and the audio the first ``message.audio.data``.
Streamed (``stream: true``, ``run --stream``): SSE ``chat.completion.chunk`` objects whose ``modality``
says whether ``choices[i].delta.content`` is Thinker text or a base64 WAV of audio
(``harness.serve.streaming``); each read is stamped as it arrives and the audio chunks' PCM is joined
into the request's WAV.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import re
import time
import uuid
import wave
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.config import MAX_REPLY_TOKENS, Deploy, LoadSettings, Prompt, PromptSet
from harness.serve.netstamp import StreamStalled, arrival, pieces, stamping_transport
from harness.serve.streaming import ChatStream, SSEParser, StreamFormatError
from harness.stream_metrics import StreamError, StreamMetrics

# vllm_omni/deploy/qwen2_5_omni.yaml (0.30.0) default_sampling_params, stage by stage.
THINKER_DEFAULTS: dict[str, Any] = {
    "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 2048, "seed": 42, "repetition_penalty": 1.1,
}
TALKER_DEFAULTS: dict[str, Any] = {
    "temperature": 0.9, "top_p": 0.8, "top_k": 40, "max_tokens": 2048, "seed": 42, "repetition_penalty": 1.05,
}
CODE2WAV_DEFAULTS: dict[str, Any] = {
    "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 2048, "seed": 42, "repetition_penalty": 1.1,
}


class ResponseError(Exception):
    """The server answered, but not with a usable chat completion (per-request error, never retried)."""


def sampling_params_list(deploy: Deploy, reply: str | None = None) -> list[dict[str, Any]]:
    """Per-stage sampling: Thinker greedy <= 80 tokens, Talker from ``deploy.sampling``, Code2Wav defaults.

    ``reply``: the Thinker's scripted reply for a speaking tiny checkpoint, read by its stage-0 logits
    processor (``harness.serve.reply_forcer``) from ``extra_args``."""
    s = deploy.sampling
    thinker = {**THINKER_DEFAULTS, "temperature": 0.0, "max_tokens": MAX_REPLY_TOKENS, "detokenize": True}
    if reply is not None:
        thinker["extra_args"] = {"omni_stress_reply": reply}
    talker = {
        **TALKER_DEFAULTS,
        "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
        "max_tokens": s.max_tokens, "detokenize": True,
    }
    return [thinker, talker, {**CODE2WAV_DEFAULTS, "detokenize": True}]


def make_tag(prompt_id: str) -> str:
    """A request id unique per request; the 32-hex token is what trace lines are matched on."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", prompt_id)[:48]
    return f"omni-stress-{safe}-{uuid.uuid4().hex}"


def tag_token(tag: str) -> str:
    return tag.rsplit("-", 1)[-1]


def build_body(model: str, prompts: PromptSet, prompt: Prompt, deploy: Deploy, tag: str,
               speaking: bool = False, stream: bool = False) -> dict[str, Any]:
    """The chat request; ``stream``: SSE chunks, the audio measured as it arrives (``harness.serve.streaming``)."""
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": prompts.system_prompt}]},
            {"role": "user", "content": [{"type": "text", "text": prompt.user}]},
        ],
        "modalities": ["text", "audio"],
        "sampling_params_list": sampling_params_list(deploy, prompt.reply if speaking else None),
        "stream": stream,
        "request_id": tag,
    }


@dataclass
class ParsedResponse:
    text: str
    audio: bytes
    finish_reason: str | None
    response_id: str | None
    stream: StreamMetrics | None = None  # a streamed response: its measured arrival of audio
    audio_events: int | None = None  # a streamed response: the audio chunks the server sent
    stream_sent_at: float | None = None  # a streamed response: ``perf_counter()`` at its send (not recorded)


def parse_response(raw: bytes) -> ParsedResponse:
    """Thinker text and WAV bytes out of a chat-completion body; ``ResponseError`` says what is wrong."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        snippet = raw[:120].decode("utf-8", errors="replace")
        raise ResponseError(f"malformed response body (not JSON: {exc.msg if hasattr(exc, 'msg') else exc}): {snippet!r}") from None
    if not isinstance(data, dict):
        raise ResponseError(f"malformed response body: expected a JSON object, got {type(data).__name__}")
    if "error" in data and data.get("error"):
        err = data["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        raise ResponseError(f"server error: {msg}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ResponseError("malformed response body: no choices")
    text: str | None = None
    audio_b64: str | None = None
    finish: str | None = None
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if text is None and isinstance(content, str) and content.strip():
            text = content
            finish = choice.get("finish_reason")
        audio = message.get("audio")
        if audio_b64 is None and isinstance(audio, dict) and isinstance(audio.get("data"), str):
            audio_b64 = audio["data"]
    if text is None:
        raise ResponseError("response has no Thinker text (choices[].message.content)")
    if audio_b64 is None:
        raise ResponseError("response has no audio (choices[].message.audio.data)")
    try:
        audio_bytes = base64.b64decode(audio_b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ResponseError(f"undecodable audio: choices[].message.audio.data is not base64 ({exc})") from None
    return ParsedResponse(text=text, audio=audio_bytes, finish_reason=finish,
                          response_id=data.get("id") if isinstance(data.get("id"), str) else None)


def wav_seconds(data: bytes) -> float:
    """Duration of a WAV; ``ResponseError`` if it is not one."""
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            rate = w.getframerate()
            frames = w.getnframes()
    except (wave.Error, EOFError) as exc:
        raise ResponseError(f"undecodable audio: not a WAV file ({exc})") from None
    if rate <= 0:
        raise ResponseError("undecodable audio: WAV with sample rate 0")
    return frames / rate


@dataclass
class RequestSpec:
    prompt_id: str
    tag: str
    body: dict[str, Any]
    audio_file: Path  # absolute path to write the WAV to


@dataclass
class ChatResult:
    prompt_id: str
    tag: str
    thinker_text: str | None = None
    audio_file: Path | None = None
    audio_seconds: float | None = None
    finish_reason: str | None = None
    response_id: str | None = None
    error: str | None = None
    wall_s: float = 0.0
    attempts: list[dict[str, Any]] = field(default_factory=list)
    # Wall-clock (``time.time()``, the clock the server's Talker trace stamps its calls with) at the
    # request's first send and at the start of the attempt that answered: time to the first codec token.
    sent_at: float | None = None
    answered_attempt_at: float | None = None
    # The server died before this request was sent (a paced load holds requests back): it may be sent
    # again to a restarted server, so it is not a result of this server.
    not_sent: bool = False
    # A streamed request (``stream: true``): the audio's arrival as measured by the attempt that answered.
    stream: StreamMetrics | None = None
    audio_events: int | None = None
    # ``perf_counter()`` at that attempt's send: ``stream``'s times are seconds since it. Not recorded;
    # the client-capacity bench (bench/client_capacity.py) puts the arrivals back on the machine's clock.
    stream_sent_at: float | None = None


class ServerGone(Exception):
    """The server process exited while requests were in flight."""


def attempt_id(tag: str, attempt: int) -> str:
    """A retry gets its own request id (vLLM refuses a duplicate id still running); it keeps the tag's token."""
    return tag if attempt == 1 else f"{tag}-a{attempt}"


async def _one_attempt(client: httpx.AsyncClient, url: str, spec: RequestSpec, timeout_s: float,
                       attempt: int, stall_s: float = 0.0) -> ParsedResponse:
    rid = attempt_id(spec.tag, attempt)
    body = spec.body if rid == spec.body.get("request_id") else {**spec.body, "request_id": rid}
    resp = await asyncio.wait_for(client.post(url, json=body, headers={"X-Request-Id": rid}), timeout=timeout_s)
    if resp.status_code != 200:
        detail = resp.text[:300].strip()
        try:
            err = resp.json().get("error")
            if isinstance(err, dict) and err.get("message"):
                detail = str(err["message"])[:300]
        except (json.JSONDecodeError, AttributeError, ValueError):
            pass
        raise _HttpStatus(resp.status_code, detail)
    return parse_response(resp.content)


async def _one_stream_attempt(client: httpx.AsyncClient, url: str, spec: RequestSpec, timeout_s: float,
                              attempt: int, stall_s: float = 0.0) -> ParsedResponse:
    """One ``stream: true`` attempt: every read of the body stamped with ``perf_counter`` as it
    arrives, its SSE chunks parsed (``harness.serve.streaming.ChatStream``), the audio chunks' PCM
    joined into one WAV; the stream metrics run from this attempt's send to the body's last byte."""
    rid = attempt_id(spec.tag, attempt)
    body = spec.body if rid == spec.body.get("request_id") else {**spec.body, "request_id": rid}
    audio_opts = body.get("audio") if isinstance(body.get("audio"), dict) else {}
    chat = ChatStream(requested_format=str(audio_opts.get("format") or "wav"))
    parser = SSEParser()

    async def read() -> tuple[float, float]:
        sent = time.perf_counter()
        async with client.stream("POST", url, json=body, headers={"X-Request-Id": rid}) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                detail = raw[:300].decode("utf-8", errors="replace").strip()
                try:
                    err = json.loads(raw).get("error")
                    if isinstance(err, dict) and err.get("message"):
                        detail = str(err["message"])[:300]
                except (json.JSONDecodeError, AttributeError, ValueError):
                    pass
                raise _HttpStatus(resp.status_code, detail)
            async for piece in pieces(resp, stall_s):
                at = arrival(resp) or time.perf_counter()  # when the loop received it (harness.serve.netstamp)
                for event in parser.feed(piece):
                    chat.event(event, at)
        return sent, time.perf_counter()

    try:
        sent, end = await asyncio.wait_for(read(), timeout=timeout_s)
        parser.close()
        if not chat.done:
            raise ResponseError("the stream ended without data: [DONE] (cut short)")
        if not chat.thinker_text.strip():
            raise ResponseError("the stream has no Thinker text (text chunks' choices[].delta.content)")
        if chat.audio.format is None or not chat.audio.pcm:
            raise ResponseError(f"the stream has no audio ({chat.audio_events} audio chunks, none with frames)")
        metrics = chat.audio.metrics(sent, end)
    except (StreamFormatError, StreamError) as exc:
        raise ResponseError(f"malformed stream: {exc}") from None
    except StreamStalled as exc:
        raise ResponseError(str(exc)) from None
    return ParsedResponse(text=chat.thinker_text, audio=chat.audio.wav(), finish_reason=chat.finish_reason,
                          response_id=chat.response_id, stream=metrics, audio_events=chat.audio_events,
                          stream_sent_at=sent)


async def _one_speech_attempt(client: httpx.AsyncClient, url: str, spec: RequestSpec, timeout_s: float,
                              attempt: int, stall_s: float = 0.0) -> ParsedResponse:
    """One ``/v1/audio/speech`` attempt (Qwen3-TTS), sent and measured by the speech client
    (``harness.serve.speech.send_speech``: whole WAV, or ``stream: true`` PCM chunks stamped as they
    arrive). The text said is the request's ``input`` (the WER reference); a streamed answer's
    metrics ride along as a chat stream's do."""
    from harness.serve.speech import send_speech
    from harness.serve.streaming import SPEECH_PATH

    rid = attempt_id(spec.tag, attempt)
    result = await send_speech(client, url[: -len(SPEECH_PATH)], spec.body, timeout_s=timeout_s, request_id=rid,
                               stall_s=stall_s)
    if result.error is not None:
        if result.status is not None and result.status != 200:
            raise _HttpStatus(result.status, result.error.removeprefix(f"HTTP {result.status}: "))
        if result.error.startswith("timed out"):
            raise asyncio.TimeoutError()
        raise ResponseError(result.error)
    assert result.wav is not None and result.metrics is not None
    streamed = spec.body.get("stream") is True
    return ParsedResponse(text=str(spec.body.get("input", "")), audio=result.wav, finish_reason=None, response_id=None,
                          stream=result.metrics if streamed else None,
                          audio_events=result.deltas if streamed else None,
                          stream_sent_at=result.sent_at if streamed else None)


class _HttpStatus(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


def _retriable(exc: BaseException) -> bool:
    if isinstance(exc, _HttpStatus):
        return exc.status >= 500 or exc.status == 429
    # transport failures (connection refused/reset); not timeouts: a timed-out request may still be
    # generating on the server, and sending it again would change the load being measured
    return isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException)


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, (asyncio.TimeoutError, httpx.TimeoutException)):
        return f"timed out after {timeout_s:g} s (request timeout)"
    if isinstance(exc, httpx.TransportError):
        return f"{type(exc).__name__}: {exc or 'connection failed'}"
    return str(exc) or type(exc).__name__


@dataclass
class _Sender:
    """One request, sent and retried: the answer's audio written to its file, every attempt noted."""

    client: httpx.AsyncClient
    url: str
    request_timeout_s: float
    retries: int
    server_alive: Callable[[], bool]
    server_gone_message: Callable[[], str]
    retry_backoff_s: float
    stall_timeout_s: float = 0.0

    async def send(self, spec: RequestSpec) -> ChatResult:
        res = ChatResult(prompt_id=spec.prompt_id, tag=spec.tag)
        t0 = time.monotonic()
        res.sent_at = time.time()
        for attempt in range(1, self.retries + 2):
            a0 = time.monotonic()
            a0_wall = time.time()
            try:
                one = (_one_speech_attempt if self.url.endswith("/v1/audio/speech") else
                       _one_stream_attempt if spec.body.get("stream") is True else _one_attempt)
                parsed = await one(self.client, self.url, spec, self.request_timeout_s, attempt,
                                   stall_s=self.stall_timeout_s)
                self._answered(res, spec, parsed, a0_wall)
                res.attempts.append({"attempt": attempt, "request_id": attempt_id(spec.tag, attempt), "ok": True,
                                     "wall_s": round(time.monotonic() - a0, 3)})
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded per request
                res.error = _describe(exc, self.request_timeout_s)
                res.attempts.append({"attempt": attempt, "request_id": attempt_id(spec.tag, attempt), "ok": False,
                                     "error": res.error,
                                     "wall_s": round(time.monotonic() - a0, 3)})
                if not self.server_alive():
                    res.error = self.server_gone_message()
                    break
                if attempt > self.retries or not _retriable(exc):
                    break
                await asyncio.sleep(self.retry_backoff_s * attempt)
        if res.error is not None and len(res.attempts) > 1:
            res.error = f"{res.error} (after {len(res.attempts)} attempts)"
        res.wall_s = time.monotonic() - t0
        return res

    @staticmethod
    def _answered(res: ChatResult, spec: RequestSpec, parsed: Any, attempt_wall: float) -> None:
        seconds = wav_seconds(parsed.audio)
        spec.audio_file.parent.mkdir(parents=True, exist_ok=True)
        spec.audio_file.write_bytes(parsed.audio)
        res.thinker_text = parsed.text
        res.audio_file = spec.audio_file
        res.audio_seconds = seconds
        res.finish_reason = parsed.finish_reason
        res.response_id = parsed.response_id
        res.error = None
        res.answered_attempt_at = attempt_wall
        res.stream, res.audio_events, res.stream_sent_at = parsed.stream, parsed.audio_events, parsed.stream_sent_at


async def _collect(tasks: dict[asyncio.Future, RequestSpec], on_result: Callable[[ChatResult], None],
                   server_alive: Callable[[], bool], server_gone_message: Callable[[], str],
                   watch_interval_s: float, started: set[str] | None = None) -> dict[str, ChatResult]:
    """Each task's result handed to ``on_result`` as it finishes; if the server dies, the tasks still
    in flight are cancelled (after a grace interval for responses already on the wire) and their
    requests get ``server_gone_message()``; those whose prompt id is not in ``started`` (never sent)
    are marked ``not_sent``."""
    results: dict[str, ChatResult] = {}
    t_start = time.monotonic()
    pending = set(tasks)

    async def watchdog() -> None:
        while True:
            await asyncio.sleep(watch_interval_s)
            if not server_alive():
                # let responses already on the wire land, then give up on the rest
                await asyncio.sleep(watch_interval_s)
                for t in list(pending):
                    t.cancel()
                return

    dog = asyncio.ensure_future(watchdog())
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                pending.discard(task)
                spec = tasks[task]
                if task.cancelled():
                    res = ChatResult(prompt_id=spec.prompt_id, tag=spec.tag, error=server_gone_message(),
                                     wall_s=time.monotonic() - t_start,
                                     not_sent=started is not None and spec.prompt_id not in started)
                else:
                    res = task.result()
                results[spec.prompt_id] = res
                on_result(res)
    finally:
        dog.cancel()
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    return results


async def run_requests(
    base_url: str,
    specs: list[RequestSpec],
    *,
    request_timeout_s: float,
    retries: int,
    on_result: Callable[[ChatResult], None],
    stall_timeout_s: float = 0.0,
    server_alive: Callable[[], bool] = lambda: True,
    server_gone_message: Callable[[], str] = lambda: "server exited",
    retry_backoff_s: float = 1.0,
    watch_interval_s: float = 0.5,
    load: LoadSettings | None = None,
    seed: int = 0,
    path: str = "/v1/chat/completions",
) -> list[ChatResult]:
    """Send every spec at once (or as ``load`` says: at most ``concurrency`` in flight, or at seeded
    exponential gaps of mean ``1 / rate`` seconds; ``harness.serve.load``); ``on_result`` is called
    (in this thread) as each finishes. A result's ``wall_s`` runs from its send: the end-to-end latency.

    A request never raises out of here: its error is recorded in its result. If the server process
    dies, the requests still in flight are cancelled and get ``server_gone_message()``; the ones the
    load had not sent yet are marked ``not_sent`` (the caller may send them to a restarted server).
    """
    url = base_url.rstrip("/") + path  # the family's request API (harness.family.Family.request_api)
    # No idle connection is kept: a request's connection closes when its response ends. httpcore 1.0's
    # pool walks every connection for each idle one whenever a response ends, so N idle connections cost
    # O(N^2) per response at the end of N streams, stalling the reads (and the stamps) of the streams still
    # running (bench/client_capacity.py: seconds of CPU at 256 streams). A run's requests are sent once each.
    limits = httpx.Limits(max_connections=len(specs) + 4, max_keepalive_connections=0)
    timeout = httpx.Timeout(request_timeout_s + 5.0, connect=10.0)

    from harness.serve.load import ClientLoad

    pacing = ClientLoad(load, len(specs), seed)
    async with httpx.AsyncClient(trust_env=False, timeout=timeout, transport=stamping_transport(limits)) as client:
        sender = _Sender(client, url, request_timeout_s, retries, server_alive, server_gone_message, retry_backoff_s,
                         stall_timeout_s)

        started: set[str] = set()

        async def one(spec: RequestSpec, index: int) -> ChatResult:
            async with pacing.slot(index):
                if not server_alive():  # held back by the load until the server died: never sent
                    return ChatResult(prompt_id=spec.prompt_id, tag=spec.tag, error=server_gone_message(),
                                      not_sent=True)
                started.add(spec.prompt_id)
                return await sender.send(spec)

        tasks = {asyncio.ensure_future(one(spec, i)): spec for i, spec in enumerate(specs)}
        results = await _collect(tasks, on_result, server_alive, server_gone_message, watch_interval_s, started)
    return [results[s.prompt_id] for s in specs if s.prompt_id in results]
