"""Reading streamed audio off the wire: server-sent events, WAV and raw PCM pieces, each stamped with
``time.perf_counter()`` as the client reads it (``harness.stream_metrics`` turns the stamps into TTFA,
gaps, underruns and RTF).

Why its own module: two APIs stream audio in different envelopes (vLLM-Omni 0.30.0, read from
``entrypoints/openai/serving_chat.py`` and ``serving_speech.py``; docs/streaming.md), and both end in
the same timeline of (arrival, PCM bytes):

* ``/v1/chat/completions`` with ``stream: true`` (Qwen2.5-Omni): SSE ``data:`` lines of
  ``chat.completion.chunk`` objects ending with ``data: [DONE]``. Each carries ``modality``
  (``"text"`` or ``"audio"``); an audio chunk's ``choices[i].delta.content`` is base64 of one whole
  audio file in the request's ``audio.format`` (default ``wav``: every chunk a WAV with its own
  header; ``pcm``: raw 16-bit PCM), with ``choices[i].audio_metadata`` (``format``,
  ``sample_rate_hz``, ``frame_count``, ``channels``). Text chunks carry the Thinker's text deltas in
  the same field. An error mid-stream is a ``data:`` object with ``error``.
* ``/v1/audio/speech`` (Qwen3-TTS and the other TTS models): ``stream: false`` returns the audio
  whole (``response_format`` wav or pcm); ``stream: true`` (or ``stream_format: "sse"``) sends SSE
  events ``speech.audio.delta`` (``{"audio": base64, "response_format"}``), then ``speech.audio.done``
  (with ``usage``) or ``speech.audio.error``; ``stream_format: "audio"`` sends the raw bytes as
  Code2Wav decodes them (a WAV stream starts with a 44-byte header whose sizes are 0xFFFFFFFF).
  Streaming needs ``response_format`` pcm or wav. PCM is 16-bit little-endian; its rate is not on
  the wire (the model's native rate, 24000 Hz for Qwen3-TTS, unless the request's ``sample_rate``
  asks for another), so the caller names it.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import struct
import wave
from dataclasses import dataclass, field
from typing import Any

from harness.stream_metrics import Chunk, StreamMetrics, frames_of, stream_metrics


class StreamFormatError(ValueError):
    """What arrived is not the stream the API describes (one line naming what is wrong)."""


# ---------------------------------------------------------------------------- server-sent events


@dataclass(frozen=True)
class SSEEvent:
    event: str  # "message" unless the server named it
    data: str


# The largest SSE event the client reads (its lines and data): a speech delta or a chat audio chunk is one
# base64 audio piece, about 1.9 MB for 30 s of 24 kHz PCM when the whole answer comes in one chunk
# (async_chunk: false); 64 MiB is 34 times that. A server that sends more without ending the event is broken.
MAX_SSE_EVENT_BYTES = 64 << 20


class SSEParser:
    """Incremental ``text/event-stream`` parser (the WHATWG rules the two APIs use: ``event:``,
    ``data:`` lines joined by newlines, ``:`` comments, a blank line dispatches; LF, CRLF or CR line
    ends, split anywhere across reads). ``feed`` returns the events completed by the bytes given."""

    def __init__(self, max_event_bytes: int = 0) -> None:
        self._buf = b""
        self._more: list[bytes] = []  # reads without a line end, after _buf: joined once a line ends
        self._size = 0  # bytes of the event being read (its lines so far and the pending line)
        self._event = ""
        self._data: list[str] = []
        self.max_event_bytes = max_event_bytes or MAX_SSE_EVENT_BYTES

    def feed(self, data: bytes) -> list[SSEEvent]:
        # Line ends found with bytes.find and the rest kept once per read: a base64 audio line is
        # kilobytes long, and this runs on the stamping path of every stream (bench/client_capacity.py).
        # A read with no line end is only kept (joined once its line ends): a line sent in many reads is
        # not copied again at each one. An event larger than ``max_event_bytes`` is refused (a server
        # that never ends a line would otherwise fill the memory).
        self._size += len(data)
        if self._size > self.max_event_bytes:
            raise StreamFormatError(f"oversized SSE event: over {self.max_event_bytes} bytes without its end "
                                    f"(the client's bound, MAX_SSE_EVENT_BYTES)")
        if self._buf and b"\n" not in data and b"\r" not in data:
            self._more.append(data)
            return []
        if self._more:
            self._buf, self._more = b"".join([self._buf, *self._more]), []
        buf = self._buf + data if self._buf else data
        out: list[SSEEvent] = []
        pos = 0
        while True:
            cut = _line_end(buf, pos)
            if cut is None:
                break
            end, after = cut
            event = self._line(buf[pos:end].decode("utf-8", errors="replace"))
            pos = after
            if event is not None:
                out.append(event)
                self._size = len(buf) - pos  # the next event starts here
        self._buf = buf[pos:]
        return out

    def close(self) -> list[SSEEvent]:
        """The stream ended: a last line without its line end still counts; an event without the
        blank line that dispatches it is dropped (as a browser does)."""
        if self._more:
            self._buf, self._more = b"".join([self._buf, *self._more]), []
        if self._buf:
            self._line(self._buf.decode("utf-8", errors="replace"))
            self._buf = b""
        self._event, self._data = "", []
        return []

    @property
    def pending(self) -> bool:
        """Bytes or fields of an event not dispatched yet (a stream cut short)."""
        return bool(self._buf.strip() or any(p.strip() for p in self._more) or self._data)

    def _line(self, line: str) -> SSEEvent | None:
        if line == "":
            if not self._data:
                self._event = ""
                return None
            event = SSEEvent(self._event or "message", "\n".join(self._data))
            self._event, self._data = "", []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None


def _line_end(buf: bytes, start: int = 0) -> tuple[int, int] | None:
    """The first complete line from ``start``: (its end, where the next line starts); a CR at the very
    end waits for a possible LF."""
    lf = buf.find(b"\n", start)
    cr = buf.find(b"\r", start, len(buf) if lf < 0 else lf)
    if cr >= 0:
        if cr + 1 == len(buf):
            return None
        return cr, cr + 2 if buf[cr + 1] == 0x0A else cr + 1
    if lf >= 0:
        return lf, lf + 1
    return None


# ---------------------------------------------------------------------------- WAV and PCM


@dataclass(frozen=True)
class PcmFormat:
    sample_rate: int
    channels: int = 1
    sample_width: int = 2  # bytes per sample (16-bit PCM)

    @property
    def frame_bytes(self) -> int:
        return self.channels * self.sample_width


class WavStreamReader:
    """A WAV arriving in pieces: the header is read once it is whole (RIFF, ``fmt ``, any other chunks,
    then ``data``; a streamed header's sizes are 0xFFFFFFFF), after which every byte is PCM.
    ``feed`` returns the PCM bytes the piece completed (empty while the header is incomplete)."""

    def __init__(self) -> None:
        self._buf = b""
        self.format: PcmFormat | None = None
        self._data_left: int | None = None  # bytes of the data chunk still expected (None: to the end)

    def feed(self, data: bytes) -> bytes:
        if self.format is not None:
            return self._take(data)
        self._buf += data
        parsed = _parse_header(self._buf)
        if parsed is None:
            return b""
        self.format, start, size = parsed
        self._data_left = None if size in (0xFFFFFFFF, 0) else size
        rest, self._buf = self._buf[start:], b""
        return self._take(rest)

    def _take(self, data: bytes) -> bytes:
        if self._data_left is None:
            return data
        out = data[:self._data_left]
        self._data_left -= len(out)
        return out

    @property
    def header_complete(self) -> bool:
        return self.format is not None


def _parse_header(buf: bytes) -> tuple[PcmFormat, int, int] | None:
    """(format, offset of the PCM, size of the data chunk) once ``buf`` holds the whole header."""
    if len(buf) < 12:
        if not b"RIFF".startswith(buf[:4]):
            raise StreamFormatError(f"not a WAV stream (starts with {buf[:4]!r}, not b'RIFF')")
        return None
    if buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
        raise StreamFormatError(f"not a WAV stream (starts with {buf[:12]!r})")
    pos, fmt = 12, None
    while True:
        if len(buf) < pos + 8:
            return None
        cid, size = buf[pos:pos + 4], struct.unpack("<I", buf[pos + 4:pos + 8])[0]
        if cid == b"data":
            if fmt is None:
                raise StreamFormatError("WAV stream: data chunk before its fmt chunk")
            return fmt, pos + 8, size
        if len(buf) < pos + 8 + size:
            return None
        if cid == b"fmt ":
            if size < 16:
                raise StreamFormatError(f"WAV stream: fmt chunk of {size} bytes")
            tag, channels, rate, _byte_rate, _align, bits = struct.unpack("<HHIIHH", buf[pos + 8:pos + 24])
            if tag not in (1, 0xFFFE) or bits != 16 or channels < 1 or rate < 1:
                raise StreamFormatError(f"WAV stream: expected 16-bit PCM, got format {tag}, {bits} bits, "
                                        f"{channels} channels, {rate} Hz")
            fmt = PcmFormat(rate, channels, 2)
        pos += 8 + size + (size & 1)


def parse_wav(data: bytes) -> tuple[PcmFormat, bytes]:
    """A whole WAV file (one streamed chat chunk): its format and PCM bytes."""
    reader = WavStreamReader()
    pcm = reader.feed(data)
    if reader.format is None:
        raise StreamFormatError(f"truncated WAV ({len(data)} bytes, header incomplete)")
    return reader.format, pcm


def wav_file(fmt: PcmFormat, pcm: bytes) -> bytes:
    """The PCM as a WAV file (what the run directory keeps and Whisper reads)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(fmt.channels)
        w.setsampwidth(fmt.sample_width)
        w.setframerate(fmt.sample_rate)
        w.writeframes(pcm[:len(pcm) - len(pcm) % fmt.frame_bytes])
    return buf.getvalue()


# ---------------------------------------------------------------------------- the timeline


@dataclass
class AudioTimeline:
    """Audio as it arrived: one piece per read (or per event), its ``perf_counter`` stamp and PCM bytes."""

    format: PcmFormat | None = None
    pieces: list[tuple[float, int]] = field(default_factory=list)  # (arrival, PCM bytes)
    pcm: bytearray = field(default_factory=bytearray)

    def add(self, at: float, pcm: bytes, fmt: PcmFormat) -> None:
        if self.format is None:
            self.format = fmt
        elif fmt != self.format:
            raise StreamFormatError(f"audio format changed mid-stream: {self.format} then {fmt}")
        self.pieces.append((at, len(pcm)))
        self.pcm += pcm

    def chunks(self) -> list[Chunk]:
        if self.format is None:
            return []
        frames = frames_of([n for _, n in self.pieces], self.format.frame_bytes)
        return [Chunk(at, f) for (at, _), f in zip(self.pieces, frames)]

    def metrics(self, sent_at: float, end_at: float) -> StreamMetrics | None:
        """None when no audio format was ever seen (nothing to measure)."""
        if self.format is None:
            return None
        return stream_metrics(self.chunks(), self.format.sample_rate, sent_at=sent_at, end_at=end_at)

    def wav(self) -> bytes:
        assert self.format is not None
        return wav_file(self.format, bytes(self.pcm))


def b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise StreamFormatError(f"{what}: expected base64 text, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise StreamFormatError(f"{what}: not base64 ({exc})") from None


# ---------------------------------------------------------------------------- chat completions, streamed


@dataclass
class ChatStream:
    """A streamed chat completion as it is read: the Thinker's text deltas and the audio timeline."""

    requested_format: str = "wav"  # the request's audio.format (what an audio delta holds)
    text: list[str] = field(default_factory=list)
    audio: AudioTimeline = field(default_factory=AudioTimeline)
    audio_events: int = 0  # audio chunks the server sent (some may hold no frames)
    text_events: int = 0
    finish_reason: str | None = None
    response_id: str | None = None
    done: bool = False  # data: [DONE] arrived

    def event(self, ev: SSEEvent, at: float) -> None:
        """One SSE event read at ``at``; ``StreamFormatError`` for a server error or a malformed chunk."""
        if ev.data.strip() == "[DONE]":
            self.done = True
            return
        try:
            data = json.loads(ev.data)
        except json.JSONDecodeError:
            raise StreamFormatError(f"stream chunk is not JSON: {ev.data[:120]!r}") from None
        if not isinstance(data, dict):
            raise StreamFormatError(f"stream chunk is not a JSON object: {ev.data[:120]!r}")
        if data.get("error"):
            err = data["error"]
            raise StreamFormatError(f"server error: {err.get('message') if isinstance(err, dict) else err}")
        if isinstance(data.get("id"), str) and self.response_id is None:
            self.response_id = data["id"]
        modality = data.get("modality")
        for choice in data.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            content = delta.get("content")
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
            if modality == "audio":
                self.audio_events += 1
                if content:
                    self._audio(b64(content, "audio chunk (choices[].delta.content)"), choice, at)
            elif isinstance(content, str) and content:
                self.text_events += 1
                self.text.append(content)

    def _audio(self, raw: bytes, choice: dict[str, Any], at: float) -> None:
        meta = choice.get("audio_metadata") if isinstance(choice.get("audio_metadata"), dict) else {}
        fmt_name = str(meta.get("format") or self.requested_format)
        if raw[:4] == b"RIFF":
            fmt, pcm = parse_wav(raw)
        elif fmt_name in ("pcm", "pcm16"):
            rate, channels = meta.get("sample_rate_hz"), meta.get("channels") or 1
            if not isinstance(rate, int) or rate <= 0:
                raise StreamFormatError("PCM audio chunk without audio_metadata.sample_rate_hz")
            fmt, pcm = PcmFormat(rate, int(channels), 2), raw
        else:
            raise StreamFormatError(f"audio chunk in format {fmt_name!r}: only wav and pcm can be measured")
        frames = meta.get("frame_count")
        if isinstance(frames, int) and frames * fmt.frame_bytes != len(pcm):
            raise StreamFormatError(f"audio chunk of {len(pcm)} PCM bytes, but audio_metadata.frame_count says "
                                    f"{frames} frames")
        self.audio.add(at, pcm, fmt)

    @property
    def thinker_text(self) -> str:
        return "".join(self.text)


# ---------------------------------------------------------------------------- /v1/audio/speech

SPEECH_PATH = "/v1/audio/speech"
SPEECH_MODES = ("none", "sse", "audio")  # stream: false | stream: true (SSE) | stream_format: "audio" (raw bytes)
SPEECH_FORMATS = ("pcm", "wav")
QWEN3_TTS_SAMPLE_RATE = 24000  # the model's native rate: what an unlabelled PCM stream is read at


def speech_body(model: str, text: str, *, mode: str = "sse", response_format: str = "pcm",
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """An ``OpenAICreateSpeechRequest`` body (vLLM-Omni 0.30.0 ``protocol/audio.py``); ``extra``: any
    other field of it (``voice``, ``language``, ``task_type``, ``seed``, ``max_new_tokens``, ...)."""
    if mode not in SPEECH_MODES:
        raise ValueError(f"speech stream mode {mode!r}: choose {', '.join(SPEECH_MODES)}")
    if response_format not in SPEECH_FORMATS:
        raise ValueError(f"response_format {response_format!r}: the measured formats are {', '.join(SPEECH_FORMATS)}")
    body: dict[str, Any] = {"model": model, "input": text, "response_format": response_format}
    body.update(extra or {})
    if mode == "sse":
        body["stream"] = True
    elif mode == "audio":
        body["stream"], body["stream_format"] = True, "audio"
    else:
        body["stream"] = False
    return body


@dataclass
class SpeechStream:
    """A ``/v1/audio/speech`` response as it is read, whichever of the three envelopes it comes in."""

    mode: str
    response_format: str
    pcm_rate: int = QWEN3_TTS_SAMPLE_RATE
    pcm_channels: int = 1
    audio: AudioTimeline = field(default_factory=AudioTimeline)
    sse: SSEParser = field(default_factory=SSEParser)
    wav: WavStreamReader = field(default_factory=WavStreamReader)
    deltas: int = 0  # speech.audio.delta events (mode sse)
    done: bool = False  # speech.audio.done arrived (mode sse)
    usage: dict[str, Any] | None = None

    def feed(self, data: bytes, at: float) -> None:
        """Bytes of the body read at ``at``."""
        if self.mode != "sse":
            self._audio_bytes(data, at)
            return
        for ev in self.sse.feed(data):
            self._event(ev, at)

    def finish(self) -> None:
        """The body ended: a cut-short SSE stream or a WAV without its header is an error."""
        if self.mode == "sse":
            self.sse.close()
            if not self.done:
                raise StreamFormatError("SSE stream ended without speech.audio.done")
        if self.response_format == "wav" and self.audio.format is None and (self.mode != "sse" or self.deltas):
            raise StreamFormatError("WAV stream ended before its header was complete")

    def _event(self, ev: SSEEvent, at: float) -> None:
        try:
            data = json.loads(ev.data)
        except json.JSONDecodeError:
            raise StreamFormatError(f"SSE event {ev.event!r} is not JSON: {ev.data[:120]!r}") from None
        kind = data.get("type", ev.event) if isinstance(data, dict) else ev.event
        if kind == "speech.audio.delta" and isinstance(data, dict):
            self.deltas += 1
            self._audio_bytes(b64(data.get("audio"), "speech.audio.delta audio"), at)
        elif kind == "speech.audio.done":
            self.done = True
            self.usage = data.get("usage") if isinstance(data, dict) else None
        elif kind == "speech.audio.error":
            err = data.get("error") if isinstance(data, dict) else None
            raise StreamFormatError(f"server error: {err.get('message') if isinstance(err, dict) else err}")

    def _audio_bytes(self, data: bytes, at: float) -> None:
        if self.response_format == "wav":
            pcm = self.wav.feed(data)
            if self.wav.format is not None:
                self.audio.add(at, pcm, self.wav.format)
        else:
            self.audio.add(at, data, PcmFormat(self.pcm_rate, self.pcm_channels, 2))
