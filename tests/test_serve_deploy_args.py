"""Deploy -> vLLM-Omni 0.30.0 CLI translation: one test per Deploy field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness.config import (
    Deploy,
    SamplingSettings,
    SimSettings,
    SpecDecodeSettings,
    StageSettings,
    TalkerSettings,
)
from harness.errors import UserError
from harness.serve.deploy_args import translate_deploy


def make(**talker: object) -> Deploy:
    return Deploy(name="d", description="", path=Path("deploy_configs/d.yaml"), talker=TalkerSettings(**talker),
                  thinker=StageSettings(), code2wav=StageSettings(), async_chunk=False,
                  sampling=SamplingSettings(), sim=SimSettings())


def stage(deploy: Deploy, sid: str) -> dict:
    t = translate_deploy(deploy)
    assert t.cli_args[0] == "--stage-overrides"
    assert json.loads(t.cli_args[1]) == t.stage_overrides  # the JSON on the command line is the mapping
    return t.stage_overrides[sid]


def test_defaults_leave_everything_to_vllm_omni():
    t = translate_deploy(make())
    assert t.stage_overrides == {"0": {"max_num_seqs": 1}, "1": {"max_num_seqs": 4, "enable_prefix_caching": False},
                                 "2": {"max_num_seqs": 1}}
    assert t.cli_args == ("--stage-overrides",
                          ('{"0":{"max_num_seqs":1},"1":{"enable_prefix_caching":false,"max_num_seqs":4},'
                          '"2":{"max_num_seqs":1}}'), "--no-async-chunk")


def test_talker_max_num_seqs():
    assert stage(make(max_num_seqs=7), "1")["max_num_seqs"] == 7


def test_talker_max_num_batched_tokens():
    assert stage(make(max_num_batched_tokens=32), "1")["max_num_batched_tokens"] == 32
    assert "max_num_batched_tokens" not in stage(make(), "1")


def test_talker_enable_chunked_prefill():
    assert stage(make(enable_chunked_prefill=True), "1")["enable_chunked_prefill"] is True
    assert stage(make(enable_chunked_prefill=False), "1")["enable_chunked_prefill"] is False
    assert "enable_chunked_prefill" not in stage(make(), "1")


def test_talker_num_gpu_blocks_override_pins_block_size():
    s = stage(make(num_gpu_blocks_override=128), "1")
    assert s["num_gpu_blocks_override"] == 128
    assert s["block_size"] == 16


def test_talker_block_size():
    assert "block_size" not in stage(make(), "1")  # vLLM's own default when nothing pins the KV budget
    assert stage(make(block_size=32), "1")["block_size"] == 32


def test_talker_enable_prefix_caching_is_always_pinned():
    assert stage(make(), "1")["enable_prefix_caching"] is False
    assert stage(make(enable_prefix_caching=True), "1")["enable_prefix_caching"] is True


def test_talker_max_model_len():
    assert stage(make(max_model_len=1984), "1")["max_model_len"] == 1984


def test_talker_gpu_memory_utilization():
    assert stage(make(gpu_memory_utilization=0.5), "1")["gpu_memory_utilization"] == 0.5


def test_thinker_max_num_seqs():
    d = dataclasses.replace(make(), thinker=StageSettings(max_num_seqs=2))
    assert stage(d, "0") == {"max_num_seqs": 2}


def test_code2wav_max_num_seqs():
    d = dataclasses.replace(make(), code2wav=StageSettings(max_num_seqs=3))
    assert stage(d, "2") == {"max_num_seqs": 3}


def test_async_chunk():
    assert translate_deploy(make()).cli_args[-1] == "--no-async-chunk"
    assert translate_deploy(dataclasses.replace(make(), async_chunk=True)).cli_args[-1] == "--async-chunk"


def test_speculative_is_refused_with_the_file_named():
    d = dataclasses.replace(make(), speculative=SpecDecodeSettings())
    with pytest.raises(UserError, match=r"deploy_configs/d.yaml: speculative: .*speculative_config"):
        translate_deploy(d)


def test_sampling_and_sim_do_not_reach_the_command_line():
    d = dataclasses.replace(make(), sampling=SamplingSettings(temperature=0.1), sim=SimSettings(max_steps=5))
    assert translate_deploy(d) == translate_deploy(make())


def test_seed_stress_deploy_exactly():
    t = translate_deploy(make(max_num_seqs=4, enable_chunked_prefill=True, max_num_batched_tokens=32,
                              num_gpu_blocks_override=128, max_model_len=1984))
    assert t.stage_overrides["1"] == {"max_num_seqs": 4, "enable_chunked_prefill": True, "max_num_batched_tokens": 32,
                                      "num_gpu_blocks_override": 128, "block_size": 16, "max_model_len": 1984,
                                      "enable_prefix_caching": False}


def test_the_repository_deploys_translate_to_the_seed_setup():
    from harness.config import load_deploy

    stress = translate_deploy(load_deploy("stress"))
    assert stress.cli_args == (
        "--stage-overrides",
        ('{"0":{"max_num_seqs":1},"1":{"block_size":16,"enable_chunked_prefill":true,"enable_prefix_caching":false,'
        '"max_model_len":1984,"max_num_batched_tokens":32,"max_num_seqs":4,"num_gpu_blocks_override":128},'
        '"2":{"max_num_seqs":1}}'),
        "--no-async-chunk")
    reference = translate_deploy(load_deploy("reference"))
    assert reference.stage_overrides == {
        "0": {"max_num_seqs": 1}, "2": {"max_num_seqs": 1},
        "1": {"max_num_seqs": 4, "enable_prefix_caching": False, "max_num_batched_tokens": 32768}}
