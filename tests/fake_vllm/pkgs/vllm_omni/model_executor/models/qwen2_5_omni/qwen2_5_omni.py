"""Fake of vllm_omni/model_executor/models/qwen2_5_omni/qwen2_5_omni.py (0.30.0) for the trace plugin.

Same module path, class name, registration (``set_custom_preprocess(self.talker_preprocess)`` in
``__init__``) and call signature as the real one, and the same row-count behaviour as 0.30.0's
routing by span length: a span with n > 1 gets the whole prompt (P rows) back, n == 1 one row.
"""

from __future__ import annotations

from typing import Any


class FakeTensor:
    """Just enough of a torch tensor: ``shape`` and ``storage_offset()``."""

    def __init__(self, rows: int, offset: int = 0, dim: int = 4) -> None:
        self.shape = (rows, dim) if dim else (rows,)
        self._offset = offset

    def storage_offset(self) -> int:
        return self._offset


class Qwen2_5OmniForConditionalGeneration:
    def __init__(self, model_stage: str = "talker") -> None:
        self.model_stage = model_stage
        self.has_preprocess = model_stage == "talker"
        if self.has_preprocess:
            self.set_custom_preprocess(self.talker_preprocess)

    def set_custom_preprocess(self, fn: Any) -> None:
        self.preprocess = fn

    def talker_preprocess(self, input_ids: FakeTensor, input_embeds: Any, **info_dict: Any):
        span_len = input_ids.shape[0]
        if span_len > 1:
            rows = int(info_dict.get("_omni_prompt_len") or span_len)
            return FakeTensor(rows, dim=0), FakeTensor(rows), {"embed": {}}
        return FakeTensor(1, dim=0), FakeTensor(1), {}
