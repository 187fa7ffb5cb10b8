"""Issue 34, item 1: the trace plugin reads no device value back inside a traced call, offers levels
(off / spans / contract) and, when asked, times its own cost per runner step.

Reads back are counted on ``torch.Tensor`` itself (every method that turns a tensor's values into
Python: ``tolist``, ``item``, ``__bool__``, ...), only while the instrumentation runs (the arm's own
calls are not the plugin's). The host copy is a fake that lands only when the test says so, as a
device's would: until then no line of the call is written; after it, each line costs exactly one
conversion. Run on the sim's model host (the release helpers vLLM-Omni's model has)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from harness.config import load_prompts
from harness.serve import trace_plugin
from harness.serve.trace_plugin import (ENV_CONTRACT, ENV_LEVEL, TIMING_GLOB, TraceWriter, install, trace_level,
                                        wrap_talker_preprocess)
from harness.serve.worker_contract import ROW_ID_DIMS, count_misaligned, tag_payload
from harness.families.qwen2_5_omni.model import bind_arm
from harness.sim.rows import RowSpace
from harness.families.qwen2_5_omni.thinker import run_thinker, token_id_table
from harness.families.qwen2_5_omni.main import MainTalker
from harness.families.qwen2_5_omni.pr import FixedTalker

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu")


class Reads:
    """Counts value read-backs on every tensor while ``on``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[str] = []
        self.on = True
        for name in READS:
            real = getattr(torch.Tensor, name)

            def counted(tensor, *args, _real=real, _name=name, **kwargs):  # noqa: ANN001, ANN202
                if self.on:
                    self.seen.append(_name)
                return _real(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


class FakeCopy:
    """A device copy in flight: lands when the test sets ``landed``."""

    made: list[FakeCopy] = []
    landed = threading.Event()

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        FakeCopy.made.append(self)

    def ready(self) -> bool:
        return FakeCopy.landed.is_set()

    def wait(self) -> None:
        assert FakeCopy.landed.wait(timeout=60)

    def values(self) -> list[int]:
        return self.flat.tolist()


def _setup(impl: type, reads: Reads | None = None) -> tuple[type, object, dict, list[int]]:
    """A fresh model class (the arm bound, as the server binds it), the call payload with Thinker rows
    zero in the identity dimensions (the speaking checkpoint's), and the span ids (prompt, then codecs)."""
    space = RowSpace(0)
    model = bind_arm(impl, space)
    model.profile_run(64)
    out = run_thinker(load_prompts("default"), space, 1.0)[0]
    info = {**out.payload(token_id_table([out])), "_omni_prompt_len": out.P, "request_id": out.request_id}
    for rows in (info["embed"]["prefill"], info["hidden_states"]["output"]):
        rows[:, list(ROW_ID_DIMS)] = 0
    cls = type(model)
    if reads is not None:
        arm = cls.talker_preprocess

        def paused(self, *args, **kwargs):  # noqa: ANN001, ANN202 - the arm's own reads are not the plugin's
            reads.on = False
            try:
                return arm(self, *args, **kwargs)
            finally:
                reads.on = True

        cls.talker_preprocess = paused
        embed = model.talker.embed_input_ids

        def embed_paused(ids):  # noqa: ANN001, ANN202 - the stand-in's lookup goes through numpy; vLLM's is an
            reads.on = False  # nn.Embedding on the device
            try:
                return embed(ids)
            finally:
                reads.on = True

        model.talker.embed_input_ids = embed_paused
    return cls, model, info, list(out.talker_prompt_ids) + [7, 8, 9, 10, 11, 12] * 40


def _call(model: object, info: dict, ids_all: list[int], c: int, n: int) -> tuple:
    ids = torch.tensor(ids_all[c:c + n], dtype=torch.int64)
    embeds = model.talker.embed_input_ids(ids)
    call = {**info, "_omni_num_computed_tokens": c, "_omni_is_prefill": c < info["_omni_prompt_len"]}
    return model.preprocess(input_ids=ids, input_embeds=embeds, **call) if hasattr(model, "preprocess") else \
        model.talker_preprocess(input_ids=ids, input_embeds=embeds, **call)


def _lines(directory: Path, glob: str = "trace-*.jsonl") -> list[dict]:
    return [json.loads(ln) for p in sorted(directory.glob(glob)) for ln in p.read_text().splitlines()]


def _expected(impl: type, c: int, n: int) -> dict:
    """The same call checked the synchronous way (``tag_payload`` + ``count_misaligned``)."""
    _, model, info, ids_all = _setup(impl)
    ids = torch.tensor(ids_all[c:c + n], dtype=torch.int64)
    embeds = model.talker.embed_input_ids(ids)
    call = tag_payload({**info, "_omni_num_computed_tokens": c, "_omni_is_prefill": c < info["_omni_prompt_len"]})
    result = model.talker_preprocess(input_ids=ids, input_embeds=embeds, **call)
    return count_misaligned(model, call, ids.clone(), result, embeds, row_ids=True)


@pytest.fixture
def row_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STRESS_ROW_IDS", "1")
    monkeypatch.delenv(ENV_LEVEL, raising=False)
    monkeypatch.delenv(ENV_CONTRACT, raising=False)


def test_a_traced_call_reads_nothing_back_and_each_line_converts_once_when_its_copy_lands(tmp_path, monkeypatch,
                                                                                          row_ids) -> None:
    reads = Reads(monkeypatch)
    FakeCopy.made, FakeCopy.landed = [], threading.Event()
    monkeypatch.setattr(trace_plugin, "start_host_copy", FakeCopy)
    cls, model, info, ids_all = _setup(MainTalker, reads)
    writer = TraceWriter(str(tmp_path))
    assert wrap_talker_preprocess(cls, writer)
    P = info["_omni_prompt_len"]
    spans = [(0, 16), (16, 32), (P, 1), (P + 1, 1)]  # one request: each call its own step
    reads.seen.clear()
    for c, n in spans:
        _call(model, info, ids_all, c, n)
    assert reads.seen == []  # not one value read back inside a call
    assert len(FakeCopy.made) == len(spans)  # one packed copy per call: mask and codec ids together
    assert [int(f.flat.shape[0]) for f in FakeCopy.made] == [16, 32, 1 + 1, 1 + 1]
    assert _lines(tmp_path) == []  # nothing written while the values are in flight
    FakeCopy.landed.set()
    writer.flush()
    assert reads.seen == ["tolist"] * len(spans)  # one conversion per line, after the copy landed
    lines = _lines(tmp_path)
    assert [(ln["_omni_num_computed_tokens"], ln["span_len"], ln["step"], ln["seq"]) for ln in lines] == [
        (0, 16, 0, 0), (16, 32, 1, 1), (P, 1, 2, 2), (P + 1, 1, 3, 3)]
    for (c, n), line in zip(spans, lines):
        want = _expected(MainTalker, c, n)
        got = {k: line[k] for k in ("misaligned_text", "misaligned_end", "first_misaligned", "text_len") if k in line}
        assert got == want, (c, n)
    assert lines[1]["misaligned_text"] == 32 and lines[1]["first_misaligned"] == 16  # main's chunk, by identity
    assert [(ln.get("codec_from"), ln.get("codec_ids")) for ln in lines] == [
        (None, None), (None, None), (P, [ids_all[P]]), (P + 1, [ids_all[P + 1]])]


def test_lines_keep_call_order_and_the_flusher_writes_them_without_another_call(tmp_path, monkeypatch,
                                                                                row_ids) -> None:
    FakeCopy.made, FakeCopy.landed = [], threading.Event()
    monkeypatch.setattr(trace_plugin, "start_host_copy", FakeCopy)
    cls, model, info, ids_all = _setup(FixedTalker)
    writer = TraceWriter(str(tmp_path))
    wrap_talker_preprocess(cls, writer)
    _call(model, info, ids_all, 0, 8)
    assert _lines(tmp_path) == []
    _call(model, info, ids_all, 8, 8)
    assert _lines(tmp_path) == []  # the first line waits for its copy, the second for the first
    FakeCopy.landed.set()
    assert writer.wait_written(timeout_s=60)  # the flusher thread wrote them: no call came after the copies
    assert [(ln["seq"], ln["_omni_num_computed_tokens"]) for ln in _lines(tmp_path)] == [(0, 0), (1, 8)]


def test_on_cpu_every_line_is_written_before_its_call_returns(tmp_path, row_ids) -> None:
    cls, model, info, ids_all = _setup(FixedTalker)
    wrap_talker_preprocess(cls, TraceWriter(str(tmp_path)))
    P = info["_omni_prompt_len"]
    for k, (c, n) in enumerate([(0, 32), (32, P - 32 + 2)]):
        _call(model, info, ids_all, c, n)
        assert len(_lines(tmp_path)) == k + 1
    last = _lines(tmp_path)[-1]
    assert (last["misaligned_text"], last["misaligned_end"], last["codec_from"], last["codec_ids"]) == (
        0, 0, P, ids_all[P:P + 2])


def test_spans_level_traces_without_the_check(tmp_path, monkeypatch, row_ids) -> None:
    monkeypatch.setenv(ENV_LEVEL, "spans")
    cls, model, info, ids_all = _setup(MainTalker)
    wrap_talker_preprocess(cls, TraceWriter(str(tmp_path)))
    P = info["_omni_prompt_len"]
    _call(model, info, ids_all, P, 2)
    (line,) = _lines(tmp_path)
    assert not {"misaligned_text", "misaligned_end", "first_misaligned", "contract_error"} & set(line)
    assert (line["codec_from"], line["codec_ids"]) == (P, ids_all[P:P + 2])


def test_the_level_comes_from_the_environment() -> None:
    assert trace_level({}) == "contract"
    assert trace_level({ENV_CONTRACT: "0"}) == "spans"  # the older switch
    assert trace_level({ENV_LEVEL: "off", ENV_CONTRACT: "0"}) == "off"
    assert trace_level({ENV_LEVEL: "contract", ENV_CONTRACT: "0"}) == "contract"
    assert trace_level({ENV_LEVEL: "loud"}) == "contract"


def test_off_binds_the_arm_and_wraps_nothing(tmp_path, monkeypatch) -> None:
    import sys
    import types

    module = types.ModuleType("fake_off_release")

    class Model:
        def talker_preprocess(self, input_ids, input_embeds, **info):  # noqa: ANN001, ANN202
            return "release"

    module.Model = Model
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert install(str(tmp_path), "fake_off_release:Model", "harness.families.qwen2_5_omni.pr:FixedTalker", trace=False) == "wrapped"
    assert not getattr(Model.talker_preprocess, "__omni_stress_traced__", False)
    assert Model.talker_preprocess is FixedTalker.talker_preprocess
    (impl,) = [json.loads(p.read_text()) for p in tmp_path.glob("implementation-*.json")]
    assert impl["arm"] == "harness.families.qwen2_5_omni.pr:FixedTalker"
    assert list(tmp_path.glob("trace-*.jsonl")) == []


def test_register_at_off_without_an_arm_is_inert(tmp_path, monkeypatch) -> None:
    import sys

    monkeypatch.setenv("OMNI_STRESS_TRACE", str(tmp_path))
    monkeypatch.setenv(ENV_LEVEL, "off")
    monkeypatch.delenv("OMNI_STRESS_ARM", raising=False)
    before = list(sys.meta_path)
    trace_plugin.register()
    assert sys.meta_path == before


def test_timing_lines_split_each_step_into_instrumentation_and_the_rest(tmp_path, row_ids) -> None:
    cls, model, info, ids_all = _setup(FixedTalker)
    wrap_talker_preprocess(cls, TraceWriter(str(tmp_path), timing=True))
    P = info["_omni_prompt_len"]
    for c, n in [(0, 32), (32, P - 32), (P, 1), (P + 1, 1)]:
        _call(model, info, ids_all, c, n)
    timing = _lines(tmp_path, TIMING_GLOB)
    assert [(t["step"], t["calls"], t["level"]) for t in timing] == [(0, 1, "contract"), (1, 1, "contract"),
                                                                      (2, 1, "contract")]
    for t in timing:  # a step runs from its first call's entry to the next step's: its calls lie inside it
        assert 0 < t["instr_thread_s"] <= t["step_thread_s"] and 0 < t["instr_wall_s"] <= t["step_wall_s"], t
    assert [p.name for p in tmp_path.glob(TIMING_GLOB)] == [f"timing-{os.getpid()}.jsonl"]
