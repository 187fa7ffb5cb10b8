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
