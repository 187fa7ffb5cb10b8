"""Qwen3-TTS on the real backend, the parts that need no server: the deploy YAML, the speech request, the
worker's trace of ``preprocess`` and ``preprocess_decode_batch`` (each position once), and how trace lines
are filed by their text. The server itself: tests/test_real_cpu_tts_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from harness.config import load_deploy
from harness.families.qwen3_tts import serve
from harness.serve.backend import TraceCollector
from harness.serve.trace_plugin import TraceWriter

DEPLOYS = Path(__file__).resolve().parents[1] / "deploy_configs"


def test_the_stress_deploy_becomes_a_v1_deploy_yaml_with_the_cpu_profile():
    t = serve.translate(load_deploy("qwen3-tts-cpu-full-stress"), "cpu")
    assert t.cli_args == ("--deploy-config", "<deploy.yaml>") and t.stage_overrides == {}
    assert dict(t.env) == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    y = yaml.safe_load(t.deploy_yaml)
    assert (y["model_runner"], y["async_chunk"]) == ("v1", False)
    talker, code2wav = y["stages"]
    assert {k: talker[k] for k in ("stage_id", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                                   "num_gpu_blocks_override", "block_size", "max_model_len",
                                   "enable_prefix_caching")} == {
        "stage_id": 0, "max_num_seqs": 4, "max_num_batched_tokens": 8, "enable_chunked_prefill": True,
        "num_gpu_blocks_override": 6, "block_size": 32, "max_model_len": 160, "enable_prefix_caching": False}
    assert talker["default_sampling_params"] == {"temperature": 0.9, "top_p": 1.0, "top_k": 50, "seed": 42,
                                                 "max_tokens": 100}
    assert (code2wav["stage_id"], code2wav["dtype"], code2wav["block_size"]) == (1, "float32", 32)
    assert (talker["devices"], code2wav["devices"]) == ("0", "1")  # the release's "0" for both: side by side on CPU
    gpu = yaml.safe_load(serve.translate(load_deploy("qwen3-tts-stress"), "gpu").deploy_yaml)
    assert gpu["stages"][0]["num_gpu_blocks_override"] == 42 and gpu["stages"][0]["block_size"] == 16
    assert "dtype" not in gpu["stages"][1] and "kv_cache_memory_bytes" not in gpu["stages"][0]
    assert [stage["devices"] for stage in gpu["stages"]] == ["0", "0"]


def test_an_async_chunk_deploy_streams_with_the_release_connectors(tmp_path: Path) -> None:
    """Issue 42 item 1: ``async_chunk: true`` (the shipped CPU deploys' default) gives the release's streaming
    path, its connector settings read from the release's own (vendored) YAML, not restated; the ``-full-``
    twins stay ``false`` (one audio chunk per request)."""
    y = yaml.safe_load(serve.translate(load_deploy("qwen3-tts-cpu-stress"), "cpu").deploy_yaml)
    talker, code2wav = y["stages"]
    assert (y["model_runner"], y["async_chunk"]) == ("v1", True)
    assert talker["output_connectors"] == {"to_stage_1": "connector_of_shared_memory"}
    assert code2wav["input_connectors"] == {"from_stage_0": "connector_of_shared_memory"}
    extra = y["connectors"]["connector_of_shared_memory"]["extra"]
    assert y["connectors"]["connector_of_shared_memory"]["name"] == "SharedMemoryConnector"
    assert (extra["codec_chunk_frames"], extra["codec_left_context_frames"], extra["initial_codec_chunk_frames"],
            extra["codec_streaming"]) == (25, 72, 1, True)
    assert talker["num_gpu_blocks_override"] == 6  # the deploy's own Talker settings, as without streaming
    shipped = yaml.safe_load((DEPLOYS / "qwen3-tts-cpu-full-stress.yaml").read_text())
    plain = yaml.safe_load(serve.translate(load_deploy("qwen3-tts-cpu-full-stress"), "cpu").deploy_yaml)
    assert shipped["async_chunk"] is False and plain["async_chunk"] is False and "connectors" not in plain
    full, streamed = (yaml.safe_load((DEPLOYS / f"qwen3-tts-cpu-{k}stress.yaml").read_text()) for k in ("full-", ""))
    assert {k: v for k, v in full.items() if k not in ("name", "pair", "description", "async_chunk")} == {
        k: v for k, v in streamed.items() if k not in ("name", "pair", "description", "async_chunk", "slo")}
    assert "output_connectors" not in plain["stages"][0] and "input_connectors" not in plain["stages"][1]


def test_the_speech_request_asks_for_the_streaming_text_layout():
    deploy = load_deploy("qwen3-tts-cpu-stress")
    assert serve.speech_body("m", "Hi.", False, deploy) == {
        "model": "m", "input": "Hi.", "response_format": "wav", "voice": "Vivian", "language": "Auto",
        "task_type": "CustomVoice", "non_streaming_mode": False, "max_new_tokens": 100, "seed": 42, "stream": False}
    streamed = serve.speech_body("m", "Hi.", True, deploy)
    assert (streamed["stream"], streamed["response_format"]) == (True, "pcm")


class _Model:
    """A stand-in with the release's two hooks' shapes; its batched hook calls ``preprocess`` per request,
    as the fix's does."""

    def embed_input_ids(self, ids):
        return torch.zeros(ids.reshape(-1).shape[0], 4)

    def preprocess(self, input_ids, input_embeds, **info):
        n = int(input_ids.shape[0])
        update = {"mtp_inputs": (torch.zeros(1, 4), torch.ones(1, 4))} if n == 1 else {}
        return input_ids, torch.zeros(n, 4), update

    def preprocess_decode_batch(self, *, input_ids, req_infos, input_embeds=None):
        rows, texts = [], []
        for i, info in enumerate(req_infos):
            _ids, row, update = self.preprocess(input_ids.reshape(-1)[i:i + 1], None, **info)
            rows.append(row)
            texts.append(update["mtp_inputs"][1])
        return input_ids, torch.cat(rows), torch.zeros(len(rows), 4), torch.cat(texts), [{}] * len(rows)


def test_each_call_is_traced_once_and_a_batch_per_request(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_STRESS_TRACE_LEVEL", "spans")

    class M(_Model):
        pass

    assert serve.wrap(M, TraceWriter(str(tmp_path))) is True
    assert serve.wrap(M, TraceWriter(str(tmp_path))) is False  # already wrapped
    m = M()
    info = {"_omni_prompt_len": 9, "_omni_is_prefill": True, "additional_information": {"text": ["Hi."]}}
    m.preprocess(input_ids=torch.arange(9), input_embeds=None, request_id="a", _omni_num_computed_tokens=0, **info)
    decode = {"_omni_prompt_len": 9, "_omni_is_prefill": False, "text": ["Hi."]}
    m.preprocess_decode_batch(input_ids=torch.tensor([72, 73]), req_infos=[
        {"request_id": "a", "_omni_num_computed_tokens": 9, **decode},
        {"request_id": "b", "_omni_num_computed_tokens": 10, **decode}])
    lines = [json.loads(x) for x in next(tmp_path.glob("trace-*.jsonl")).read_text().splitlines()]
    assert [(ln["request_id"], ln["_omni_num_computed_tokens"], ln["span_len"], ln["rows"], ln.get("codec_ids"),
             ln["tts_text"]) for ln in lines] == [
        ("a", 0, 9, 9, None, "Hi."), ("a", 9, 1, 1, [72], "Hi."), ("b", 10, 1, 1, [73], "Hi.")]


def test_trace_lines_of_the_speech_api_are_filed_by_their_text(tmp_path):
    (tmp_path / "trace-1.jsonl").write_text("\n".join(json.dumps(x) for x in (
        {"request_id": "speech-1", "tts_text": "Hi."}, {"request_id": "speech-2", "tts_text": "Other."},
        {"request_id": "speech-3"})) + "\n")
    collector = TraceCollector(Path(tmp_path), {}, {"Hi.": "p1"})
    collector.poll()
    assert (list(collector.by_prompt), collector.unmatched, collector.total) == (["p1"], 2, 3)


def test_two_prompts_with_one_text_are_refused_before_any_server(tmp_path: Path) -> None:
    """The speech API names its requests itself: spans are filed by their text, so two prompts saying the
    same text are one line and exit 2, before a run directory exists."""
    import subprocess
    import sys

    prompts = tmp_path / "twice.yaml"
    prompts.write_text("name: twice\nfamily: qwen3-tts\nprompts:\n"
                       "  - id: a1\n    text: \"The same words.\"\n"
                       "  - id: b2\n    text: \"Other words.\"\n"
                       "  - id: c3\n    text: \"The same words.\"\n")
    out = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--backend", "vllm-omni", "--platform", "cpu",
                          "--family", "qwen3-tts", "--model", str(tmp_path / "no-model"), "--arm", "tts-fix",
                          "--deploy", "qwen3-tts-cpu-reference", "--prompts", str(prompts), "--asr", "none",
                          "--out", str(tmp_path / "results"), "--run-id", "r"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.strip().splitlines()[-1] == (
        f"omni-stress: error: {prompts}: prompts[2].text: the same text as prompt 'a1' (prompt 'c3'); the "
        "vllm-omni backend files a speech request's spans by its text, so each prompt's text must differ")
    assert not (tmp_path / "results" / "r").exists()


class _PastModel(_Model):
    """Its batched hook hands the code predictor each request's ``hidden_states.last`` (the release's), or,
    with ``wrong``, that value plus one (a stale or another position's hidden state)."""

    wrong: set[str] = set()

    def preprocess_decode_batch(self, *, input_ids, req_infos, input_embeds=None):
        ids, rows, _pasts, texts, updates = super().preprocess_decode_batch(input_ids=input_ids, req_infos=req_infos)
        pasts = []
        for info in req_infos:
            last = info.get("hidden_states", {}).get("last")
            past = torch.zeros(1, 4) if last is None else last.reshape(1, -1).clone()
            pasts.append(past + 1 if info["request_id"] in self.wrong else past)
        return ids, rows, torch.cat(pasts), texts, updates


def test_the_worker_checks_the_past_hidden_state_of_every_decode(tmp_path, monkeypatch):
    """Issue 45, item 2 on the real worker: a decode whose row is right but whose code predictor reads
    another hidden state than the buffer's ``hidden_states.last`` (zeros where there is none) is misaligned,
    in its region; the rows themselves are taken as right here (the release's prompt builder is the server's)."""
    monkeypatch.setenv("OMNI_STRESS_TRACE_LEVEL", "contract")
    monkeypatch.setattr(serve, "expected_rows", lambda model, info, ids, P, c, n: (torch.ones(n, 4), 3))

    class M(_PastModel):
        wrong = {"b", "d"}

    assert serve.wrap(M, TraceWriter(str(tmp_path)))
    decode = {"_omni_prompt_len": 9, "_omni_is_prefill": False, "text": ["Hi."]}
    last = torch.arange(4, dtype=torch.float32)
    M().preprocess_decode_batch(input_ids=torch.tensor([72, 73, 74, 75]), req_infos=[
        {"request_id": "a", "_omni_num_computed_tokens": 9, "hidden_states": {"last": last}, **decode},
        {"request_id": "b", "_omni_num_computed_tokens": 10, "hidden_states": {"last": last}, **decode},
        {"request_id": "c", "_omni_num_computed_tokens": 11, **decode},  # no last yet: zeros are right
        {"request_id": "d", "_omni_num_computed_tokens": 13, **decode}])  # past text-EOS (9 + 3): the end region
    lines = [json.loads(x) for x in next(tmp_path.glob("trace-*.jsonl")).read_text().splitlines()]
    assert [(ln["request_id"], ln["misaligned_text"], ln["misaligned_end"], ln.get("first_misaligned"))
            for ln in lines] == [("a", 0, 0, None), ("b", 1, 0, 10), ("c", 0, 0, None), ("d", 0, 1, 13)]


def test_the_past_hidden_state_rule():
    from harness.contract import same_hidden

    row = torch.tensor([0.5, -1.0, 2.0])
    assert same_hidden(row.reshape(1, 3).clone(), row) and same_hidden(row.double(), row)
    assert not same_hidden(row + 1e-6, row) and not same_hidden(row[:2], row) and not same_hidden(None, row)
    assert same_hidden(torch.zeros(1, 3), None) and not same_hidden(row, None)
    assert not same_hidden(torch.zeros(1, 3, dtype=torch.long), None)
