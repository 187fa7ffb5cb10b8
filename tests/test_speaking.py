"""The speaking tiny model's pure parts: its rules, the oracle read-back, the trace's codec ids, the
stream assembled by position, the Thinker's reply forcer, and how a speaking checkpoint changes the
server command and the request body. The weights themselves are checked in the real environment
(tests/test_real_cpu_e2e.py: ``speaking_check`` and the real server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.families.qwen2_5_omni import speaking
from harness.config import load_deploy, load_prompts
from harness.serve import client as chat
from harness.serve.backend import ServeOptions, _collect_codec, codec_stream, is_speaking_checkpoint
from harness.serve.deploy_args import REPLY_FORCER, translate_deploy
from harness.serve.trace_plugin import TraceWriter, wrap_talker_preprocess

ROOT = Path(__file__).resolve().parents[1]


def test_codec_id_is_tag_of_previous_byte_times_256_plus_byte():
    assert speaking.codec_id(ord("H"), None) == 72
    assert speaking.codec_id(ord("e"), ord("H")) == (72 % 32) * 256 + 101 == 2149
    assert speaking.next_code(True, None, ord("a")) == speaking.CODEC_EOS
    # rule 3, the end region: text-EOS and a first PAD say SILENCE, a PAD after a PAD ends
    assert speaking.next_code(True, None, ord("a"), speaking.EOS_MARK) == speaking.SILENCE == 0
    assert speaking.next_code(False, None, None, speaking.PAD_MARK, speaking.EOS_MARK) == speaking.SILENCE
    assert speaking.next_code(True, None, None, speaking.PAD_MARK, speaking.PAD_MARK) == speaking.CODEC_EOS
    assert speaking.next_code(True, None, None, None, speaking.EOS_MARK) == speaking.CODEC_EOS
    assert speaking.next_code(False, ord("a"), None) == speaking.BABBLE
    assert speaking.next_code(True, ord("a"), ord(" ")) == 97  # space is tag 0
    with pytest.raises(ValueError, match="byte 256 out of range"):
        speaking.codec_id(256, None)


def test_encode_then_decode_gives_the_text_back():
    codes = speaking.encode_reply("Heat the water.")
    assert len(codes) == 17 and codes[0] == 72 and codes[15:] == [speaking.SILENCE] * 2
    assert speaking.encode_reply("Heat the water.", end=False) == codes[:15]
    got = speaking.decode(codes + [speaking.CODEC_EOS, 5, 6])
    assert got == speaking.Spoken(text="Heat the water.", codes=17, speech=15, babble=0, garbled=0, other=0,
                                  silence=2)


def test_a_token_whose_memory_disagrees_loses_its_word_and_the_next_bytes_word():
    codes = speaking.encode_reply("Heat the water.")
    codes[6] = speaking.codec_id(ord("h"), ord("q"))  # said 'h' but remembered 'q' before it
    got = speaking.decode(codes)
    assert got.text == "Heat <unk> water." and got.garbled == 1
    codes = speaking.encode_reply("ab cd")
    codes[2] = speaking.codec_id(ord(" "), ord("x"))  # a garbled space joins its two words
    assert speaking.decode(codes).text == "<unk>"


def test_babble_and_foreign_ids_say_nothing():
    got = speaking.decode([speaking.BABBLE] * 4 + [8293])
    assert (got.text, got.codes, got.babble, got.other) == ("", 5, 4, 1)


class _Model:
    def talker_preprocess(self, input_ids, input_embeds, **info):
        input_ids[:] = 0  # an arm may overwrite its ids (main's prefill branch returns mask ids)
        return input_ids, torch.zeros(input_ids.shape[0], 4), {}


def test_trace_records_the_ids_of_generated_positions(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_STRESS_CONTRACT", "0")

    class M(_Model):
        pass

    wrap_talker_preprocess(M, TraceWriter(str(tmp_path)))
    m = M()
    for c, ids in ((0, [1, 2, 3]), (3, [9]), (4, [10]), (0, [1, 2, 3, 9, 10])):
        m.talker_preprocess(torch.tensor(ids), None, request_id="r", _omni_prompt_len=4,
                            _omni_num_computed_tokens=c, _omni_is_prefill=c < 4)
    lines = [json.loads(x) for x in next(tmp_path.glob("trace-*.jsonl")).read_text().splitlines()]
    assert [(ln.get("codec_from"), ln.get("codec_ids")) for ln in lines] == [
        (None, None), (None, None), (4, [10]), (4, [10])]


def test_codec_stream_is_read_by_position_up_to_the_first_gap():
    stream: dict[int, int] = {}
    for line in ({"codec_from": 4, "codec_ids": [10]}, {"codec_from": 5, "codec_ids": [11, 12]},
                 {"codec_from": 4, "codec_ids": [10, 11]}, {"codec_from": 9, "codec_ids": [99]}, {"rows": 3}):
        _collect_codec(stream, line)
    assert codec_stream(stream, 4) == [10, 11, 12]
    assert codec_stream(stream, None) == []


class _Tok:
    eos_token_id = 151645

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}


class _Params:
    def __init__(self, extra=None):
        self.extra_args = extra


def test_reply_forcer_leaves_one_finite_logit_per_forced_request():
    from vllm.v1.sample.logits_processor import BatchUpdate

    from harness.serve.reply_forcer import ReplyForcer

    forcer = ReplyForcer(None, torch.device("cpu"), False)
    forcer._tokenizer = _Tok()
    out_a: list[int] = []
    out_b: list[int] = []
    forcer.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[
        (0, _Params({"omni_stress_reply": "hi"}), [1, 2], out_a), (1, _Params(), [3], out_b)]))
    logits = torch.randn(2, 200000)
    before_b = logits[1].clone()
    got = forcer.apply(logits)
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [ord("h")]
    assert torch.equal(got[1], before_b)  # a request without the key is untouched
    out_a.extend([ord("h"), ord("i")])
    got = forcer.apply(torch.randn(2, 200000))
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [151645]  # then the tokenizer's EOS
    forcer.update_state(BatchUpdate(batch_size=1, removed=[0], moved=[], added=[]))
    assert forcer._reqs == {}
    assert forcer.is_argmax_invariant() is False


def test_a_speaking_checkpoint_adds_the_forcer_and_the_reply(tmp_path):
    deploy = load_deploy("cpu-stress")
    prompts = load_prompts("cpu_smoke")
    assert "logits_processors" not in translate_deploy(deploy, "cpu").stage_overrides["0"]
    assert translate_deploy(deploy, "cpu", speaking=True).stage_overrides["0"]["logits_processors"] == [REPLY_FORCER]
    body = chat.build_body("m", prompts, prompts.prompts[0], deploy, "t", speaking=True)
    assert body["sampling_params_list"][0]["extra_args"] == {"omni_stress_reply": prompts.prompts[0].reply}
    assert "extra_args" not in chat.build_body("m", prompts, prompts.prompts[0], deploy, "t")["sampling_params_list"][0]
    model = tmp_path / "tiny"
    model.mkdir()
    assert is_speaking_checkpoint(str(model)) is False
    (model / "omni_stress_tiny_model.json").write_text(json.dumps({"speaking": True}))
    assert is_speaking_checkpoint(str(model)) is True and ServeOptions(model=str(model)).speaking is True
    (model / "omni_stress_tiny_model.json").write_text("[1]")
    assert is_speaking_checkpoint(str(model)) is False


def test_cpu_smoke_replies_fit_the_thinker_length_and_are_one_length():
    lengths = {p.id: len(p.reply.encode()) for p in load_prompts("cpu_smoke").prompts}
    assert max(lengths.values()) < 80, lengths  # one token per byte, Thinker max_tokens 80 with its EOS
    assert set(lengths.values()) == {70}, lengths  # the Thinker finishes all four on one step
