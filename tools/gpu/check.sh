#!/usr/bin/env bash
# The one-command GPU check: run it on a bare machine with one GPU (PyTorch and
# CUDA present, no package registry) from the root of a checkout that holds the
# wheels tools/gpu/wheelhouse.sh fetched in .whl/. It writes gpu-check-report.md
# (or --out FILE) in under 10 minutes. See docs/gpu.md.
#
#   bash tools/gpu/check.sh                 # one GPU
#   bash tools/gpu/check.sh --two-gpu       # also the real DeepSpeed and Megatron pipelines
#   bash tools/gpu/check.sh --dry-run       # the same path on CPU (CI; needs the project's .venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
dry=0
two=0
for arg in "$@"; do
    [[ $arg == --dry-run ]] && dry=1
    [[ $arg == --two-gpu ]] && two=1
done
# one GPU: under 10 minutes; the real two-GPU pipelines come on top
LIMIT_S=${FREERIDE_CHECK_LIMIT_S:-$((two == 1 ? 1500 : 590))}

if [[ $dry == 1 ]]; then
    PY=${PYTHON:-$ROOT/.venv/bin/python}
    [[ -x $PY ]] || PY=python3
else
    PY=${PYTHON:-python3}
    SITE=${FREERIDE_SITE:-/tmp/site}
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "[check] installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into $SITE" >&2
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    fi
    # A virtual environment over the system's packages (torch, CUDA), with this
    # checkout and the wheels on its path through a .pth file: every process the
    # check starts (manager, workers, stages) runs its python and sees the same.
    VENV=${FREERIDE_CHECK_VENV:-/tmp/freeride-check-venv}
    if "$PY" -m venv --system-site-packages --without-pip "$VENV" 2>/dev/null; then
        purelib=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        # where python3 is itself a virtual environment (torch in its site-packages), that one too
        own=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        printf '%s\n%s\n%s\n' "$ROOT" "$SITE" "$own" >"$purelib/freeride-check.pth"
        PY=$VENV/bin/python
    else
        echo "[check] no venv module: falling back to PYTHONPATH" >&2
        export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi

if ! "$PY" -c "import torch, zmq, msgspec, uvloop, freeride.backends, freeride.sidetasks" 2>/dev/null; then
    echo "check: $PY cannot import torch, zmq, msgspec, uvloop and this checkout;" \
        "run tools/gpu/wheelhouse.sh on a machine with a package registry and copy .whl/ here" >&2
    exit 2
fi
exec timeout --kill-after=10 "$LIMIT_S" "$PY" "$ROOT/tools/gpu/check.py" "$@"
