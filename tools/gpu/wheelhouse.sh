#!/usr/bin/env bash
# Fetch, on a machine with a package registry, the wheels the GPU check needs
# on a bare GPU machine (Python 3.12, manylinux x86-64, torch and CUDA already
# there) into .whl/ of this checkout; copy the checkout over and run
# tools/gpu/check.sh there. Versions are the ones this checkout's environment
# has (.venv), so the GPU machine runs what CI tested.
#
#   bash tools/gpu/wheelhouse.sh            # what the one-GPU check needs
#   bash tools/gpu/wheelhouse.sh --two-gpu  # also DeepSpeed and Megatron-core
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
OUT=${FREERIDE_WHEELS:-.whl}
mkdir -p "$OUT"

# Not on the GPU machine (it has torch, nvidia-ml-py, uvloop, prometheus-client, rich); the test
# tools run the suite's GPU tests (check section g).
CORE=(pyzmq msgspec pytest pytest-asyncio pluggy iniconfig packaging pygments)
# The real pipelines; pip is told --no-deps, so every dependency is named.
TWO_GPU=(megatron-core hjson ninja py-cpuinfo pydantic pydantic-core annotated-types typing-inspection
    typing-extensions einops msgpack psutil tqdm packaging numpy)

names=("${CORE[@]}")
two_gpu=0
[[ ${1:-} == --two-gpu ]] && two_gpu=1 && names+=("${TWO_GPU[@]}")

version() { "$PY" -c 'import sys; from importlib.metadata import version; print(version(sys.argv[1]))' "$1"; }

# pip matches manylinux_2_N tags exactly: name each one the GPU machine's glibc accepts.
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done

for name in "${names[@]}"; do
    pin="$name==$(version "$name")"
    echo "[wheelhouse] $pin" >&2
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$OUT" "$pin"
done

if [[ $two_gpu == 1 ]]; then
    # DeepSpeed is published as a source distribution: build a pure-Python wheel
    # (no prebuilt ops; they are compiled just in time where needed).
    pin="deepspeed==$(version deepspeed)"
    echo "[wheelhouse] $pin (built here)" >&2
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$pin"
fi
ls -1 "$OUT"/*.whl
