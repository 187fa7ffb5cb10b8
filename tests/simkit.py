"""Test helpers shared by tests/test_arms.py and tests/test_upstream_arm.py."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FakeSamplingParams:
    max_tokens: int = 1900
    seed: int = 42


@dataclass
class FakeRequest:
    """The fields of vllm.v1.request.Request the sim's runner reads."""

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    sampling_params: FakeSamplingParams = field(default_factory=FakeSamplingParams)
