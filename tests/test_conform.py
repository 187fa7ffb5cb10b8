"""``omni-stress conform``: the schedule-invariance oracle, its calibration, and real upstream models.

Forced schedules only (no vLLM scheduler) except where a test says otherwise, one request
(``p01-weather``) and 24 generated positions, so each model takes well under a second. The
upstream code is vLLM-Omni 0.30.0 as vendored in ``harness/conform/vendor`` (verbatim from the
PyPI wheel; hashes pinned below) or the Qwen2.5-Omni fixture of ``test_upstream_arm``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from harness.conform.adapter import VENDOR_DIR, Adapter, ConformRequest, fixed_tokens, read_model_source
from harness.conform.check import ModelResult, check_model
from harness.conform.compare import Cell
from harness.conform.models import MODELS
from harness.conform.report import Matrix, format_html, format_json, format_text
from harness.conform.schedules import PREEMPT, forced_schedules
from harness.config import load_deploy
from harness.contract import classify_span

FIXTURE_QWEN25 = Path(__file__).parent / "fixtures" / "upstream" / "vllm_omni_0_30_0_qwen2_5_omni.py"
VENDORED = {
    "vllm_omni/model_executor/models/fish_speech/fish_speech_slow_ar.py":
        "97c48ba57c5e5fac6975bc9a065838c5c7d6482dbdaaa44befede97c30f1b5c4",
    "vllm_omni/model_executor/models/fish_speech/prompt_utils.py":
        "b4eb8597dcb48b7617f952f724905a553c0ed2a346b65748bc3c22b76b61e997",
    "vllm_omni/model_executor/models/gepard/gepard_talker.py":
        "a931bfb26754ab6995d104f44f3d4607a462735a6f3102163b8dd468a5d7c013",
    "vllm_omni/model_executor/models/gepard/prompt.py":
        "ef6effc20f7d4e71cf205d11de72f2e1b2f226cfd669a7ed441dd2b7f2d773d4",
    "vllm_omni/model_executor/models/moss_tts/modeling_moss_tts_talker.py":
        "01f69e8c4e1db642973bdd1df5f6107ac34208d6077864ab3d3ce1529dc3645c",
    "vllm_omni/model_executor/models/glm_tts/glm_tts.py":
        "fe3e8db16be9570bf5235d20eb4d6c974a39ebe5dea1151184a4595a6ee04b4b",
    "vllm_omni/_version.py": "2ade9f96dd56ff65e00062b12ea8523a94eae3dec037a2e3972d40de9f45da7b",
    "vllm_omni/model_executor/models/qwen2_5_omni/qwen2_5_omni.py":
        "de8b86f60d04dcb2d610e0893afa265fbc8edf5b140af7602b87d6a881c5c51d",
    "vllm_omni/model_executor/models/qwen3_omni/qwen3_omni.py":
        "d50550b0048c6987f8ec7827710e95a1ee227d8277586b3743404a9b1c743359",
    "vllm_omni/model_executor/stage_input_processors/qwen3_omni.py":
        "d6ae3f32666139de853a3cfaece1e2ac612a7ba8d755ce732f9d0b111efdf0f5",
    "vllm_omni/model_executor/models/qwen3_tts/qwen3_tts_talker.py":
        "d9cc88373f8081439a019bfa061b91bb26dd7cfca182ec9354eb2d4af8449aa2",
    "vllm_omni/model_executor/models/minicpmo_4_5/minicpmo_4_5_omni_tts.py":
        "bdcc8e9fb1b6e074a2d8d34b3a816978a05bbc2701a64ea75d0ff0ef64601b6e",
    "vllm_omni/model_executor/stage_input_processors/minicpmo_4_5_omni.py":
        "c4f63043488200a356c03760da14f3ab854dea637126840551c571d7cd25c735",
    "vllm_omni/engine/duplex/intermediate.py": "6e8eb6cdc3ca72cd4a0009f78857d75483698d9fc0fc7b1fd52345e8d1c3ed03",
}
GEN = 24  # generated positions per forced schedule: m = 6 decode steps before the first preemption
SITUATIONS = ("chunk", "tail", "multi_decode", "cross_replay", "repeated_replay")


def _check(name: str, source: str = "0.30.0", deploys: tuple = (), **kw: Any) -> ModelResult:
    kw.setdefault("requests", 1)
    kw.setdefault("forced_generated", GEN)
    return check_model(MODELS[name](), source, deploys, **kw)


def _first(r: ModelResult, key: str) -> tuple[int, int, int, str]:
    f = r.cells[key].first
    assert f is not None, (key, r.cells[key])
    return f.position, f.c, f.n, f.got


# ----------------------------------------------------------------------------- the schedules


def test_forced_schedules_make_each_situation_happen() -> None:
    P, T = 20, 44
    by_name = {s.name: s for s in forced_schedules(P, T)}
    assert list(by_name) == ["unchunked", "chunked-at-10", "chunks-of-16", "one-token-tail", "multi-decode",
                             "cross-replay", "repeated-replay"]
    for s in by_name.values():  # every schedule feeds every position 0..T-1, in order after each preemption
        fed = {p for c, n in s.ops if (c, n) != PREEMPT for p in range(c, c + n)}
        assert fed == set(range(T)), s.name
    events = {name: [classify_span(P, c, n) for c, n in s.ops if (c, n) != PREEMPT] for name, s in by_name.items()}
    assert not any(e.nonzero_offset or e.multi_decode or e.cross_boundary for e in events["unchunked"])
    assert any(e.nonzero_offset and not e.one_token_tail for e in events["chunked-at-10"])
    assert by_name["chunks-of-16"].ops[:2] == ((0, 16), (16, 4))
    assert by_name["one-token-tail"].ops[:2] == ((0, 19), (19, 1)) and any(e.one_token_tail for e in
                                                                          events["one-token-tail"])
    assert (24, 3) in by_name["multi-decode"].ops and any(e.multi_decode for e in events["multi-decode"])
    cross = by_name["cross-replay"].ops
    assert cross.count(PREEMPT) == 1 and (18, 9) in cross  # c = P-2 < P < c + n
    assert by_name["repeated-replay"].ops.count(PREEMPT) == 2
    # a prompt length whose chunks of 16 would end in a one-token chunk uses 15
    assert forced_schedules(33, 60)[2].name == "chunks-of-15"


# ----------------------------------------------------------------------------- the oracle on toy models


class _ToyStandIn:
    def __init__(self) -> None:
        self.table = torch.randn(4096, 8, generator=torch.Generator().manual_seed(1))
        self.talker = self

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


def _rows(rid: str, start: int, stop: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(rid))
    return torch.randn(200, 8, generator=g)[start:stop]


class _Addressed:
    """Position-addressed: row p for position p, however scheduled. Conforms."""

    def talker_preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **info: Any):
        c = info["_omni_num_computed_tokens"]
        return input_ids, _rows(info["request_id"], c, c + input_ids.shape[0]), {}


class _ConsistentlyWrong:
    """Gives every position the row of position p + 1: wrong, but the same under every schedule."""

    def talker_preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **info: Any):
        c = info["_omni_num_computed_tokens"]
        return input_ids, _rows(info["request_id"], c + 1, c + 1 + input_ids.shape[0]), {}


class _ShortSpans:
    """Returns one row too few for a span longer than 2: the runner leaves the last position bare."""

    def talker_preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **info: Any):
        c, n = info["_omni_num_computed_tokens"], input_ids.shape[0]
        return input_ids, _rows(info["request_id"], c, c + (n - 1 if n > 2 else n)), {}


class _CountsDecodes:
    """Decode rows from a per-request counter in the buffer (the 0.30.0 pattern): replays shift it."""

    def talker_preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **info: Any):
        c, n, P = info["_omni_num_computed_tokens"], input_ids.shape[0], info["_omni_prompt_len"]
        if info["_omni_is_prefill"]:
            return input_ids, _rows(info["request_id"], c, min(c + n, P)), {"meta": {"k": 0}}
        k = info["meta"]["k"]
        return input_ids, _rows(info["request_id"], P + k, P + k + 1), {"meta": {"k": k + 1}}


class _ToyAdapter(Adapter):
    upstream = False
    hidden = 8

    def __init__(self, impl: type) -> None:
        self.impl, self.name, self.title = impl, impl.__name__, impl.__name__

    def load(self, spec: str, base_dir: Any = None, wheel_dir: Any = None) -> tuple[Any, Any]:
        return self.impl, None

    def stand_in_class(self) -> type:
        return _ToyStandIn

    def requests(self, count: int, generated: int) -> list[ConformRequest]:
        return [ConformRequest(f"r{i}", [7] * (20 + 3 * i), {"meta": {}}, fixed_tokens(f"r{i}", generated + 1, 4096))
                for i in range(count)]


def _toy(impl: type) -> ModelResult:
    return check_model(_ToyAdapter(impl), "", (), requests=2, forced_generated=GEN)


def test_a_position_addressed_model_conforms_and_so_does_a_consistently_wrong_one() -> None:
    for impl in (_Addressed, _ConsistentlyWrong):  # necessary, not sufficient
        r = _toy(impl)
        assert r.status == "conforms", impl.__name__
        assert {k: c.status for k, c in r.cells.items()} == {**dict.fromkeys(SITUATIONS, "conforms"),
                                                              "row_count": "conforms", "restart": "conforms"}


def test_a_short_return_is_a_row_count_cell_and_a_bare_position() -> None:
    r = _toy(_ShortSpans)
    # the reference (whole prompt, P = 20) is short too: position 19 is bare in the reference itself, so the
    # first difference is where another schedule's short span ends elsewhere: chunked-at-10's [0, 10) at 9
    assert r.cells["row_count"].status == "row-count"
    assert "span c=0 n=20 (prefill from position 0) returned 19 rows" in r.cells["row_count"].detail
    assert _first(r, "chunk")[:3] == (9, 0, 10)
    assert r.cells["chunk"].first.got == "the bare embedding of its own id (the runner's starting row)"


def test_a_decode_counter_fails_multi_decode_and_replays_first_where_the_counter_falls_behind() -> None:
    r = _toy(_CountsDecodes)
    P = 20
    assert r.cells["chunk"].status == r.cells["tail"].status == "conforms"
    # span [P+4, P+7) reads one counter row for three positions: the first two are right, P+5 is short
    assert _first(r, "multi_decode")[:3] == (P + 5, P + 4, 3)
    # the replay crossing P returns prompt rows only; then the counter restarts at 0 for position P+m+1
    assert _first(r, "cross_replay")[:3] == (P, P - 2, 6 + 3)
    assert r.cells["cross_replay"].first.got == "the bare embedding of its own id (the runner's starting row)"


class _ReachesVllm:
    """Decode reaches a name only vLLM has (a stub): the check's limit, not the model's failure."""

    def talker_preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **info: Any):
        from harness.talkers.upstream import UpstreamUnavailable

        c, n = info["_omni_num_computed_tokens"], input_ids.shape[0]
        if c >= info["_omni_prompt_len"] and n > 1:
            raise UpstreamUnavailable("the upstream code reached 'current_omni_platform'")
        return input_ids, _rows(info["request_id"], c, c + n), {}


def test_a_stub_reached_is_could_not_check_not_a_failure() -> None:
    r = _toy(_ReachesVllm)
    assert r.status == "error" and "UpstreamUnavailable" in r.error and "c=24 n=3" in r.error
    assert Matrix("vllm-omni:x", (), [r]).exit_code == 2


# ----------------------------------------------------------------------------- calibration: Qwen2.5-Omni


def test_calibration_main_fails_every_situation_and_pr_conforms() -> None:
    main, pr = _check("qwen2.5-omni:main"), _check("qwen2.5-omni:pr")
    assert pr.status == "conforms" and all(c.status == "conforms" for c in pr.cells.values())
    assert main.status == "fails"
    P = 61  # p01-weather's Talker prompt: Pt = 59 Thinker prompt rows + speaker + codec-BOS
    ref0 = "Thinker prompt row 0"  # the Talker prompt's row 0: the Thinker's embedding of prompt token 0
    # n > 1 rebuilds the prompt from row 0 whatever the offset: the second chunk starts over
    assert _first(main, "chunk") == (30, 30, 31, ref0)
    # n == 1 at c = P-1 is routed to decode: codec embedding + the first reply row, not BOS
    assert _first(main, "tail") == (P - 1, P - 1, 1, "its id's embedding + Thinker output row 1")
    assert main.cells["tail"].first.want == "Thinker output row 0 + codec-BOS (P-1)"
    # a three-position decode span is taken for a prefill: prompt row 0 at position P+4
    assert _first(main, "multi_decode") == (P + 4, P + 4, 3, ref0)
    assert main.cells["multi_decode"].first.want == "its id's embedding + Thinker output row 5"
    # the replay's second span [P-2, P+7) starts over from prompt row 0 again
    assert _first(main, "cross_replay") == (P - 2, P - 2, 9, ref0)
    assert main.cells["cross_replay"].first.want == "the speaker + codec-PAD row (P-2)"
    # a replay from 0 gets the P prompt rows only: position P is left as its bare codec embedding
    assert _first(main, "repeated_replay") == (P, 0, P + 7, "the bare embedding of its own id (the runner's starting row)")
    rc = main.cells["row_count"]
    assert rc.status == "row-count" and "span c=0 n=30 (prefill from position 0) returned 61 rows" in rc.detail


def test_upstream_qwen25_omni_0_30_0_fails_exactly_like_main() -> None:
    main = _check("qwen2.5-omni:main")
    for source in ("0.30.0", str(FIXTURE_QWEN25)):
        up = _check("qwen2.5-omni", source)
        assert up.provenance is not None and "de8b86f60d04" in up.provenance.what
        assert {k: c.detail for k, c in up.cells.items()} == {k: c.detail for k, c in main.cells.items()}


# ----------------------------------------------------------------------------- real upstream: Qwen3-Omni, Qwen3-TTS


def test_qwen3_omni_0_30_0_slices_prefill_by_offset_but_not_decode_spans_or_replays() -> None:
    r = _check("qwen3-omni")
    files = r.provenance.files
    assert [f["sha256"] for f in files] == [VENDORED["vllm_omni/model_executor/models/qwen3_omni/qwen3_omni.py"],
                                            VENDORED["vllm_omni/model_executor/stage_input_processors/qwen3_omni.py"]]
    assert files[0]["methods"][:4] == ["_get_text_spk_token_id", "talker_preprocess", "_get_tts_embed",
                                       "talker_preprocess_prefill"]
    assert files[1]["methods"] == ["thinker2talker_full_payload", "_compute_talker_prompt_ids_length"]
    P = 28  # _compute_talker_prompt_ids_length: user turn (19 ids) + 9 assistant rows
    bare = "the bare embedding of its own id (the runner's starting row)"
    assert r.cells["chunk"].status == "conforms" and r.cells["tail"].status == "conforms"
    # a decode span of n > 1 gets no text_step (the runner's MTP path is for n == 1 only); decode row k carries
    # trailing_text[k] = the assistant turn's token 4 + k (the turn starts at Thinker token 30)
    assert _first(r, "multi_decode") == (P + 4, P + 4, 3, bare)
    assert r.cells["multi_decode"].first.want == "its id's embedding + the projected Thinker embedding of token 38"
    # the crossing replay is a prefill slice [c, c+n) of the P prompt rows: 2 rows, generated positions bare
    assert _first(r, "cross_replay") == (P, P - 2, 9, bare)
    assert _first(r, "repeated_replay") == (P, 0, P + 7, bare)
    assert "span c=26 n=9 (span crossing the prompt boundary, replay 1) returned 2 rows" in r.cells["row_count"].detail


def test_qwen3_tts_0_30_0_replays_from_a_running_offset_and_pads() -> None:
    r = _check("qwen3-tts")
    assert r.provenance.files[0]["methods"][:2] == ["preprocess", "preprocess_decode_batch"]
    assert r.provenance.files[0]["from_stand_in"] == ["embed_input_ids"]
    P = 9  # the release's CustomVoice prompt
    assert r.cells["chunk"].status == "conforms" and r.cells["tail"].status == "conforms"
    # the hook fills the span with codec rows (no text step): V1 hands Qwen3-TTS stale rows, not embeddings
    assert _first(r, "multi_decode") == (P + 4, P + 4, 3, "the bare embedding of its own id")
    # after a preemption the stored prompt is sliced from talker_prefill_offset (P + ...), not from c = 0:
    # past the end, so every replayed prompt position is padded with tts_pad
    assert _first(r, "cross_replay") == (0, 0, P - 2, "the tts_pad row")
    assert r.cells["cross_replay"].first.want == "prompt row 0"
    assert r.cells["multi_decode"].first.want == "its id's embedding + trailing_text row 4"
    assert _first(r, "repeated_replay") == (0, 0, P + 7, "the tts_pad row")
    assert r.cells["row_count"].status == "conforms"  # it pads to n rather than return fewer


def test_minicpmo_0_30_0_raises_on_a_crossing_replay_and_embeds_only_the_last_decode_id() -> None:
    r = _check("minicpmo-4.5")
    assert [f["methods"] for f in r.provenance.files] == [
        ["_boundary_embeddings", "_build_condition_embeddings", "_build_streaming_recompute_embeddings", "preprocess"],
        ["llm2tts (l.1044-1049)"], ["get_tts_handoff", "set_tts_handoff"]]
    # llm2tts's branch for a handoff with ids and hidden states: max(len(ids), len(hidden)) + 2 dummy ids
    # (the reply's 59 words + 2), the same length as the condition the hook builds
    P = 61
    assert r.cells["chunk"].status == "conforms" and r.cells["tail"].status == "conforms"
    # decode embeds only the span's last id: one row for three positions, and it is position P+6's
    assert _first(r, "multi_decode") == (P + 4, P + 4, 3, f"the reference row of position {P + 6}")
    assert "span c=65 n=3 (multi-position decode span) returned 1 rows" in r.cells["row_count"].detail
    # a prefill slice past the condition raises (the runner does not catch it: the engine step fails)
    assert r.cells["cross_replay"].status == "raised"
    assert r.cells["cross_replay"].detail.endswith(
        "span c=59 n=9 (span crossing the prompt boundary, replay 1): ValueError: MiniCPM-o Talker prefill span exceeds "
        "condition: request_id=p01-weather offset=59 span=9 condition=61 tts_ids=59 tts_hidden=59 prompt_len=61")
    assert r.cells["repeated_replay"].status == "raised"


# ----------------------------------------------------------------------------- vLLM's scheduler


def test_vllm_stress_preempts_and_separates_main_from_pr() -> None:
    stress = load_deploy("stress")
    tight = dataclasses.replace(stress, talker=dataclasses.replace(stress.talker, num_gpu_blocks_override=20))
    kw = {"requests": 2, "deploy_generated": 100}
    pr = _check("qwen2.5-omni:pr", deploys=(tight,), **kw)
    main = _check("qwen2.5-omni:main", deploys=(tight,), **kw)
    stats = pr.stats["vllm:stress"]
    assert stats["preemptions"] >= 1 and stats["nonzero_offset_chunks"] >= 1 and stats["cross_boundary_replays"] >= 1
    assert pr.cells["vllm:stress"].status == "conforms"
    f = main.cells["vllm:stress"].first
    assert (f.position, f.c, f.span) == (32, 32, "non-zero-offset prefill chunk")  # the 32-token budget's 2nd chunk
    assert (f.got, f.want) == ("Thinker prompt row 0", "Thinker prompt row 32")


def test_vllm_specdec_verify_spans_are_multi_position_decodes() -> None:
    kw = {"requests": 1, "deploy_generated": 30}
    spec = (load_deploy("specdec"),)
    pr, q3 = _check("qwen2.5-omni:pr", deploys=spec, **kw), _check("qwen3-omni", deploys=spec, **kw)
    assert pr.cells["vllm:specdec"].status == "conforms"
    assert pr.stats["vllm:specdec"]["multi_position_decode_spans"] >= 9  # k = 2: every decode step verifies 3
    f = q3.cells["vllm:specdec"].first
    assert (f.position, f.c, f.n, f.span) == (28, 28, 3, "multi-position decode span")  # the first verify span


# ----------------------------------------------------------------------------- sources and the vendored copy


def test_vendored_files_are_the_pinned_0_30_0_files() -> None:
    for member, sha in VENDORED.items():
        data = (VENDOR_DIR / member).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha, member
        if member not in ("vllm_omni/_version.py",  # upstream ships these two without the SPDX header
                          "vllm_omni/model_executor/models/fish_speech/fish_speech_slow_ar.py"):
            assert data.startswith(b"# SPDX-License-Identifier: Apache-2.0\n")
    assert (VENDOR_DIR / "LICENSE").read_text().startswith("\n") or "Apache License" in (VENDOR_DIR / "LICENSE").read_text()


def test_a_version_not_installed_or_cached_reads_the_vendored_copy(tmp_path: Path) -> None:
    member = "vllm_omni/model_executor/models/qwen3_omni/qwen3_omni.py"
    src = read_model_source("0.30.0", member, wheel_dir=tmp_path)
    assert src.sha256 == VENDORED[member] and src.version == "0.30.0"
    with pytest.raises(Exception, match="pip download vllm-omni==0.29.0"):
        read_model_source("0.29.0", member, wheel_dir=tmp_path)


def test_a_wheel_and_a_checkout_are_sources_too(tmp_path: Path) -> None:
    import zipfile

    wheel = tmp_path / "vllm_omni-0.30.0-py3-none-any.whl"  # what `pip download vllm-omni==0.30.0 --no-deps` leaves
    with zipfile.ZipFile(wheel, "w") as zf:
        for member in VENDORED:
            zf.writestr(member, (VENDOR_DIR / member).read_bytes())
        zf.writestr("vllm_omni-0.30.0.dist-info/METADATA", "Metadata-Version: 2.4\nName: vllm-omni\nVersion: 0.30.0\n")
    from_wheel = _check("qwen3-tts", str(wheel))
    assert from_wheel.provenance.files[0]["location"].endswith(
        ".whl!vllm_omni/model_executor/models/qwen3_tts/qwen3_tts_talker.py")
    from_checkout = _check("qwen3-tts", str(VENDOR_DIR))
    assert from_checkout.provenance.files[0]["version"] == "0.30.0"
    assert {k: c.detail for k, c in from_wheel.cells.items()} == {k: c.detail for k, c in from_checkout.cells.items()}


# ----------------------------------------------------------------------------- the command


def _cli(*args: str) -> Any:
    from harness.cli import main as cli_main

    if "--source" not in args:  # these tests check one release: 0.30.0 (the default checks 0.32.0rc1 too)
        args = (*args, "--source", "vllm-omni:0.30.0")
    return CliRunner().invoke(cli_main, ["conform", *args], catch_exceptions=False)


def test_cli_exit_codes_and_outputs(tmp_path: Path) -> None:
    small = ["--deploy", "none", "--requests", "1", "--generated", "24"]
    ok = _cli("--model", "qwen2.5-omni:pr", *small)
    assert ok.exit_code == 0, ok.output
    assert "calibration: qwen2.5-omni:main fails (expected fails); qwen2.5-omni:pr conforms (expected conforms): ok" \
        in ok.output
    js, page = tmp_path / "m.json", tmp_path / "m.html"
    bad = _cli("--model", "qwen3-omni", *small, "--fail-on", "any", "--json", str(js), "--html", str(page))
    assert bad.exit_code == 1, bad.output
    data = json.loads(js.read_text())
    # the async_chunk: false row, and the async_chunk: true row its shipped deploys run
    assert data["exit_code"] == 1 and [m["model"] for m in data["models"]] == ["qwen3-omni", "qwen3-omni@async"]
    cell = data["models"][0]["cells"]["multi_decode"]
    assert cell["status"] == "differs" and cell["first"]["position"] == 32
    assert "<table>" in page.read_text() and "differs @32" in page.read_text()
    # a source that holds no Qwen3-Omni class: could not check
    wrong = _cli("--model", "qwen3-omni", *small, "--source", f"vllm-omni:{FIXTURE_QWEN25}")
    assert wrong.exit_code == 2 and "no top-level class Qwen3OmniMoeForConditionalGeneration" in wrong.output
    assert _cli("--model", "nope", *small).exit_code == 2
    assert _cli("--source", "0.30.0", *small).exit_code == 2


def test_a_broken_calibration_means_could_not_check() -> None:
    pr = ModelResult("qwen2.5-omni:pr", "pr", None, {"chunk": Cell("differs", "differs @3")})
    up = ModelResult("qwen3-omni", "q", None, {"chunk": Cell("conforms", "conforms")})
    m = Matrix("vllm-omni:x", (), [up], [pr])
    assert m.exit_code == 2 and "calibration" in m.verdict()
    assert "BROKEN" in format_text(m) and json.loads(format_json(m))["exit_code"] == 2 and "<html>" in format_html(m)
    assert Matrix("vllm-omni:x", (), [up], []).exit_code == 0


def test_only_the_checked_models_calibration_runs(tmp_path: Path) -> None:
    """Issue 45, item 5: the Qwen2.5-Omni calibration arms check the oracle on Qwen2.5-Omni's stand-in; a run
    that checks Qwen3-TTS alone does not run them (nor report a calibration)."""
    js = tmp_path / "m.json"
    out = _cli("--model", "qwen3-tts", "--deploy", "none", "--requests", "1", "--generated", "24", "--json", str(js))
    assert "[conform] qwen2.5-omni" not in out.output and "calibration:" not in out.output
    data = json.loads(js.read_text())
    assert [m["model"] for m in data["models"]] == ["qwen3-tts", "qwen3-tts@mrv2"]  # one release: its matrix
    assert data["calibration"] == {}


def test_qwen3_tts_is_checked_in_the_releases_layout_under_its_own_deploys(tmp_path: Path) -> None:
    """Issue 45, item 5: the stand-in's prompt is the release's CustomVoice prompt (9 rows, the text's other
    tokens plus tts_eos queued), and the reference / stress columns run the Qwen3-TTS deploys (their MRV2
    twins for the MRV2 row), where the release's replay bugs show at the positions the sim finds."""
    js = tmp_path / "m.json"
    out = _cli("--model", "qwen3-tts", "--json", str(js))  # 4 requests x 480 generated positions: 42 KV blocks preempt
    assert out.exit_code == 1, out.output
    assert out.output.count("reference rows for 4 requests (P 9-9, 480 generated positions)") == 2
    v1, mrv2 = [ln.strip() for ln in out.output.splitlines() if "qwen3-tts: vLLM stress deploy:" in ln]
    assert v1 == "[conform]   qwen3-tts: vLLM stress deploy: differs @0"  # V1: the replayed prompt gets tts_pad
    assert mrv2 == "[conform]   qwen3-tts: vLLM stress deploy: differs @9"  # MRV2: the replayed generated rows
    ran = {m["model"]: {k: m["cells"][k]["detail"].split("[ran ")[1].split(":")[0]
                        for k in ("vllm:reference", "vllm:stress")} for m in json.loads(js.read_text())["models"]}
    assert ran == {"qwen3-tts": {"vllm:reference": "qwen3-tts-reference", "vllm:stress": "qwen3-tts-stress"},
                   "qwen3-tts@mrv2": {"vllm:reference": "qwen3-tts-mrv2-reference",
                                      "vllm:stress": "qwen3-tts-mrv2-stress"}}
