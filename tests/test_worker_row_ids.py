"""Issue 32, item 2: the worker's contract check compares row identities on the speaking checkpoint.

Compared by value alone, a row from the wrong offset that holds the same values counts as aligned (the
speaking checkpoint's Thinker rows depend only on their byte). With identity codes in the Thinker rows
the arm is handed (``tag_payload``), the delivered row says where it came from; the codes are zeroed
before the runner copies the rows (``strip_ids``). Run on the sim's model host, with a payload whose
Thinker prompt rows are all equal by value (the extreme of 'same byte')."""

from __future__ import annotations

import torch

from harness.config import load_prompts
from harness.serve.worker_contract import (KIND_OUTPUT, KIND_PROMPT, ROW_ID_DIMS, count_misaligned, request_code,
                                           strip_ids, tag_payload)
from harness.families.qwen2_5_omni.model import bind_arm
from harness.sim.rows import RowSpace
from harness.families.qwen2_5_omni.thinker import run_thinker, token_id_table
from harness.families.qwen2_5_omni.main import MainTalker
from harness.families.qwen2_5_omni.pr import FixedTalker

DIMS = list(ROW_ID_DIMS)


def _payload(same_values: bool) -> tuple[dict, object, RowSpace]:
    space = RowSpace(0)
    out = run_thinker(load_prompts("default"), space, 1.0)[0]
    info = {**out.payload(token_id_table([out])), "_omni_prompt_len": out.P, "request_id": out.request_id}
    prefill = info["embed"]["prefill"].clone()
    output = info["hidden_states"]["output"].clone()
    prefill[:, DIMS] = 0  # the speaking checkpoint's rows are zero there
    output[:, DIMS] = 0
    if same_values:
        prefill[:] = prefill[0]  # every Thinker prompt row equal by value
    info["embed"] = {**info["embed"], "prefill": prefill}
    info["hidden_states"] = {**info["hidden_states"], "output": output}
    return info, out, space


def _check(impl: type, c: int, n: int, tagged: bool, same_values: bool = True) -> dict:
    info, out, space = _payload(same_values)
    model = bind_arm(impl, space)
    model.profile_run(64)
    ids = torch.tensor(list(out.talker_prompt_ids)[c:c + n], dtype=torch.int64)
    embeds = model.talker.embed_input_ids(ids)
    call = {**info, "_omni_num_computed_tokens": c, "_omni_is_prefill": c < out.P}
    seen = tag_payload(call) if tagged else call
    assert seen is not None
    result = model.talker_preprocess(input_ids=ids, input_embeds=embeds, **seen)
    return count_misaligned(model, seen, ids.clone(), result, embeds, row_ids=tagged)


def test_the_codes_name_kind_request_and_index() -> None:
    info, out, _ = _payload(False)
    tagged = tag_payload(info)
    code = request_code(out.request_id)
    assert 1 <= code <= 255 and request_code(out.request_id) == code
    prompt, output = tagged["embed"]["prefill"], tagged["hidden_states"]["output"]
    assert prompt[3, DIMS].tolist() == [KIND_PROMPT, code, 0, 3]
    assert output[1, DIMS].tolist() == [KIND_OUTPUT, code, 0, 1]
    assert info["embed"]["prefill"][:, DIMS].abs().sum().item() == 0  # the runner's payload untouched
    keep = [d for d in range(prompt.shape[1]) if d not in ROW_ID_DIMS]
    assert torch.equal(prompt[:, keep], info["embed"]["prefill"][:, keep])


def test_rows_not_zero_in_the_code_dims_are_left_untagged() -> None:
    info, _, _ = _payload(False)
    assert tag_payload(info) is not None
    info["hidden_states"]["output"][2, ROW_ID_DIMS[1]] = 0.25  # a checkpoint whose rows use those dims
    assert tag_payload(info) is None
    assert tag_payload({"request_id": "x"}) is None


def test_main_copying_equal_valued_rows_from_the_wrong_offset_is_misaligned_by_identity() -> None:
    # main's chunk at c = 16 copies prompt rows 0..31 into positions 16..47: equal by value here
    assert _check(MainTalker, 16, 32, tagged=False) == {"misaligned_text": 0, "misaligned_end": 0, "text_len": 58}
    assert _check(MainTalker, 16, 32, tagged=True) == {"misaligned_text": 32, "misaligned_end": 0,
                                                       "first_misaligned": 16, "text_len": 58}
    # with distinct rows, value and identity agree
    assert _check(MainTalker, 16, 32, tagged=False, same_values=False)["misaligned_text"] == 32


def test_pr_is_aligned_by_identity_and_the_runner_gets_untagged_rows() -> None:
    for c, n in ((0, 32), (32, 29), (50, 11)):
        assert _check(FixedTalker, c, n, tagged=True) == {"misaligned_text": 0, "misaligned_end": 0,
                                                          "text_len": 58}, (c, n)
    info, out, space = _payload(False)
    model = bind_arm(FixedTalker, space)
    ids = torch.tensor(list(out.talker_prompt_ids)[:16], dtype=torch.int64)
    call = {**info, "_omni_num_computed_tokens": 0, "_omni_is_prefill": True}
    plain = model.talker_preprocess(input_ids=ids, input_embeds=model.talker.embed_input_ids(ids), **call)
    embeds = model.talker.embed_input_ids(ids)
    tagged = model.talker_preprocess(input_ids=ids, input_embeds=embeds, **tag_payload(call))
    assert tagged[1][:, DIMS].abs().sum().item() > 0
    stripped = strip_ids(tagged, embeds)
    keep = [d for d in range(plain[1].shape[1]) if d not in ROW_ID_DIMS]
    assert torch.equal(stripped[1][:, keep], plain[1][:, keep]) and stripped[1][:, DIMS].abs().sum().item() == 0
    assert tagged[1][:, DIMS].abs().sum().item() > 0  # the arm's own tensor is not modified
    assert embeds[:, DIMS].abs().sum().item() == 0  # the runner's slice: zeroed in place


def test_fidelity_names_requests_with_identical_spans_whose_counts_differ() -> None:
    from harness.report.fidelity import METRICS, MISALIGNED_KEYS, RequestComparison, Value, _same_schedule_notes

    assert set(MISALIGNED_KEYS) <= {m.key for m in METRICS}

    def req(prompt: str, same_schedule: bool, text: tuple[int, int],
            overlap: tuple[int | None, int | None] = (None, None)) -> RequestComparison:
        values = {"misaligned_text": Value(*text), "misaligned_end": Value(0, 0)}
        return RequestComparison(("main", "cpu-stress", 1, prompt), values, True, same_schedule, overlap=Value(*overlap))

    assert _same_schedule_notes([req("a", False, (3, 2))]) == []
    assert _same_schedule_notes([req("a", True, (3, 3)), req("b", False, (3, 2))]) == [
        "1 matched request(s) ran identical spans on both sides; their misaligned counts are equal"]
    assert _same_schedule_notes([req("a", True, (864, 819)), req("b", True, (4, 4))]) == [
        "2 matched request(s) ran identical spans on both sides; their misaligned counts differ on 1: "
        "main/cpu-stress/1/a (rows compared by value on the real side: a checkpoint without identity codes, "
        "docs/fidelity.md)"]
    # issue 45, item 6: the cause found, where it is found: the same spans, shared with other requests differently
    assert _same_schedule_notes([req("a", True, (864, 819), (2, 30)), req("b", True, (5, 4), (3, 3)),
                                 req("c", True, (1, 1), (0, 9))]) == [
        "3 matched request(s) ran identical spans on both sides; their misaligned counts differ "
        "on 1: main/cpu-stress/1/a, which shared their steps with other requests differently (Talker overlap "
        "sim 2 / real 30): state an arm keeps across requests sees other rows on each side; "
        "on 1: main/cpu-stress/1/b with the same Talker overlap (rows compared by value on the real side: a "
        "checkpoint without identity codes, docs/fidelity.md)"]


def test_talker_overlap_counts_the_steps_a_request_shares() -> None:
    from harness.report.fidelity import talker_overlap

    def span(request: str, step: int, deploy: str = "d") -> dict:
        return {"arm": "pr", "deploy": deploy, "repeat": 1, "request": request, "step": step}

    spans = [span("p1", 0), span("p2", 0), span("p1", 1), span("p1", 2), span("p2", 2), span("p3", 2),
             span("p3", 3), span("p3", 3), span("p4", 2, "other")]  # another cell's step 2 is not shared
    assert talker_overlap(spans) == {("pr", "d", 1, "p1"): 2, ("pr", "d", 1, "p2"): 2, ("pr", "d", 1, "p3"): 1,
                                     ("pr", "other", 1, "p4"): 0}


def test_fidelity_reads_each_requests_schedule_from_its_spans() -> None:
    """The sim records ``schedule`` only when it records latency; both runs have spans, in order."""
    from harness.records import SpanRecord, schedule_digest
    from harness.report.fidelity import span_schedules

    spans = [SpanRecord("pr", "d", 1, "p1", 0, 40, 0, 32, 40), SpanRecord("pr", "d", 1, "p2", 0, 40, 0, 32, 40),
             SpanRecord("pr", "d", 1, "p1", 1, 40, 32, 8, 8), SpanRecord("pr", "d", 1, "p1", 2, 40, 40, 1, 1)]
    raw = [{"arm": s.arm, "deploy": s.deploy, "repeat": s.repeat, "request": s.request, "P": s.P, "c": s.c, "n": s.n}
           for s in spans]
    got = span_schedules(raw)
    assert got == {("pr", "d", 1, "p1"): schedule_digest([spans[0], spans[2], spans[3]]),
                   ("pr", "d", 1, "p2"): schedule_digest([spans[1]])}


def test_the_launcher_asks_for_row_identities_only_on_the_speaking_checkpoint(tmp_path) -> None:
    import json

    from harness.config import ArmSpec
    from harness.serve.backend import SPEAKING_MARKER, ServeOptions, server_env_overrides

    arm = ArmSpec(name="pr", talker="harness.families.qwen2_5_omni.pr:FixedTalker")
    speaking_dir, random_dir = tmp_path / "speaking", tmp_path / "random"
    for d, flag in ((speaking_dir, True), (random_dir, False)):
        d.mkdir()
        (d / SPEAKING_MARKER).write_text(json.dumps({"speaking": flag}))
    env = server_env_overrides(arm, tmp_path, ServeOptions(model=str(speaking_dir), platform="cpu"))
    assert env["OMNI_STRESS_ROW_IDS"] == "1"
    assert "OMNI_STRESS_ROW_IDS" not in server_env_overrides(arm, tmp_path, ServeOptions(model=str(random_dir),
                                                                                          platform="cpu"))


def test_a_requests_tagged_rows_are_reused_until_someone_writes_into_them() -> None:
    from harness.serve.worker_contract import _TAGS, tag_payload_on_device

    info, _, _ = _payload(False)
    first, coded = tag_payload_on_device(info)
    again, coded_again = tag_payload_on_device({**info, "_omni_num_computed_tokens": 5})
    assert again["embed"]["prefill"] is first["embed"]["prefill"] and coded_again is coded
    assert again["hidden_states"]["output"] is first["hidden_states"]["output"]
    assert bool(coded) and first["hidden_states"]["output"][1, DIMS].tolist() == [KIND_OUTPUT, request_code(
        info["request_id"]), 0, 1]
    first["hidden_states"]["output"][1, DIMS[3]] = 9  # an arm writing into the copy it was handed
    fresh, _ = tag_payload_on_device(info)
    assert fresh["hidden_states"]["output"] is not first["hidden_states"]["output"]
    assert fresh["hidden_states"]["output"][1, DIMS].tolist()[3] == 1
    info["embed"]["prefill"][0, 0] += 1  # the runner's own rows changed in place: tagged again from them
    changed, _ = tag_payload_on_device(info)
    assert changed["embed"]["prefill"] is not fresh["embed"]["prefill"]
    assert torch.equal(changed["embed"]["prefill"][0, :DIMS[0]], info["embed"]["prefill"][0, :DIMS[0]])
    other = {**info, "embed": {**info["embed"], "prefill": info["embed"]["prefill"].clone()}}
    assert tag_payload_on_device(other)[0]["embed"]["prefill"] is not changed["embed"]["prefill"]  # other tensor
    from harness.serve.worker_contract import TAG_CACHE_SIZE

    for i in range(TAG_CACHE_SIZE + 3):
        tag_payload_on_device({**info, "request_id": f"r{i}"})
    assert len(_TAGS) == TAG_CACHE_SIZE


def test_reply_rows_are_the_whole_replys_rows_by_index() -> None:
    from types import SimpleNamespace

    from harness.serve.worker_contract import reply_rows

    thinker = torch.arange(5 * 3, dtype=torch.bfloat16).reshape(5, 3)  # 4 reply rows from the Thinker
    model = SimpleNamespace(embed_text_eos_token=torch.full((1, 3), -1.0), embed_text_pad_token=torch.full((1, 3), -2.0))
    reply = torch.cat([thinker[1:].float(), model.embed_text_eos_token, model.embed_text_pad_token])
    for first_k, m in ((0, 1), (2, 1), (3, 1), (4, 1), (5, 1), (9, 1), (0, 4), (2, 3), (3, 4), (1, 8), (4, 2), (6, 3)):
        ks = torch.arange(first_k, first_k + m).clamp(max=reply.shape[0] - 1)
        got = reply_rows(model, thinker, first_k, m, torch.device("cpu"), torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, reply[ks]), (first_k, m)


def test_inference_tensors_are_tagged_and_reused_by_storage() -> None:
    from harness.serve.worker_contract import tag_payload_on_device

    info, _, _ = _payload(False)
    with torch.inference_mode():
        info["embed"]["prefill"] = info["embed"]["prefill"].clone()  # as the real worker's payload
        info["hidden_states"]["output"] = info["hidden_states"]["output"].clone()
        first, coded = tag_payload_on_device({**info, "request_id": "inference"})
        again, _ = tag_payload_on_device({**info, "request_id": "inference"})
    assert info["embed"]["prefill"].is_inference() and bool(coded)
    assert again["embed"]["prefill"] is first["embed"]["prefill"]
    assert first["embed"]["prefill"][3, DIMS].tolist() == [KIND_PROMPT, request_code("inference"), 0, 3]
