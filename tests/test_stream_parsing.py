"""Issue 31 item 3: reading streamed audio off the wire (``harness.serve.streaming``): SSE split
anywhere, WAV headers split anywhere, and vLLM-Omni 0.30.0's streamed chat chunks (text and audio
deltas told apart by ``modality``, audio as base64 WAV or PCM with ``audio_metadata``)."""

from __future__ import annotations

import base64
import io
import json
import struct
import wave

import pytest

from harness.serve.streaming import (ChatStream, PcmFormat, SpeechStream, SSEEvent, SSEParser, StreamFormatError,
                                     WavStreamReader, parse_wav, speech_body, wav_file)
from harness.stream_metrics import Chunk

SSE = (b": keep-alive\r\n"
       b"event: speech.audio.delta\r\ndata: {\"a\":1}\r\n\r\n"
       b"data: line one\ndata: line two\n\n"
       b"data:no-space\r\rid: 7\nretry: 10\ndata: [DONE]\n\n"
       b"event: lonely\n\n")
EVENTS = [SSEEvent("speech.audio.delta", '{"a":1}'), SSEEvent("message", "line one\nline two"),
          SSEEvent("message", "no-space"), SSEEvent("message", "[DONE]")]


def test_sse_events_whole_and_split_at_every_byte() -> None:
    assert SSEParser().feed(SSE) == EVENTS
    for cut in range(1, len(SSE)):
        p = SSEParser()
        assert p.feed(SSE[:cut]) + p.feed(SSE[cut:]) == EVENTS, cut
    p = SSEParser()
    assert [e for i in range(len(SSE)) for e in p.feed(SSE[i:i + 1])] == EVENTS


def test_an_event_cut_short_is_pending_and_dropped() -> None:
    p = SSEParser()
    assert p.feed(b"data: half") == [] and p.pending
    assert p.close() == []


def _wav(frames: int, rate: int = 24000, extra_chunk: bool = False) -> bytes:
    pcm = b"".join(struct.pack("<h", i) for i in range(frames))
    raw = wav_file(PcmFormat(rate), pcm)
    if extra_chunk:  # a LIST chunk between fmt and data (soundfile and others write them)
        raw = raw[:36] + b"LIST" + struct.pack("<I", 5) + b"abcde\x00" + raw[36:]
    return raw


@pytest.mark.parametrize("extra", [False, True])
def test_wav_header_split_anywhere(extra: bool) -> None:
    raw = _wav(10, extra_chunk=extra)
    pcm = raw[-20:]
    assert parse_wav(raw) == (PcmFormat(24000, 1, 2), pcm)
    for cut in range(len(raw)):
        r = WavStreamReader()
        assert r.feed(raw[:cut]) + r.feed(raw[cut:]) == pcm, cut


def test_a_streamed_wav_header_takes_everything_after_it() -> None:
    header = struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", 0xFFFFFFFF, b"WAVE", b"fmt ", 16, 1, 1, 8000, 16000, 2, 16,
                         b"data", 0xFFFFFFFF)
    r = WavStreamReader()
    assert r.feed(header) == b"" and r.format == PcmFormat(8000) and r.feed(b"\x01\x02\x03") == b"\x01\x02\x03"


@pytest.mark.parametrize(("raw", "message"), [
    (b"ID3\x03", "not a WAV stream (starts with b'ID3\\x03', not b'RIFF')"),
    (b"RIFF\x00\x00\x00\x00WAVX", "not a WAV stream (starts with b'RIFF\\x00\\x00\\x00\\x00WAVX')"),
    (struct.pack("<4sI4s4sIHHIIHH", b"RIFF", 0, b"WAVE", b"fmt ", 16, 3, 1, 8000, 32000, 4, 32),
     "WAV stream: expected 16-bit PCM, got format 3, 32 bits, 1 channels, 8000 Hz"),
])
def test_what_is_not_a_16_bit_wav_is_refused(raw: bytes, message: str) -> None:
    with pytest.raises(StreamFormatError) as err:
        WavStreamReader().feed(raw)
    assert str(err.value) == message


def _chunk(modality: str, content: str, **choice: object) -> SSEEvent:
    return SSEEvent("message", json.dumps({"id": "chatcmpl-x", "object": "chat.completion.chunk", "modality": modality,
                                           "choices": [{"index": 0, "delta": {"content": content}, **choice}]}))


def test_chat_stream_text_and_wav_audio_chunks() -> None:
    """Shaped as 0.30.0's chat_completion_stream_generator sends them: the role chunk, text deltas,
    then audio chunks whose delta.content is a whole base64 WAV, audio_metadata beside it."""
    s = ChatStream()
    s.event(_chunk("text", ""), 0.5)  # the first chunk: role, empty content
    s.event(_chunk("text", "Heat the "), 0.5)
    s.event(_chunk("text", "water."), 0.75)
    for at, frames in ((1.0, 12000), (1.25, 6000)):  # 0.5 s, then 0.25 s of audio
        meta = {"format": "wav", "sample_rate_hz": 24000, "frame_count": frames, "channels": 1}
        s.event(_chunk("audio", base64.b64encode(_wav(frames)).decode(), audio_metadata=meta), at)
    s.event(_chunk("audio", "", finish_reason="stop"), 1.5)  # an empty speech segment: no frames
    s.event(SSEEvent("message", "[DONE]"), 1.5)
    assert (s.thinker_text, s.text_events, s.audio_events, s.done, s.finish_reason, s.response_id) == (
        "Heat the water.", 2, 3, True, "stop", "chatcmpl-x")
    assert s.audio.chunks() == [Chunk(1.0, 12000), Chunk(1.25, 6000)] and s.audio.format == PcmFormat(24000)
    m = s.audio.metrics(0.0, 1.5)
    assert (m.ttfa_s, m.gaps_s, m.frames, m.underruns, m.end_s) == (1.0, (0.25,), 18000, (), 1.5)
    with wave.open(io.BytesIO(s.audio.wav()), "rb") as w:
        assert (w.getframerate(), w.getnframes()) == (24000, 18000)


def test_chat_stream_pcm_audio_reads_its_rate_from_the_metadata() -> None:
    s = ChatStream(requested_format="pcm")
    meta = {"format": "pcm", "sample_rate_hz": 16000, "frame_count": 3, "channels": 1}
    s.event(_chunk("audio", base64.b64encode(b"\x00\x01" * 3).decode(), audio_metadata=meta), 2.0)
    assert s.audio.format == PcmFormat(16000) and s.audio.chunks() == [Chunk(2.0, 3)]
    with pytest.raises(StreamFormatError, match="without audio_metadata.sample_rate_hz"):
        ChatStream(requested_format="pcm").event(_chunk("audio", base64.b64encode(b"\x00\x01").decode()), 1.0)


@pytest.mark.parametrize(("event", "message"), [
    (SSEEvent("message", "{not json"), "stream chunk is not JSON: '{not json'"),
    (SSEEvent("message", '{"error": {"message": "boom", "code": 500}}'), "server error: boom"),
    (_chunk("audio", "***"), "audio chunk (choices[].delta.content): not base64"),
    (_chunk("audio", base64.b64encode(_wav(4)).decode(), audio_metadata={"frame_count": 5}),
     "audio chunk of 8 PCM bytes, but audio_metadata.frame_count says 5 frames"),
    (_chunk("audio", base64.b64encode(b"ID3xxxx").decode(), audio_metadata={"format": "mp3"}),
     "audio chunk in format 'mp3': only wav and pcm can be measured"),
])
def test_chat_stream_refuses_what_it_cannot_measure(event: SSEEvent, message: str) -> None:
    with pytest.raises(StreamFormatError) as err:
        ChatStream().event(event, 1.0)
    assert str(err.value).startswith(message)


def test_audio_format_must_not_change_mid_stream() -> None:
    s = ChatStream()
    s.event(_chunk("audio", base64.b64encode(_wav(2, rate=24000)).decode()), 1.0)
    with pytest.raises(StreamFormatError, match="audio format changed mid-stream"):
        s.event(_chunk("audio", base64.b64encode(_wav(2, rate=16000)).decode()), 2.0)


def test_speech_bodies_and_a_cut_short_sse_stream() -> None:
    assert speech_body("m", "hi", mode="sse") == {"model": "m", "input": "hi", "response_format": "pcm", "stream": True}
    assert speech_body("m", "hi", mode="audio", response_format="wav", extra={"voice": "vivian"}) == {
        "model": "m", "input": "hi", "response_format": "wav", "voice": "vivian", "stream": True,
        "stream_format": "audio"}
    assert speech_body("m", "hi", mode="none")["stream"] is False
    with pytest.raises(ValueError, match="speech stream mode 'ws'"):
        speech_body("m", "hi", mode="ws")
    s = SpeechStream(mode="sse", response_format="pcm", pcm_rate=8000)
    s.feed(b'event: speech.audio.delta\ndata: {"type":"speech.audio.delta","audio":"AAA=","response_format":"pcm"}'
           b"\n\n", 0.5)
    assert s.deltas == 1 and s.audio.chunks() == [Chunk(0.5, 1)]
    with pytest.raises(StreamFormatError, match="SSE stream ended without speech.audio.done"):
        s.finish()
