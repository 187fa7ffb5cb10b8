"""Fake vllm_omni package for omni-stress tests (only what the trace plugin hooks)."""
