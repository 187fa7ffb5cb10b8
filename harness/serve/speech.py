"""Client for ``/v1/audio/speech`` (the API Qwen3-TTS users call): one request sent, its body read as it
arrives, every read stamped with ``time.perf_counter()``, and the stream metrics of what arrived.

Why here and not in the chat client: the speech API has three envelopes (whole body, SSE
``speech.audio.delta`` events, raw audio bytes; ``harness.serve.streaming``) and no Thinker text; a
Qwen3-TTS real backend sends its prompts through ``send_speech`` / ``send_all`` and puts
``SpeechResult.metrics`` into its records with ``harness.serve.backend.stream_fields``, as the
Qwen2.5-Omni backend does with its streamed chat completions.

A request that is not streamed (``mode="none"``) is measured the same way: its body arrives whole
(one or a few reads at the end), so its TTFA is close to its end and its gaps are the network's.

``python -m harness.serve.speech URL TEXT [--mode sse|audio|none] [--format pcm|wav] [--rate HZ]
[--model M] [--wav OUT]`` sends one request and prints the metrics as JSON (exit 2 on bad input or a
failed request, with one line saying why).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.serve.netstamp import StreamStalled, arrival, pieces, stamping_transport
from harness.serve.streaming import (QWEN3_TTS_SAMPLE_RATE, SPEECH_FORMATS, SPEECH_MODES, SPEECH_PATH,
                                     SpeechStream, StreamFormatError, speech_body)
from harness.stream_metrics import StreamError, StreamMetrics


@dataclass
class SpeechResult:
    """One speech request: its metrics and WAV when it answered, else the error (never raised)."""

    mode: str
    status: int | None = None
    error: str | None = None
    metrics: StreamMetrics | None = None
    wav: bytes | None = None  # the PCM received, as a WAV file
    deltas: int | None = None  # mode sse: speech.audio.delta events
    usage: dict[str, Any] | None = None  # mode sse: speech.audio.done's usage
    attempts: list[dict[str, Any]] = field(default_factory=list)
    sent_at: float | None = None  # ``perf_counter()`` at the send: the clock of the chunks' arrivals (not recorded)

    def summary(self) -> dict[str, Any]:
        """The metrics as JSON-ready numbers (what the command prints)."""
        m = self.metrics
        out: dict[str, Any] = {"mode": self.mode, "status": self.status, "error": self.error}
        if m is not None:
            out.update(ttfa_s=m.ttfa_s, end_s=m.end_s, chunks=m.chunks, frames=m.frames, sample_rate=m.sample_rate,
                       audio_s=m.audio_s, rtf=m.rtf, gaps_s=list(m.gaps_s),
                       underruns=[[u.start_s, u.length_s] for u in m.underruns], underrun_s=m.underrun_s)
        if self.deltas is not None:
            out["deltas"] = self.deltas
        return out


async def send_speech(client: httpx.AsyncClient, base_url: str, body: dict[str, Any], *, timeout_s: float,
                      pcm_rate: int = QWEN3_TTS_SAMPLE_RATE, pcm_channels: int = 1,
                      request_id: str | None = None, stall_s: float = 0.0) -> SpeechResult:
    """POST ``body`` (``streaming.speech_body``) to ``base_url`` + ``/v1/audio/speech``; ``pcm_rate``:
    the rate of a ``pcm`` response (the wire does not say it); ``request_id``: sent as ``X-Request-Id``
    (a trace matches its lines by it). Errors are recorded, not raised."""
    mode = "audio" if body.get("stream_format") == "audio" else "sse" if body.get("stream") else "none"
    fmt = str(body.get("response_format", "wav"))
    result = SpeechResult(mode=mode)
    if fmt not in SPEECH_FORMATS:
        result.error = f"response_format {fmt!r}: only {' and '.join(SPEECH_FORMATS)} can be measured"
        return result
    stream = SpeechStream(mode=mode, response_format=fmt, pcm_rate=pcm_rate, pcm_channels=pcm_channels)
    url = base_url.rstrip("/") + SPEECH_PATH

    async def read() -> tuple[float, float]:
        sent = time.perf_counter()
        headers = {"X-Request-Id": request_id} if request_id else None
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                detail = raw[:300].decode("utf-8", errors="replace").strip()
                try:
                    err = json.loads(raw).get("error")
                    detail = str(err.get("message") if isinstance(err, dict) else err or detail)[:300]
                except (json.JSONDecodeError, AttributeError, ValueError):
                    pass
                raise StreamFormatError(f"HTTP {resp.status_code}: {detail}")
            async for piece in pieces(resp, stall_s):
                stream.feed(piece, arrival(resp) or time.perf_counter())  # when the loop received it
        return sent, time.perf_counter()

    try:
        sent, end = await asyncio.wait_for(read(), timeout=timeout_s)
        result.sent_at = sent
        stream.finish()
        if stream.audio.format is None or not stream.audio.pcm:
            raise StreamFormatError("the response has no audio")
        result.metrics = stream.audio.metrics(sent, end)
        result.wav = stream.audio.wav()
    except (StreamFormatError, StreamError, StreamStalled) as exc:
        result.error = str(exc)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        result.error = f"timed out after {timeout_s:g} s (request timeout)"
    except httpx.TransportError as exc:
        result.error = f"{type(exc).__name__}: {exc or 'connection failed'}"
    if mode == "sse":
        result.deltas, result.usage = stream.deltas, stream.usage
    return result


async def send_all(base_url: str, bodies: list[dict[str, Any]], *, timeout_s: float,
                   pcm_rate: int = QWEN3_TTS_SAMPLE_RATE) -> list[SpeechResult]:
    """Every body in flight at once (the Talker batches only what reaches it together), results in order."""
    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=0)  # as run_requests: no
    # idle connection kept (httpcore's pool costs O(N^2) per response end with N idle ones)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(timeout_s + 5.0, connect=10.0),
                                 transport=stamping_transport(limits)) as client:
        return list(await asyncio.gather(*(send_speech(client, base_url, b, timeout_s=timeout_s, pcm_rate=pcm_rate)
                                           for b in bodies)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.serve.speech",
                                     description="Send one /v1/audio/speech request and print its stream metrics.")
    parser.add_argument("url", help="server base URL, http://127.0.0.1:PORT")
    parser.add_argument("text")
    parser.add_argument("--mode", choices=SPEECH_MODES, default="sse")
    parser.add_argument("--format", dest="response_format", choices=SPEECH_FORMATS, default="pcm")
    parser.add_argument("--rate", type=int, default=QWEN3_TTS_SAMPLE_RATE, help="sample rate of a pcm response")
    parser.add_argument("--model", default=None)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--wav", type=Path, default=None, help="write the audio received here")
    args = parser.parse_args(argv)
    if not args.url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        print(f"omni-stress: {args.url}: only a server on this machine (http://127.0.0.1:PORT) is measured",
              file=sys.stderr)
        return 2
    if args.rate <= 0 or not args.timeout > 0:
        print("omni-stress: --rate and --timeout must be positive", file=sys.stderr)
        return 2
    body = speech_body(args.model or "", args.text, mode=args.mode, response_format=args.response_format)
    if args.model is None:
        body.pop("model")
    result = asyncio.run(send_all(args.url, [body], timeout_s=args.timeout, pcm_rate=args.rate))[0]
    print(json.dumps(result.summary(), sort_keys=True))
    if result.error is not None:
        print(f"omni-stress: {args.url}{SPEECH_PATH}: {result.error}", file=sys.stderr)
        return 2
    if args.wav is not None and result.wav is not None:
        args.wav.write_bytes(result.wav)
    return 0


if __name__ == "__main__":
    sys.exit(main())
