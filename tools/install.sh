#!/usr/bin/env bash
# Create .venv and install FreeRide (distribution freeride-runtime) with every
# extra and its test tools. Safe to run again.
#
# Order matters: torch first (the CPU build on machines without a GPU), then
# DeepSpeed without build isolation (its build imports torch; an isolated
# build would download a second, multi-GB CUDA torch), then FreeRide.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip install --disable-pip-version-check -q "$@"; }
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip torch                 # GPU machine: the CUDA build
    else
        # the CPU build: from PyTorch's CPU wheel index where it is reachable, else
        # whatever this machine's package sources hold (a local CPU wheel, a mirror)
        pip --index-url "$TORCH_CPU_INDEX" --timeout 20 --retries 1 torch==2.13.0 2>/dev/null ||
            pip torch==2.13.0
    fi
fi
if ! .venv/bin/python -c "import deepspeed" 2>/dev/null; then
    DS_BUILD_OPS=0 pip --no-build-isolation "deepspeed>=0.19,<0.20"
fi
pip -e ".[test,deepspeed,megatron,ray,plot]"   # ray: the cluster queue and its tests (~80 MB download, ~20 s)
echo "freeride installed in .venv ($(.venv/bin/freeride --version))"
