"""The connector's window trace (harness/serve/chunk_trace.py), in this process: the wrapper keeps the
release's signature and name (vLLM finds the batched peer by them), writes one line per payload with
codebook 0 of each frame, and an arm's chunker runs in its place or refuses loudly."""

from __future__ import annotations

import inspect
import json
import types
from pathlib import Path

import pytest
import torch

from harness.serve import chunk_trace as ct


class _Payload:
    def __init__(self, frames: list[list[int]], left: int = 0, finished: bool = False) -> None:
        q = len(frames[0])  # quantizer-major, as the release flattens a window
        codes = torch.tensor([frames[f][i] for i in range(q) for f in range(len(frames))], dtype=torch.long)
        self.codes = types.SimpleNamespace(audio=codes)
        self.meta = types.SimpleNamespace(left_context_size=left, finished=torch.tensor(finished))


def _release(transfer_manager, multimodal_output, request, is_finished=False):
    frames = transfer_manager.code_prompt_token_ids[request.external_req_id]
    return _Payload(frames[-2:], finished=is_finished) if len(frames) >= 2 else None


def _module() -> types.ModuleType:
    mod = types.ModuleType("fake_qwen3_tts")
    mod.talker2code2wav_async_chunk = _release
    return mod


def _manager() -> types.SimpleNamespace:
    return types.SimpleNamespace(code_prompt_token_ids={"speech-1": [[7, 1, 2], [8, 3, 4]]})


REQUEST = types.SimpleNamespace(request_id="speech-1-ab", external_req_id="speech-1")


def test_each_payload_is_one_line_with_codebook_0_of_its_frames(tmp_path: Path) -> None:
    mod = _module()
    assert ct.wrap_chunker(mod, "talker2code2wav_async_chunk", ct.ChunkWriter(str(tmp_path)), None)
    wrapped = mod.talker2code2wav_async_chunk
    assert (wrapped.__name__, wrapped.__module__) == (_release.__name__, _release.__module__)
    assert list(inspect.signature(wrapped).parameters) == ["transfer_manager", "multimodal_output", "request",
                                                         "is_finished"]
    out = wrapped(transfer_manager=_manager(), multimodal_output={}, request=REQUEST, is_finished=True)
    assert out.codes.audio.tolist() == [7, 8, 1, 3, 2, 4]
    none = types.SimpleNamespace(code_prompt_token_ids={"speech-1": [[7, 1, 2]]})
    assert wrapped(none, {}, REQUEST, False) is None  # nothing sent: no line
    lines = [json.loads(x) for f in tmp_path.glob(ct.CHUNK_GLOB) for x in f.read_text().splitlines()]
    assert [{k: v for k, v in ln.items() if k not in ("pid", "time")} for ln in lines] == [
        {"request_id": "speech-1-ab", "external_req_id": "speech-1", "frames": [7, 8], "left_context": 0,
         "finished": True, "quantizers": 3, "values": 6, "seq": 0}]
    assert not ct.wrap_chunker(mod, "talker2code2wav_async_chunk", None, None)  # wrapped once only
    assert ct.release_chunker() is _release


def test_an_arms_chunker_runs_in_place_of_the_release(tmp_path: Path) -> None:
    mod = _module()
    ct.wrap_chunker(mod, "talker2code2wav_async_chunk", ct.ChunkWriter(str(tmp_path)),
                    "tests.test_chunk_trace:_first_frame_only")
    out = mod.talker2code2wav_async_chunk(_manager(), {}, REQUEST, False)
    assert out.codes.audio.tolist() == [8, 3, 4]
    line = json.loads(next(tmp_path.glob(ct.CHUNK_GLOB)).read_text())
    assert (line["frames"], line["finished"]) == ([8], False)


def _first_frame_only(transfer_manager, multimodal_output, request, is_finished=False):
    return _Payload(transfer_manager.code_prompt_token_ids[request.external_req_id][-1:])


def test_a_chunker_that_cannot_be_bound_refuses_every_window() -> None:
    mod = _module()
    ct.wrap_chunker(mod, "talker2code2wav_async_chunk", None, "tests.no_such_module:chunker")
    with pytest.raises(RuntimeError, match="chunker 'tests.no_such_module:chunker' could not be bound"):
        mod.talker2code2wav_async_chunk(_manager(), {}, REQUEST, False)


def test_a_streaming_deploy_traces_its_connector_and_binds_an_arms_chunker(tmp_path: Path) -> None:
    from harness.config import ArmSpec, load_deploy
    from harness.serve.backend import chunker_env

    release = ArmSpec(name="r", talker="vllm-omni:0.30.0", family="qwen3-tts")
    drops = ArmSpec(name="d", talker="harness.families.qwen3_tts.fix:Qwen3TTSFixedTalker", family="qwen3-tts",
                    chunker="tests.fixtures.chunkers:drop_a_frame")
    builder = "vllm_omni.model_executor.stage_input_processors.qwen3_tts:talker2code2wav_async_chunk"
    assert chunker_env(release, load_deploy("qwen3-tts-cpu-stress")) == {ct.ENV_CHUNKER: builder}
    assert chunker_env(release, load_deploy("qwen3-tts-cpu-full-stress")) == {}  # one decode per request
    assert chunker_env(drops, load_deploy("qwen3-tts-cpu-reference")) == {
        ct.ENV_CHUNKER: builder, ct.ENV_CHUNKER_ARM: "tests.fixtures.chunkers:drop_a_frame"}
    assert chunker_env(release, load_deploy("cpu-stress")) == {}  # Qwen2.5-Omni: no connector chunker


def test_a_chunker_arm_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    from clikit import assert_one_line_error
    from conftest import run_cli

    arms, bad = tmp_path / "arms.yaml", tmp_path / "bad.yaml"
    arms.write_text("arms:\n  odd:\n    talker: harness.families.qwen2_5_omni.pr:FixedTalker\n"
                    "    chunker: tests.fixtures.chunkers:drop_a_frame\n")
    bad.write_text("arms:\n  bad:\n    talker: a.b:C\n    chunker: nope\n")
    res = run_cli("run", "--arms-file", str(arms), "--arm", "odd", "--deploy", "cpu-reference", "--prompts",
                  "cpu_smoke", "--asr", "none", "--out", str(tmp_path / "o"))
    assert_one_line_error(res, "arm 'odd': chunker tests.fixtures.chunkers:drop_a_frame runs in the real server's "
                               "Talker worker (--backend vllm-omni); the sim models the release's connector windows")
    res = run_cli("run", "--arms-file", str(bad), "--arm", "bad", "--deploy", "cpu-reference", "--prompts",
                  "cpu_smoke", "--asr", "none", "--out", str(tmp_path / "o"))
    assert_one_line_error(res, f"{bad}: arms.bad.chunker: must be 'package.module:attr', got 'nope'")
    assert not (tmp_path / "o").exists()


def test_a_window_of_qwen3_omni_frames_held_as_1_by_q_tensors_gives_codebook_0() -> None:
    """Qwen3-Omni's connector holds each frame as a ``[1, Q]`` tensor (``code_predictor_codes``): Q is its
    element count, not its length (1), so the line names codebook 0 of each frame, not every value."""
    held = [torch.tensor([[7, 1, 2]]), torch.tensor([[8, 3, 4]])]
    manager = types.SimpleNamespace(code_prompt_token_ids={"chatcmpl-x": held})
    request = types.SimpleNamespace(request_id="chatcmpl-x-1f", external_req_id="chatcmpl-x")
    payload = _Payload([[7, 1, 2], [8, 3, 4]], left=1, finished=True)
    assert ct.payload_line(payload, request, manager) == {
        "request_id": "chatcmpl-x-1f", "external_req_id": "chatcmpl-x", "frames": [7, 8], "left_context": 1,
        "finished": True, "quantizers": 3, "values": 6}
