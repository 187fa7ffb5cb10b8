"""Helpers shared by tests/test_serve_*.py: arms that start the fake server, deploys, pid checks."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from harness.config import ArmSpec, Deploy, ServeSettings, load_deploy

HERE = Path(__file__).resolve().parent
FAKE_VLLM = HERE / "fake_vllm_serve.py"

STRESS_YAML = """\
name: stress
description: chunked Talker prefill under a tiny KV cache
async_chunk: false
thinker: {max_num_seqs: 1}
code2wav: {max_num_seqs: 1}
talker:
  max_num_seqs: 4
  enable_chunked_prefill: true
  max_num_batched_tokens: 32
  num_gpu_blocks_override: 128
  max_model_len: 1984
sampling: {temperature: 0.9, top_p: 0.8, top_k: 40, seed: 42, max_tokens: 1900}
"""

REFERENCE_YAML = """\
name: reference
description: default Talker settings
async_chunk: false
thinker: {max_num_seqs: 1}
code2wav: {max_num_seqs: 1}
talker: {max_num_seqs: 4}
"""


def deploy(tmp_path: Path, text: str = STRESS_YAML, name: str = "stress") -> Deploy:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return load_deploy(str(path))


def fake_arm(name: str = "main", **env: str) -> ArmSpec:
    """An arm whose ``serve.command`` is the fake vllm executable, controlled by FAKE_VLLM_* env; the fake
    is "an installed vLLM-Omni as it is" (``bind_arm: false``): its talker is not bound into it."""
    return ArmSpec(name=name, talker="harness.families.qwen2_5_omni.main:Talker",
                   serve=ServeSettings(command=(sys.executable, str(FAKE_VLLM)),
                                       env={"OMNI_STRESS_CONTRACT": "0", **env}, bind_arm=False))


def fake_argv(port: int, *extra: str, **_: object) -> list[str]:
    return [sys.executable, str(FAKE_VLLM), "serve", "fake/model", "--omni", "--host", "127.0.0.1",
            "--port", str(port), *extra]


# Expected per-request events of the fake's scripted schedule (P=20, see fake_vllm_serve.py), worked
# out by hand from the contract's definitions.
EXPECTED_EVENTS = {
    "talker_calls": 13,
    "prefill_calls": 6,  # (0,8) (8,8) (16,4) (0,8) (8,8) (16,8)
    "nonzero_offset_chunks": 4,  # (8,8) (16,4) (8,8) (16,8)
    "cross_boundary_replays": 1,  # (16,8): 16 < 20 < 24
    "replays_ending_in_text": 0,  # a real server's records do not know the text length: not counted
    "multi_position_decode_spans": 0,
    "one_token_tails": 0,
    "row_count_mismatches": 6,  # every n > 1 span gets P = 20 rows back
    "prefill_row_count_mismatches": 6,
    "misaligned_positions": 0,
    "misaligned_text_positions": 0,  # the fake's rows are no Qwen rows: the worker's contract check is off
    "misaligned_end_positions": 0,
    "cross_request_positions": 0,  # the sim's count (whose rows a position ran with): a real server does not count it
}
