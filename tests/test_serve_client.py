"""Chat-completions request/response format of vLLM-Omni 0.30.0, without a server."""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path

import pytest

from harness.config import Deploy, Prompt, PromptSet, SamplingSettings, SimSettings, StageSettings, TalkerSettings
from harness.serve.client import (
    ResponseError,
    build_body,
    make_tag,
    parse_response,
    sampling_params_list,
    tag_token,
    wav_seconds,
)


def wav(seconds: float = 0.5, rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x00\x00" * int(seconds * rate))
    return buf.getvalue()


DEPLOY = Deploy(name="stress", description="", path=Path("stress.yaml"), talker=TalkerSettings(),
                thinker=StageSettings(), code2wav=StageSettings(), async_chunk=False,
                sampling=SamplingSettings(temperature=0.7, top_p=0.5, top_k=20, seed=7, max_tokens=1234),
                sim=SimSettings())


def test_sampling_params_list_per_stage():
    thinker, talker, code2wav = sampling_params_list(DEPLOY)
    assert thinker == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 80, "seed": 42,
                       "repetition_penalty": 1.1, "detokenize": True}
    assert talker == {"temperature": 0.7, "top_p": 0.5, "top_k": 20, "max_tokens": 1234, "seed": 7,
                      "repetition_penalty": 1.05, "detokenize": True}
    assert code2wav == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 2048, "seed": 42,
                        "repetition_penalty": 1.1, "detokenize": True}


def test_seed_sampling_from_default_settings():
    talker = sampling_params_list(Deploy(**{**DEPLOY.__dict__, "sampling": SamplingSettings()}))[1]
    assert (talker["temperature"], talker["top_p"], talker["top_k"], talker["seed"], talker["max_tokens"]) == (
        0.9, 0.8, 40, 42, 1900)


def test_body_and_tag():
    prompts = PromptSet(name="p", description="", system_prompt="SYS", prompts=(), path=Path("p.yaml"))
    tag = make_tag("p01 weird/id")
    assert tag.startswith("omni-stress-p01-weird-id-") and len(tag_token(tag)) == 32
    body = build_body("Qwen/Qwen2.5-Omni-7B", prompts, Prompt(id="p01", user="Hi?", reply="x"), DEPLOY, tag)
    assert body["model"] == "Qwen/Qwen2.5-Omni-7B"
    assert body["modalities"] == ["text", "audio"]
    assert body["messages"] == [{"role": "system", "content": [{"type": "text", "text": "SYS"}]},
                                {"role": "user", "content": [{"type": "text", "text": "Hi?"}]}]
    assert body["sampling_params_list"] == sampling_params_list(DEPLOY)
    assert body["stream"] is False and body["request_id"] == tag


def response(choices: list) -> bytes:
    return json.dumps({"id": "chatcmpl-x", "choices": choices}).encode()


def test_parse_merged_choice_of_0_30_0():
    data = base64.b64encode(wav()).decode()
    parsed = parse_response(response([{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Hello there.", "audio": {"id": "a", "data": data, "expires_at": 0}}}]))
    assert (parsed.text, parsed.finish_reason, parsed.response_id) == ("Hello there.", "stop", "chatcmpl-x")
    assert wav_seconds(parsed.audio) == pytest.approx(0.5)


def test_parse_separate_text_and_audio_choices():
    data = base64.b64encode(wav(0.25)).decode()
    parsed = parse_response(response([
        {"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "Text."}},
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": None,
                                                          "audio": {"data": data}}},
    ]))
    assert (parsed.text, parsed.finish_reason) == ("Text.", "length")
    assert wav_seconds(parsed.audio) == pytest.approx(0.25)


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"choices": [', "malformed response body (not JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"error": {"message": "Unsupported output modalities audio"}}', "server error: Unsupported output modalities"),
    (b'{"choices": []}', "no choices"),
    (response([{"message": {"content": "t"}}]), "no audio (choices[].message.audio.data)"),
    (response([{"message": {"content": "", "audio": {"data": "AAAA"}}}]), "no Thinker text"),
    (response([{"message": {"content": "t", "audio": {"data": "%%%"}}}]), "undecodable audio: "),
])
def test_parse_errors(raw, message):
    with pytest.raises(ResponseError) as exc:
        parse_response(raw)
    assert message in str(exc.value)


def test_wav_seconds_rejects_non_wav():
    with pytest.raises(ResponseError, match="undecodable audio: not a WAV file"):
        wav_seconds(b"RIFF0000WAVEjunk")
