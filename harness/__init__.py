"""omni-stress: stress-test and WER harness for the Qwen2.5-Omni Talker."""

__version__ = "0.1.0"
