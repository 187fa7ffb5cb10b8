"""The real vLLM-Omni backend: launch ``vllm serve MODEL --omni`` per arm x deploy, drive it, trace the Talker.

Kept import-free on purpose: ``harness.serve.trace_plugin`` is loaded by vLLM inside the arm's own
environment (entry point ``vllm.general_plugins``), where only the standard library can be assumed.
Import the submodules directly: ``harness.serve.backend`` (``ServeOptions``, ``describe_cell``,
``run_cell``), ``deploy_args``, ``launcher``, ``client``, ``trace_plugin``.
"""
