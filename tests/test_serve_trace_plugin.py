"""The vLLM general plugin that traces talker_preprocess: exact fields, inert without the env var."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.serve import trace_plugin
from harness.serve.trace_plugin import TRACE_KEYS, TraceWriter, register, wrap_talker_preprocess


class Ids:
    """A tensor stand-in: ``shape`` and the span's offset in the step's flattened batch."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.shape = (n,)
        self._offset = offset

    def storage_offset(self) -> int:
        return self._offset


class Embeds:
    def __init__(self, rows: int) -> None:
        self.shape = (rows, 8)


def make_stub():
    class Stub:
        """Same contract as Qwen2_5OmniForConditionalGeneration (0.30.0): preprocess registered in __init__."""

        calls = 0

        def __init__(self) -> None:
            self.preprocess = self.talker_preprocess

        def talker_preprocess(self, input_ids, input_embeds, **info_dict):
            type(self).calls += 1
            if info_dict.get("boom"):
                raise IndexError("list index out of range")
            n = input_ids.shape[0]
            rows = info_dict["_omni_prompt_len"] if n > 1 else 1
            return ("ids", Embeds(rows), {"update": True})

    return Stub


def read(directory: Path) -> list[dict]:
    files = list(directory.glob("trace-*.jsonl"))
    assert len(files) == 1
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def call(model, rid: str, P: int, c: int, n: int, offset: int = 0, **extra):
    return model.preprocess(input_ids=Ids(n, offset), input_embeds=None, request_id=rid, _omni_prompt_len=P,
                            _omni_num_computed_tokens=c, _omni_is_prefill=c < P, **extra)


def test_wrapper_records_exact_fields_and_returns_unchanged(tmp_path):
    Stub = make_stub()
    assert wrap_talker_preprocess(Stub, TraceWriter(str(tmp_path))) is True
    model = Stub()
    out = call(model, "chatcmpl-a-1234abcd", P=20, c=8, n=8, offset=0)
    assert out[0] == "ids" and out[1].shape == (20, 8) and out[2] == {"update": True}
    call(model, "chatcmpl-b", P=30, c=30, n=1, offset=8)
    lines = read(tmp_path)
    assert [sorted(ln) for ln in lines] == [sorted(TRACE_KEYS)] * 2
    first = {k: v for k, v in lines[0].items() if k != "time"}
    assert first == {"request_id": "chatcmpl-a-1234abcd", "_omni_prompt_len": 20, "_omni_num_computed_tokens": 8,
                     "span_len": 8, "_omni_is_prefill": True, "rows": 20, "step": 0, "seq": 0, "pid": os.getpid(),
                     "error": None}
    assert (lines[1]["request_id"], lines[1]["_omni_is_prefill"], lines[1]["rows"], lines[1]["step"],
            lines[1]["seq"]) == ("chatcmpl-b", False, 1, 0, 1)
    assert Stub.calls == 2


def test_wrapping_twice_is_a_no_op(tmp_path):
    Stub = make_stub()
    writer = TraceWriter(str(tmp_path))
    assert wrap_talker_preprocess(Stub, writer) is True
    assert wrap_talker_preprocess(Stub, writer) is False
    call(Stub(), "r", P=4, c=0, n=4)
    assert len(read(tmp_path)) == 1


def test_step_inference_new_step_on_repeat_or_offset_reset(tmp_path):
    Stub = make_stub()
    wrap_talker_preprocess(Stub, TraceWriter(str(tmp_path)))
    m = Stub()
    call(m, "a", 20, 0, 8, offset=0)
    call(m, "b", 20, 0, 8, offset=8)  # same step: offset grows, new request
    call(m, "c", 20, 0, 8, offset=0)  # offset back to 0: next step
    call(m, "c", 20, 8, 8, offset=16)  # same request again: next step
    assert [ln["step"] for ln in read(tmp_path)] == [0, 0, 1, 2]


def test_exception_is_recorded_and_re_raised(tmp_path):
    Stub = make_stub()
    wrap_talker_preprocess(Stub, TraceWriter(str(tmp_path)))
    with pytest.raises(IndexError, match="list index out of range"):
        call(Stub(), "r", P=10, c=0, n=10, boom=True)
    (line,) = read(tmp_path)
    assert line["rows"] is None and line["error"] == "IndexError: list index out of range"


def test_register_is_inert_without_env(monkeypatch):
    monkeypatch.delenv("OMNI_STRESS_TRACE", raising=False)
    before = list(sys.meta_path)
    register()
    assert sys.meta_path == before


def test_register_is_inert_when_env_is_not_a_directory(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("OMNI_STRESS_TRACE", str(tmp_path / "missing"))
    before = list(sys.meta_path)
    register()
    assert sys.meta_path == before
    assert "is not a directory" in capsys.readouterr().err


def test_register_hooks_the_module_before_the_class_is_built(monkeypatch, tmp_path):
    """The real path: register() first, then the model module is imported and the Talker built."""
    pkg = tmp_path / "src" / "fake_omni_pkg_hook"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(
        "class Model:\n"
        "    def __init__(self):\n"
        "        self.preprocess = self.talker_preprocess\n"
        "    def talker_preprocess(self, input_ids, input_embeds, **info):\n"
        "        return input_ids, type('E', (), {'shape': (info['_omni_prompt_len'], 4)})(), {}\n"
    )
    trace = tmp_path / "trace"
    trace.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setenv("OMNI_STRESS_TRACE", str(trace))
    monkeypatch.setenv("OMNI_STRESS_TRACE_TARGET", "fake_omni_pkg_hook.model:Model")
    saved_meta = list(sys.meta_path)
    try:
        register()
        hooks = [f for f in sys.meta_path if isinstance(f, trace_plugin.PostImportHook)]
        assert [h.fullname for h in hooks] == ["fake_omni_pkg_hook.model"]
        from fake_omni_pkg_hook.model import Model

        assert not any(isinstance(f, trace_plugin.PostImportHook) for f in sys.meta_path)  # removed once fired
        call(Model(), "req-1", P=12, c=4, n=8)
        (line,) = read(trace)
        assert (line["request_id"], line["_omni_prompt_len"], line["_omni_num_computed_tokens"], line["span_len"],
                line["rows"]) == ("req-1", 12, 4, 8, 12)
        register()  # a second registration (vLLM loads plugins in every process, maybe twice) wraps nothing again
        call(Model(), "req-2", P=12, c=12, n=1)
        assert len(read(trace)) == 2
    finally:
        sys.meta_path[:] = saved_meta
        for name in [m for m in sys.modules if m.startswith("fake_omni_pkg_hook")]:
            del sys.modules[name]
        trace_plugin._installed.clear()


def test_plugin_module_imports_only_the_standard_library():
    """vLLM imports it inside the arm's environment, where only omni-stress itself (--no-deps) is installed."""
    code = ("import sys; import harness.serve.trace_plugin; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'httpx', 'yaml', 'torch', 'aiohttp', 'click', "
            "'pandas', 'numpy', 'vllm'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
