#!/usr/bin/env bash
# The whole test suite on a fresh machine: environment, llama-server, lint, tests.
# Extra arguments go to pytest.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup_env.sh" dev
cd "$REPO"
ruff check .
ruff format --check .
set +e
python -m pytest -q -p no:cacheprovider "$@"
status=$?
set -e
# pytest exits 5 when it collected no tests: that is a failure, not a pass.
if [ "$status" -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$status"
