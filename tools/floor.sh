#!/usr/bin/env bash
# The oldest releases FreeRide declares, tested: a virtual environment (.venv-floor)
# holding the lowest release of each direct dependency that pyproject.toml allows
# (torch>=2.5 -> torch 2.5.x, numpy>=1.24 -> numpy 1.24.x, ... the extras'
# frameworks included), then the tests given (default: the unit tests) run there.
#
#   bash tools/floor.sh                                   # install, then tests/unit
#   bash tools/floor.sh tests/unit tests/ipc -m 'not slow' -q
#
# On a machine without a GPU torch comes from PyTorch's CPU wheel index where it
# is reachable; elsewhere the package index's build brings the CUDA libraries
# (about 3 GB, unused on a CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-floor
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

# One pin per declared floor: "name>=X.Y" -> "name==X.Y.*" (the extras' too, but the test tools')
floors=$("$VENV/bin/python" - <<'EOF'
import re
import tomllib

SKIP = {"test"}  # the test tools' floors are not the product's
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
declared = project["dependencies"] + [d for name, deps in extras.items() if name not in SKIP for d in deps]
for dep in declared:
    found = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(?:,.*)?", dep.replace(" ", ""))
    if found is None:
        raise SystemExit(f"tools/floor.sh: no floor in {dep!r}")
    print(f"{found[1]}=={found[2]}.*")
EOF
)
torch_pin=$(grep '^torch==' <<<"$floors")
printf '%s\n' $floors >"$VENV/floors.txt"

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    pip --index-url "$TORCH_CPU_INDEX" --timeout 20 --retries 1 "$torch_pin" 2>/dev/null || pip "$torch_pin"
fi
if ! "$VENV/bin/python" -c "import deepspeed" 2>/dev/null; then
    DS_BUILD_OPS=0 pip --no-build-isolation -c "$VENV/floors.txt" "$(grep '^deepspeed==' <<<"$floors")"
fi
pip -c "$VENV/floors.txt" -e ".[test,deepspeed,megatron,ray,plot,llm]"
"$VENV/bin/python" - <<'EOF'
from importlib.metadata import version

names = ("torch", "numpy", "msgspec", "pyzmq", "uvloop", "nvidia-ml-py", "prometheus-client", "rich", "deepspeed",
         "megatron-core", "ray", "transformers", "matplotlib")
print("floor environment:", ", ".join(f"{name} {version(name)}" for name in names))
EOF
[ "$#" -gt 0 ] || set -- tests/unit -q
# The suite turns warnings into errors; older releases warn of their own deprecations
# (matplotlib 3.8 through pyparsing 3, transformers 4.44's tokenizers): not failures here.
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::FutureWarning "$@"
