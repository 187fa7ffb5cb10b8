"""Each arm against hand-built spans, with exact row identities (through the sim's runner)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from simkit import FakeRequest

from harness.config import load_prompts
from harness.contract import ContractError
from harness.sim.codec import CODEC_BOS, CODEC_EOS, CODEC_PAD
from harness.families.qwen2_5_omni.model import bind_arm
from harness.sim.rows import NONE, RowSpace
from harness.families.qwen2_5_omni.sim import SimContract
from harness.sim.runner import SimRunner
from harness.families.qwen2_5_omni.thinker import run_thinker, token_id_table
from harness.families.qwen2_5_omni.main import MainTalker
from harness.families.qwen2_5_omni.pr import FixedTalker

PROMPTS = Path(__file__).parent / "data" / "prompts_e2e.yaml"


class Harness:
    def __init__(self, impl, profile_tokens: int = 0) -> None:
        self.space = RowSpace(0)
        self.model = bind_arm(impl, self.space)
        if profile_tokens:
            self.model.profile_run(profile_tokens)
        outputs = run_thinker(load_prompts(str(PROMPTS)), self.space, 1.0)
        self.out = outputs[0]
        self.runner = SimRunner(self.model, self.space, ("arm", "deploy", 1), SimContract(self.model, self.space))
        self.runner.add_request(self.out, self.out.payload(token_id_table(outputs)), 4000)
        # generated codec tokens 200, 201, ... follow the Talker prompt
        self.req = FakeRequest(self.out.request_id, self.out.talker_prompt_ids,
                               self.out.talker_prompt_ids + list(range(200, 300)))
        self.P = self.out.P
        self.K = self.out.output_rows.shape[0]
        self.spk = self.runner.kv[self.out.request_id].spk_id

    def call(self, c: int, n: int):
        return self.runner.call(self.req, c, n, step=0)

    @property
    def kv(self):
        return self.runner.kv[self.out.request_id]

    def prompt(self, i: int) -> int:
        return self.out.prompt_first_id + i

    def output(self, j: int) -> int:
        return self.out.output_first_id + j


def text(h: Harness, lo: int, hi: int) -> list[int]:
    return h.kv.text[lo:hi].tolist()


# ----------------------------------------------------------------------------- main (0.30.0)


def test_main_full_prefill_is_right():
    h = Harness(MainTalker)
    r = h.call(0, h.P)
    assert r.span.rows == h.P and r.span.misaligned == 0
    assert text(h, 0, h.P - 2) == [h.prompt(i) for i in range(h.P - 2)]
    assert h.kv.text[h.P - 2] == h.spk and h.kv.codec[h.P - 2] == CODEC_PAD
    assert h.kv.text[h.P - 1] == h.output(0) and h.kv.codec[h.P - 1] == CODEC_BOS


def test_main_chunk_at_offset_receives_prompt_rows_from_zero():
    h = Harness(MainTalker)
    h.call(0, 32)
    r = h.call(32, 16)
    assert r.span.rows == h.P and r.span.row_mismatch and r.span.nonzero_offset
    assert text(h, 32, 48) == [h.prompt(i) for i in range(16)]  # rows 0..15, not 32..47
    assert r.span.misaligned == 16


def test_main_chunked_prefill_never_delivers_speaker_and_bos_rows():
    h = Harness(MainTalker)
    c = 0
    while c < h.P:
        n = min(32, h.P - c)
        h.call(c, n)
        c += n
    last_chunk_start = (h.P - 1) // 32 * 32
    # positions P-2, P-1 got prompt rows (P-2-last), (P-1-last) of the rebuilt prompt
    assert h.kv.text[h.P - 2] == h.prompt(h.P - 2 - last_chunk_start)
    assert h.kv.text[h.P - 1] == h.prompt(h.P - 1 - last_chunk_start)
    assert h.kv.codec[h.P - 2] == NONE and h.kv.codec[h.P - 1] == NONE
    assert not h.kv.started()


def test_main_decode_consumes_queue_and_replay_resets_it():
    h = Harness(MainTalker)
    h.call(0, h.P)
    h.call(h.P, 1)
    h.call(h.P + 1, 1)
    assert text(h, h.P, h.P + 2) == [h.output(1), h.output(2)]
    assert h.runner.buffer[h.out.request_id]["embed"]["thinker_reply"].shape[0] == h.K - 3
    # preemption replay of prompt + 2 generated positions: prefill branch, P rows, queue reset
    r = h.call(0, h.P + 2)
    assert r.span.cross_boundary and r.span.rows == h.P
    assert h.runner.buffer[h.out.request_id]["embed"]["thinker_reply"].shape[0] == h.K - 1
    # the generated positions of the replay keep only their codec embedding (no text row)
    assert text(h, h.P, h.P + 2) == [NONE, NONE]
    # the next decode restarts the queue: position P+2 receives thinker_result[1] instead of [3]
    h.call(h.P + 2, 1)
    assert h.kv.text[h.P + 2] == h.output(1)


def test_main_one_token_prefill_tail_is_treated_as_decode():
    h = Harness(MainTalker)
    h.call(0, h.P - 1)  # prefill branch: queue reset to thinker_result[1:]
    r = h.call(h.P - 1, 1)
    assert r.span.one_token_tail and r.span.rows == 1 and r.span.misaligned == 1
    # decode branch: P-1 gets the first queue row + the codec embedding of its id (TALKER_CODEC_END),
    # instead of thinker_result[0] + codec-BOS
    assert h.kv.text[h.P - 1] == h.output(1) and h.kv.codec[h.P - 1] == CODEC_EOS
    assert h.runner.buffer[h.out.request_id]["embed"]["thinker_reply"].shape[0] == h.K - 2


def test_main_empty_queue_falls_back_to_shared_pool():
    h = Harness(MainTalker, profile_tokens=32)
    h.call(0, h.P)
    h.runner.buffer[h.out.request_id]["embed"]["thinker_reply"] = torch.zeros(0, 64)
    h.call(h.P, 1)
    # the profile run left a pool of zero rows shared by all requests: one is consumed,
    # and the position keeps only its codec embedding
    assert h.model.thinker_reply_part.shape[0] == 31
    assert h.kv.text[h.P] == NONE and h.kv.codec[h.P] == h.req.all_token_ids[h.P]


def test_main_runs_out_of_text_after_the_reply():
    h = Harness(MainTalker)
    h.call(0, h.P)
    for k in range(h.K + 1):
        h.call(h.P + k, 1)
    assert text(h, h.P, h.P + h.K - 1) == [h.output(j) for j in range(1, h.K)]
    # 0.30.0 appends no text-EOS/PAD: once the queue is empty a position gets no text component
    assert text(h, h.P + h.K - 1, h.P + h.K + 1) == [NONE, NONE]


def test_main_empty_thinker_output_raises_index_error():
    h = Harness(MainTalker)
    h.runner.buffer[h.out.request_id]["ids"]["output"] = []
    r = h.call(0, h.P)
    assert r.error is not None and r.error.startswith("IndexError")


# ----------------------------------------------------------------------------- pr (the fix)


@pytest.mark.parametrize("spans", [
    [(0, "P")],  # whole prompt
    [(0, 32), (32, 16), (48, "rest")],  # chunked prefill with non-zero offsets
    [(0, "P-1"), ("P-1", 1)],  # one-token prefill tail
])
def test_pr_prefill_spans_get_their_own_rows(spans):
    h = Harness(FixedTalker)
    for c, n in spans:
        c = h.P - 1 if c == "P-1" else c
        n = {"P": h.P, "P-1": h.P - 1, "rest": h.P - c}.get(n, n)
        r = h.call(c, n)
        assert r.error is None and r.span.rows == n and r.span.misaligned == 0
    assert text(h, 0, h.P - 2) == [h.prompt(i) for i in range(h.P - 2)]
    assert h.kv.started()


def test_pr_decode_verify_and_replay_agree():
    h = Harness(FixedTalker)
    h.call(0, h.P)
    for k in range(5):
        h.call(h.P + k, 1)
    decoded = text(h, h.P, h.P + 5)
    assert decoded == [h.output(j) for j in range(1, 6)]
    h.call(h.P + 2, 3)  # a verify span over positions already decoded
    assert text(h, h.P, h.P + 5) == decoded
    r = h.call(0, h.P + 5)  # replay crossing P
    assert r.span.cross_boundary and r.span.rows == h.P + 5 and r.span.misaligned == 0
    assert text(h, h.P, h.P + 5) == decoded
    codecs = h.kv.codec[h.P:h.P + 5].tolist()
    assert codecs == h.req.all_token_ids[h.P:h.P + 5]


def test_pr_past_reply_end_gets_eos_then_persistent_pad():
    h = Harness(FixedTalker)
    h.call(0, h.P)
    r = h.call(h.P + h.K - 3, 6)  # crosses the end of the reply
    assert r.span.misaligned == 0
    eos = h.runner.contract.eos_id
    pad = h.runner.contract.pad_id
    assert text(h, h.P + h.K - 3, h.P + h.K + 3) == [h.output(h.K - 2), h.output(h.K - 1), eos, pad, pad, pad]


def test_pr_is_stateless():
    h = Harness(FixedTalker)
    h.call(0, h.P)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
              for k, v in h.runner.buffer[h.out.request_id]["hidden_states"].items()}
    a = h.call(h.P, 4).span.misaligned
    b = h.call(h.P, 4).span.misaligned
    assert a == b == 0
    assert "thinker_reply" not in h.runner.buffer[h.out.request_id].get("embed", {})
    assert torch.equal(before["output"], h.runner.buffer[h.out.request_id]["hidden_states"]["output"])


def test_pr_raises_on_missing_metadata():
    h = Harness(FixedTalker)
    ids = torch.tensor(h.req.all_token_ids[:4])
    with pytest.raises(ContractError, match="_omni_prompt_len"):
        h.model.talker_preprocess(ids, h.model.talker.embed_input_ids(ids), _omni_num_computed_tokens=0,
                                  **h.out.payload({t: 1000 for t in h.out.prompt_tokens + h.out.reply_tokens}))


def test_pr_raises_when_reconstructed_prompt_length_differs():
    h = Harness(FixedTalker)
    h.req.prompt_token_ids = h.req.prompt_token_ids + [CODEC_PAD]  # scheduler says P+1
    r = h.call(0, 8)
    assert r.error is not None and "reconstructed prompt has" in r.error


def test_plugin_function_arm_is_bound_as_method():
    calls = []

    def passthrough(self, input_ids, input_embeds, **info):
        calls.append(info["_omni_num_computed_tokens"])
        return input_ids, input_embeds, {}

    h = Harness(passthrough)
    r = h.call(0, 8)
    assert calls == [0] and r.span.rows == 8
    assert text(h, 0, 8) == [NONE] * 8  # the codec embedding alone: no Thinker rows at all


@pytest.mark.slow
def test_plugin_module_in_the_working_directory_imports_with_the_installed_script(tmp_path):
    """``omni-stress run --arm fix=mytalker:Fix`` from the folder holding mytalker.py, as a user
    runs it (the console script's folder, not the working directory, is on Python's path)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "mytalker.py").write_text("from harness.families.qwen2_5_omni.pr import FixedTalker\n\n\n"
                                          "class Fix(FixedTalker):\n    pass\n")
    script = Path(sys.executable).parent / "omni-stress"
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([str(script), "run", "--arm", "fix=mytalker:Fix", "--deploy", "reference", "--asr", "none",
                           "--prompts", str(repo / "tests" / "fixtures" / "prompts_small.yaml"), "--out", "out",
                           "--run-id", "r", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "r" / "requests.jsonl").read_text().splitlines()]
    assert [r["arm"] for r in records] == ["fix"] * 4 and all(r["oracle_wer"] == 0.0 for r in records)
