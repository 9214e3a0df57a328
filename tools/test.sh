#!/usr/bin/env bash
# The test command of the README and of CI: install (idempotent), check, test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
.venv/bin/ruff check freeride backends sidetasks tools tests
.venv/bin/ruff format --check freeride backends sidetasks tools tests
.venv/bin/mypy
set +e
.venv/bin/python -m pytest "$@"
code=$?
set -e
# pytest exits 5 when it collected no tests (e.g. a -k filter that matches nothing)
if [ "$code" -eq 5 ]; then
    echo "pytest collected no tests"
    exit 0
fi
exit "$code"
