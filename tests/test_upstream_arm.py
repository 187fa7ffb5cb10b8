"""The ``vllm-omni:<source>`` arm: the real upstream code on the sim, checked against the ``main`` port.

The fixture is vLLM-Omni 0.30.0's ``qwen2_5_omni.py`` copied verbatim from the PyPI wheel
(``vllm_omni-0.30.0-py3-none-any.whl``, Apache-2.0); its hash is pinned below, so a changed
fixture fails loudly instead of silently testing other code.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from simkit import FakeRequest

from harness.cli import main as cli_main
from harness.config import ArmSpec, load_arms, load_prompts
from harness.talkers import resolve_arm
from harness.errors import ConfigError
from harness.records import read_requests
from harness.families.qwen2_5_omni.model import bind_arm
from harness.sim.rows import DIM, NONE, RowSpace
from harness.families.qwen2_5_omni.sim import SimContract
from harness.sim.runner import SimRunner
from harness.families.qwen2_5_omni.thinker import run_thinker, token_id_table
from harness.talkers import load_impl
from harness.families.qwen2_5_omni.arms import load_upstream
from harness.families.qwen2_5_omni.main import MainTalker
from harness.families.qwen2_5_omni.model import SimTalkerModelBase
from harness.talkers.upstream import (
    MEMBER,
    UpstreamUnavailable,
    build_mixin,
    read_source,
    upstream_info,
)

FIXTURES = Path(__file__).parent / "fixtures"
UPSTREAM_FILE = FIXTURES / "upstream" / "vllm_omni_0_30_0_qwen2_5_omni.py"
UPSTREAM_VERSION = "0.30.0"
UPSTREAM_SHA256 = "de8b86f60d04dcb2d610e0893afa265fbc8edf5b140af7602b87d6a881c5c51d"
PROMPTS = FIXTURES / "prompts_upstream.yaml"
TINY_KV_DEPLOY = Path(__file__).parent / "data" / "deploy_tiny_kv.yaml"
PREPROCESS_METHODS = ("_get_embed_text_spk_token", "talker_preprocess", "thinker_to_talker_process",
                      "_thinker_to_talker_prefill", "thinker_to_talker_decode_one_step",
                      "_thinker_to_talker_decode_one_step")


def _arm(source: str | Path, name: str = "upstream") -> ArmSpec:
    return ArmSpec(name=name, talker=f"vllm-omni:{source}", source="--arm")


def _wheel(tmp: Path, version: str = UPSTREAM_VERSION, member: str = MEMBER) -> Path:
    """A wheel-shaped zip holding the fixture, as ``pip download vllm-omni==X --no-deps`` leaves one."""
    wheel = tmp / f"vllm_omni-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, UPSTREAM_FILE.read_bytes())
        zf.writestr(f"vllm_omni-{version}.dist-info/METADATA", f"Metadata-Version: 2.4\nName: vllm-omni\nVersion: {version}\n")
    return wheel


@pytest.fixture(scope="module")
def upstream_cls() -> type:
    return load_upstream(_arm(UPSTREAM_FILE))


def test_fixture_is_the_pinned_upstream_file(upstream_cls: type) -> None:
    data = UPSTREAM_FILE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == UPSTREAM_SHA256
    assert data.startswith(b"# SPDX-License-Identifier: Apache-2.0\n")
    info = upstream_info(upstream_cls)
    assert info is not None and info.source.sha256 == UPSTREAM_SHA256 and info.source.kind == "file"
    assert info.methods == PREPROCESS_METHODS  # talker_preprocess and everything it reaches, source order
    assert info.from_stand_in == ("_module_device",)  # upstream's walks nn.Module parameters
    assert info.stubbed == ()  # this path needs nothing from vLLM
    assert upstream_cls.talker_preprocess.__code__.co_filename == str(UPSTREAM_FILE)
    assert upstream_cls.talker_preprocess.__code__.co_firstlineno == 686  # the upstream line numbers


# ----------------------------------------------------------------------------- same spans, same rows


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class Rig:
    """One arm bound onto the stand-in, with the runner and three requests; records every return."""

    def __init__(self, impl: Any) -> None:
        self.space = RowSpace(0)
        self.model = bind_arm(impl, self.space)
        self.model.profile_run(32)  # the shared fallback pool: 32 zero rows
        outputs = run_thinker(load_prompts(str(PROMPTS)), self.space, 1.0)
        table = token_id_table(outputs)
        self.runner = SimRunner(self.model, self.space, ("arm", "stress", 1), SimContract(self.model, self.space))
        self.reqs: dict[str, FakeRequest] = {}
        self.P: dict[str, int] = {}
        self.K: dict[str, int] = {}
        for out in outputs:
            payload = out.payload(table)
            if out.request_id == "p08-budget":  # an empty Thinker output
                payload["hidden_states"]["output"] = torch.zeros(0, DIM)
                payload["ids"]["output"] = []
            self.runner.add_request(out, payload, 4000)
            self.reqs[out.request_id] = FakeRequest(out.request_id, out.talker_prompt_ids,
                                                    out.talker_prompt_ids + list(range(200, 400)))
            self.P[out.request_id], self.K[out.request_id] = out.P, out.output_rows.shape[0]
        self.returns: list[Any] = []
        inner = self.model.talker_preprocess

        def recording(*args: Any, **kwargs: Any) -> Any:
            try:
                out = inner(*args, **kwargs)
            except Exception as exc:
                self.returns.append(("raised", type(exc).__name__, str(exc)))
                raise
            self.returns.append(_snapshot(out))
            return out

        self.model.talker_preprocess = recording

    def call(self, rid: str, c: int, n: int):
        return self.runner.call(self.reqs[rid], c, n, step=len(self.returns))


def _schedule(P: dict[str, int], K: dict[str, int]) -> list[tuple[str, int, int]]:
    """Every span kind the stress deploy produces, in an order that exercises the per-request state."""
    a, b, e = "p01-weather", "p02-bread", "p08-budget"
    pa, pb = P[a], P[b]
    s: list[tuple[str, int, int]] = [(a, 0, pa)]  # full prefill
    s += [(a, pa + i, 1) for i in range(3)]  # decode steps
    s += [(a, pa + 3, 3)]  # multi-position decode span
    s += [(b, 0, 32), (b, 32, 32), (b, 64, pb - 65), (b, pb - 1, 1)]  # chunks; one-token tail c=P-1 n=1
    s += [(b, pb + i, 1) for i in range(2)]
    s += [(a, 0, 32), (a, 32, pa - 32 + 6)]  # replay after preemption, crossing P
    s += [(a, pa + 6 + i, 1) for i in range(K[a] + 8)]  # past the end of the reply queue, into the pool
    s += [(b, pb + 2 + i, 1) for i in range(K[b] + 30)]  # B drains its queue and the shared pool, then nothing
    s += [(e, 0, P[e])]  # empty Thinker output: IndexError in both
    return s


def test_upstream_and_main_return_identical_rows_on_every_span(upstream_cls: type) -> None:
    up, ref = Rig(upstream_cls), Rig(MainTalker)
    assert up.P == {"p01-weather": 61, "p02-bread": 80, "p08-budget": 114}
    schedule = _schedule(up.P, up.K)
    for i, (rid, c, n) in enumerate(schedule):
        r_up, r_ref = up.call(rid, c, n), ref.call(rid, c, n)
        got, want = up.returns[i], ref.returns[i]
        assert _same(got, want), f"call {i} {rid} c={c} n={n}: upstream {got!r} != main {want!r}"
        assert r_up.span == r_ref.span and r_up.error == r_ref.error, f"call {i} {rid} c={c} n={n}"
    assert len(up.returns) == len(schedule)
    # the schedule reached every branch: a chunk given all P prompt rows, a one-row decode, the raise,
    # the shared pool drained, and then decode rows with no text component
    rows_of = {(rid, c, n): r for (rid, c, n), r in zip(schedule, up.returns)}
    assert rows_of[("p02-bread", 32, 32)][1].shape[0] == up.P["p02-bread"]
    assert rows_of[("p02-bread", up.P["p02-bread"] - 1, 1)][1].shape[0] == 1
    assert rows_of[("p08-budget", 0, up.P["p08-budget"])] == ("raised", "IndexError", "list index out of range")
    assert up.model.thinker_reply_part.numel() == 0 and ref.model.thinker_reply_part.numel() == 0
    last_text, last_codec = up.space.identify(up.returns[-2][1])
    assert int(last_text[0]) == NONE and int(last_codec[0]) == 200 + up.K["p02-bread"] + 31
    assert _same(up.runner.buffer, ref.runner.buffer)
    for rid in up.runner.kv:
        assert torch.equal(up.runner.kv[rid].text, ref.runner.kv[rid].text)
        assert torch.equal(up.runner.kv[rid].codec, ref.runner.kv[rid].codec)


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_cli_run_upstream_and_main_speak_the_same_codec_tokens(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli_main, [
        # a KV cache small enough that these 3 requests are preempted whatever they say (under the
        # seed's stress deploy a babbling main Talker may end before any preemption: issue 13)
        "run", "--asr", "none", "--prompts", str(PROMPTS), "--deploy", str(TINY_KV_DEPLOY), "--quiet",
        "--arm", f"upstream=vllm-omni:{UPSTREAM_FILE}", "--arm", "main", "--out", str(tmp_path), "--run-id", "r"])
    assert res.exit_code == 0, res.output
    by: dict[str, dict[str, Any]] = {}
    for rec in read_requests(tmp_path / "r"):
        by.setdefault(rec.prompt_id, {})[rec.arm] = rec
    assert sorted(by) == ["p01-weather", "p02-bread", "p08-budget"]
    for pid, recs in by.items():
        assert recs["upstream"].codec_tokens == recs["main"].codec_tokens, pid
        assert recs["upstream"].events == recs["main"].events, pid
        assert recs["upstream"].error is None
    # the deploy did stress: chunks at non-zero offsets and a replay across the prompt boundary
    assert sum(r["main"].events.nonzero_offset_chunks for r in by.values()) > 0
    assert sum(r["main"].events.cross_boundary_replays for r in by.values()) > 0


# ----------------------------------------------------------------------------- where the source comes from


def test_sources_wheel_checkout_and_version_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    wheel = _wheel(wheels)
    src = read_source(str(wheel))
    assert (src.kind, src.version, src.sha256) == ("wheel", UPSTREAM_VERSION, UPSTREAM_SHA256)
    assert src.location == f"{wheel}!{MEMBER}"
    monkeypatch.setenv("OMNI_STRESS_CACHE_DIR", str(tmp_path / "cache"))
    src = read_source(UPSTREAM_VERSION)
    assert (src.kind, src.version, src.sha256) == ("wheel-cache", UPSTREAM_VERSION, UPSTREAM_SHA256)
    checkout = tmp_path / "vllm-omni"
    (checkout / MEMBER).parent.mkdir(parents=True)
    (checkout / MEMBER).write_bytes(UPSTREAM_FILE.read_bytes())
    (checkout / "vllm_omni" / "_version.py").write_text("__version__ = version = '0.30.0'\n")
    src = read_source(str(checkout))
    assert (src.kind, src.version, src.sha256) == ("checkout", "0.30.0", UPSTREAM_SHA256)
    assert read_source("vllm-omni", base_dir=tmp_path).location == str(checkout / MEMBER)  # relative path
    assert upstream_info(load_upstream(_arm(UPSTREAM_VERSION))).source.kind == "wheel-cache"


def test_resolve_arm_accepts_upstream_arms(tmp_path: Path) -> None:
    arm = resolve_arm(f"up=vllm-omni:{UPSTREAM_FILE}", load_arms())
    assert (arm.name, arm.talker, arm.source) == ("up", f"vllm-omni:{UPSTREAM_FILE}", "--arm")
    assert upstream_info(load_impl(arm)).source.sha256 == UPSTREAM_SHA256
    (tmp_path / "sub").mkdir()
    _wheel(tmp_path / "sub")
    arms_file = tmp_path / "arms.yaml"  # a relative source resolves against the arms file's folder
    arms_file.write_text("arms:\n  released:\n    talker: vllm-omni:sub/vllm_omni-0.30.0-py3-none-any.whl\n")
    arm = resolve_arm("released", load_arms(arms_file))
    info = upstream_info(load_impl(arm))
    assert info.source.version == UPSTREAM_VERSION and info.source.kind == "wheel"
    with pytest.raises(ConfigError, match=r"expected NAME, NAME=package.module:attr or NAME=vllm-omni:<source>"):
        resolve_arm("up=vllm-omni:", {})


# ----------------------------------------------------------------------------- clear errors


def test_missing_file_is_a_clear_error_at_resolve_time(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "qwen2_5_omni.py"
    with pytest.raises(ConfigError, match=rf"arm 'up' \(from --arm\): vllm-omni:{missing}: no such file or folder"):
        resolve_arm(f"up=vllm-omni:{missing}", {})


def test_folder_that_is_not_a_checkout(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"holds no vllm_omni/model_executor/.*: not a vLLM-Omni checkout"):
        load_upstream(_arm(tmp_path))


def test_missing_class_method_and_syntax_error(tmp_path: Path) -> None:
    f = tmp_path / "qwen2_5_omni.py"
    f.write_text("import torch\n\nclass Qwen2_5OmniThinker:\n    pass\n")
    with pytest.raises(ConfigError, match=rf"\({f}\): no top-level class Qwen2_5OmniForConditionalGeneration"):
        load_upstream(_arm(f))
    f.write_text("class Qwen2_5OmniForConditionalGeneration:\n    def forward(self):\n        pass\n")
    with pytest.raises(ConfigError, match=r"class Qwen2_5OmniForConditionalGeneration has no method talker_preprocess"):
        load_upstream(_arm(f))
    f.write_text("class Qwen2_5OmniForConditionalGeneration:\n    def talker_preprocess(self\n")
    with pytest.raises(ConfigError, match=r"syntax error at line 2"):
        load_upstream(_arm(f))
    wheel = _wheel(tmp_path, member="vllm_omni/other.py")
    with pytest.raises(ConfigError, match=rf"wheel {wheel} has no member {MEMBER}"):
        load_upstream(_arm(wheel))


def test_version_not_in_cache_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STRESS_CACHE_DIR", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    _wheel(tmp_path / "wheels")
    wheels = tmp_path / "wheels"
    with pytest.raises(ConfigError) as info:
        resolve_arm("new=vllm-omni:0.31.0", {})
    msg = str(info.value)
    assert msg.startswith("arm 'new' (from --arm): vllm-omni:0.31.0: vLLM-Omni 0.31.0 is not installed and not in "
                          f"the wheel cache {wheels} (cached: 0.30.0)")
    assert msg.endswith(f"`pip download vllm-omni==0.31.0 --no-deps -d {wheels}`")


# ----------------------------------------------------------------------------- a newer checkout's shape

NEWER = '''
import math
import torch
from vllm.model_executor.models.utils import maybe_prefix
from vllm_omni.data_entry_keys import OmniPayload

STEP = 2


def _scale(x):
    return x * STEP


class Qwen2_5OmniForConditionalGeneration(SomeVllmBase):
    @support_torch_compile_never_called
    def forward(self):
        pass

    def talker_preprocess(self, input_ids: torch.Tensor, input_embeds, **info: OmniPayload):
        if input_ids.shape[0] > 1:
            return self.thinker_to_talker_decode(input_ids, input_embeds, info)
        return input_ids, self.__private(input_embeds), {}

    def thinker_to_talker_decode(self, input_ids, input_embeds, payload: OmniPayload):
        if payload.get("explode"):
            maybe_prefix("a", "b")
        return input_ids, _scale(input_embeds) + math.floor(0.5), {"n": self._module_device(self.talker).type}

    def __private(self, e):
        return e + 1
'''


def test_new_helpers_are_found_and_vllm_names_fail_only_when_reached(tmp_path: Path) -> None:
    f = tmp_path / "qwen2_5_omni.py"
    f.write_text(NEWER)
    cls = load_upstream(_arm(f))
    info = upstream_info(cls)
    assert info.methods == ("talker_preprocess", "thinker_to_talker_decode", "__private")
    assert info.stubbed == ("maybe_prefix",)
    model = bind_arm(cls, RowSpace(0))
    ids, rows, upd = model.talker_preprocess(torch.tensor([1, 2]), torch.ones(2, 3))
    assert torch.equal(rows, torch.full((2, 3), 2.0)) and upd == {"n": "cpu"}
    _, rows, _ = model.talker_preprocess(torch.tensor([1]), torch.ones(1, 3))  # name mangling kept
    assert torch.equal(rows, torch.full((1, 3), 2.0))
    with pytest.raises(UpstreamUnavailable, match=r"reached 'maybe_prefix' \(from vllm.model_executor.models.utils "
                                                  r"import maybe_prefix\), which needs vLLM"):
        model.talker_preprocess(torch.tensor([1, 2]), torch.ones(2, 3), explode=True)


def test_attribute_the_stand_in_lacks_is_named(tmp_path: Path) -> None:
    f = tmp_path / "qwen2_5_omni.py"
    f.write_text("class Qwen2_5OmniForConditionalGeneration:\n"
                 "    def talker_preprocess(self, input_ids, input_embeds, **info):\n"
                 "        if hasattr(self, 'maybe'):\n"
                 "            self.maybe()\n"
                 "        return input_ids, input_embeds * self.talker_scale, {}\n")
    with pytest.raises(ConfigError, match=r"uses self.talker_scale \(line 5\), which the sim's stand-in model "
                                          r"\(harness.families.qwen2_5_omni.model.SimTalkerModelBase\) does not provide"):
        build_mixin(read_source(str(f)), SimTalkerModelBase)
