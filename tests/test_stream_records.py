"""Issue 31 item 3: ``run --stream`` on the vllm-omni backend: the streamed chat attempt (over httpx's
mock transport: parsing and errors, not timing), the records' ``stream_*`` fields (written only when
measured, read back checked), the option's refusals and the manifest's ``stream`` key."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import httpx
import pytest

from conftest import invoke_cli
from clikit import assert_one_line_error
from harness.records import RequestRecord, read_requests, request_record_problem, to_json
from harness.serve import client as chat
from harness.serve.streaming import PcmFormat, wav_file
from harness.stream_metrics import Chunk, stream_metrics

REPO = Path(__file__).resolve().parents[1]


def _sse(*objs: object, done: bool = True) -> list[bytes]:
    out = [f"data: {json.dumps(o)}\n\n".encode() for o in objs]
    return out + ([b"data: [DONE]\n\n"] if done else [])


def _text(t: str) -> dict:
    return {"id": "chatcmpl-t", "modality": "text", "choices": [{"index": 0, "delta": {"content": t}}]}


def _audio(frames: int) -> dict:
    raw = wav_file(PcmFormat(24000), b"\x01\x00" * frames)
    meta = {"format": "wav", "sample_rate_hz": 24000, "frame_count": frames, "channels": 1}
    return {"id": "chatcmpl-t", "modality": "audio",
            "choices": [{"index": 0, "delta": {"content": base64.b64encode(raw).decode()}, "audio_metadata": meta,
                         "finish_reason": "stop"}]}


def _send(pieces: list[bytes], tmp_path: Path, status: int = 200) -> chat.ChatResult:
    async def body():
        for p in pieces:
            yield p

    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["stream"] is True and request.headers["X-Request-Id"] == sent["request_id"]
        return httpx.Response(status, content=body())

    spec = chat.RequestSpec("c01", "omni-stress-c01-" + "0" * 32, {"stream": True, "request_id": "omni-stress-c01-"
                                                                   + "0" * 32}, tmp_path / "a.wav")

    async def go() -> chat.ChatResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            sender = chat._Sender(client, "http://127.0.0.1:1/v1/chat/completions", 30.0, 0, lambda: True,
                                  lambda: "gone", 0.0)
            return await sender.send(spec)

    return asyncio.run(go())


def test_a_streamed_chat_completion_becomes_text_a_wav_and_metrics(tmp_path: Path) -> None:
    res = _send(_sse(_text(""), _text("Heat the "), _text("water."), _audio(960), _audio(480)), tmp_path)
    assert res.error is None, res.error
    assert (res.thinker_text, res.finish_reason, res.response_id, res.audio_events) == (
        "Heat the water.", "stop", "chatcmpl-t", 2)
    assert res.audio_seconds == 1440 / 24000 and res.audio_file.read_bytes() == wav_file(PcmFormat(24000),
                                                                                         b"\x01\x00" * 1440)
    m = res.stream
    assert (m.chunks, m.chunk_frames, m.sample_rate, len(m.gaps_s)) == (2, (960, 480), 24000, 1)
    assert 0 <= m.ttfa_s <= m.ttfa_s + m.gaps_s[0] <= m.end_s <= res.wall_s


@pytest.mark.parametrize(("pieces", "status", "error"), [
    (_sse(_text("hi"), _audio(10), done=False), 200, "the stream ended without data: [DONE] (cut short)"),
    (_sse(_text("hi"), _audio(10))[:1] + [b"data: {\"id\": \"x\", \"mod"], 200,
     "the stream ended without data: [DONE] (cut short)"),
    (_sse(_audio(10)), 200, "the stream has no Thinker text"),
    (_sse(_text("hi")), 200, "the stream has no audio (0 audio chunks, none with frames)"),
    (_sse(_text("hi"), {"error": {"message": "engine dead"}}), 200, "malformed stream: server error: engine dead"),
    ([b'{"error": {"message": "bad modalities"}}'], 400, "HTTP 400: bad modalities"),
])
def test_a_broken_stream_is_one_error_on_its_request(pieces: list[bytes], status: int, error: str,
                                                     tmp_path: Path) -> None:
    res = _send(pieces, tmp_path, status)
    assert res.error is not None and res.error.startswith(error), res.error
    assert res.stream is None and res.audio_file is None


def _record(**kw: object) -> RequestRecord:
    return RequestRecord(arm="pr", deploy="cpu-reference", repeat=1, prompt_id="c01", backend="vllm-omni",
                         reference_text="hi", **kw)


def test_stream_fields_are_written_only_when_measured_and_read_back_checked(tmp_path: Path) -> None:
    from harness.serve.backend import stream_fields

    plain = json.loads(to_json(_record()))
    assert not [k for k in plain if k.startswith("stream_")]
    rec = _record()
    m = stream_metrics([Chunk(10.5, 12000), Chunk(11.5, 12000), Chunk(11.625, 24000)], 24000, sent_at=10.0,
                       end_at=12.0 + 1 / 3)
    stream_fields(rec, m, audio_events=4)
    data = json.loads(to_json(rec))
    assert {k: v for k, v in data.items() if k.startswith("stream_")} == {
        "stream_ttfa_s": 0.5, "stream_end_s": 2.333333, "stream_chunks": 3, "stream_audio_events": 4,
        "stream_sample_rate": 24000, "stream_chunk_frames": [12000, 12000, 24000], "stream_gaps_s": [1.0, 0.125],
        "stream_underruns": [[1.0, 0.5]], "stream_underrun_s": 0.5}
    assert request_record_problem(data) is None
    (tmp_path / "requests.jsonl").write_text(to_json(rec) + "\n")
    back = read_requests(tmp_path)[0]
    assert back == rec
    assert request_record_problem({**data, "stream_underruns": [[1.0, -0.5]]}) is None  # lists: types only
    assert "stream_chunks: expected int | None" in request_record_problem({**data, "stream_chunks": "3"})
    assert request_record_problem({**data, "stream_ttfa_s": -1.0}) == "stream_ttfa_s: must be a finite number >= 0, got -1.0"


def test_stream_is_refused_off_the_real_backend() -> None:
    assert_one_line_error(invoke_cli("run", "--stream", "--asr", "none", "--prompts", "cpu_smoke"),
                          "--stream: streamed audio is measured on the real server (--backend vllm-omni), not on "
                          "--backend sim")
    assert_one_line_error(invoke_cli("sweep", "quick", "--stream"), "--stream:", "--backend sim")


def test_the_dry_run_shows_the_streamed_body(tmp_path: Path) -> None:
    res = invoke_cli("run", "--backend", "vllm-omni", "--arm", "pr", "--deploy", "cpu-reference", "--prompts",
                     "cpu_smoke", "--asr", "none", "--out", str(tmp_path), "--dry-run", "--stream")
    assert res.exit_code == 0, res.stderr
    assert "#   stream: true" in res.stdout
    plain = invoke_cli("run", "--backend", "vllm-omni", "--arm", "pr", "--deploy", "cpu-reference", "--prompts",
                       "cpu_smoke", "--asr", "none", "--out", str(tmp_path), "--dry-run")
    assert "#   stream: false" in plain.stdout


def test_resume_refuses_a_run_streamed_the_other_way(tmp_path: Path) -> None:
    from harness.errors import UserError
    from harness.records import write_manifest
    from harness.rundir import check_resume

    base = {"config_hashes": {}, "cells": [], "seed": 42, "backend": "vllm-omni", "family": "qwen2.5-omni"}
    write_manifest(tmp_path, base)
    assert check_resume(tmp_path, dict(base)).done == set()  # neither streamed: as before the key existed
    with pytest.raises(UserError, match=r"stream differ from the manifest \(was False, now True\)"):
        check_resume(tmp_path, {**base, "stream": True})


def test_the_tables_show_streamed_cells_only(tmp_path: Path) -> None:
    from harness.records import write_manifest
    from harness.report.tables import html_report, load_run, markdown_text, summarize_cells, terminal_table
    from harness.serve.backend import stream_fields

    write_manifest(tmp_path, {"run_id": "t", "backend": "vllm-omni", "arms": [{"name": "pr", "role": "candidate"}],
                              "deploys": ["cpu-reference"], "prompt_ids": ["c01", "c02"], "repeat": 1,
                              "cells": [{"arm": "pr", "deploy": "cpu-reference", "repeat": 1}], "stream": True})
    lines = []
    for pid, chunks in (("c01", [Chunk(1.0, 12000), Chunk(2.0, 12000)]), ("c02", [Chunk(3.0, 24000)])):
        rec = RequestRecord(arm="pr", deploy="cpu-reference", repeat=1, prompt_id=pid, backend="vllm-omni",
                            reference_text="hi", wall_s=4.0, rtf=2.0, audio_seconds=1.0)
        stream_fields(rec, stream_metrics(chunks, 24000, end_at=3.5 if pid == "c01" else 3.25))
        lines.append(to_json(rec))
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    run = load_run(tmp_path)
    cells = summarize_cells(run)
    text = terminal_table(run, cells)
    head = text.splitlines().index(next(ln for ln in text.splitlines() if ln.startswith("Arm ") and "Streamed" in ln))
    # TTFP 1.0 and 3.0 (p50 2.0, p90 2.8, p99 2.98, max 3.0); one gap of 1.0 s after 0.5 s of audio: one stall
    # of 0.5 s (c01 fails continuity at every threshold and the default SLO, c02 meets them); RTF 2.0 each; no
    # send time recorded (no throughput), no connector traced (no windows)
    assert text.splitlines()[head + 2].split() == [
        "pr", "cpu-reference", "1", "2/2", "0", "2.000", "/", "2.800", "/", "2.980", "/", "3.000",
        "1.000", "/", "1.000", "/", "1.000", "0.500", "/", "0.500", "50%", "/", "50%", "/", "50%", "50%",
        "2.00", "/", "2.00", "n/a", "n/a"]
    assert "<summary>Streamed audio</summary>" in markdown_text(run, cells)
    assert 'id="streamed"' in html_report(run, cells, {})
    (tmp_path / "requests.jsonl").write_text(to_json(_record()) + "\n")
    plain = load_run(tmp_path)
    assert "Streamed" not in terminal_table(plain, summarize_cells(plain))
