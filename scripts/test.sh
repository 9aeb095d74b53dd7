#!/usr/bin/env bash
# The whole test suite on a fresh machine: environment, llama-server, lint, tests.
# Extra arguments go to pytest. NPU_SPEC_KEEP_TEST_MODELS=1 keeps the generated test
# models (~8 GB) for the next run instead of deleting them at the end.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

cat >&2 <<'EOF'
scripts/test.sh: what it does and costs (2-core machine, first run)
  - .venv/: npu-spec with its dev extras and PyTorch 2.13.0 (pip; ~1.4 GB; off this
    project's machines PyPI's torch for Linux is the CUDA build, several GB: install a
    CPU build into .venv first to avoid that)
  - builds the pinned llama-server into ~/.cache/npu-spec (~15 min, once)
  - generates test models into .cache/test-models (~8 GB, several minutes; deleted at
    the end unless NPU_SPEC_KEEP_TEST_MODELS=1)
  - the browser test: builds llama.cpp's web UI with npm, installs playwright-core
    (~/.cache/npu-spec/web-ui) and, as root with apt-get, Debian's chromium; without
    node/npm, or without root or apt-get for chromium, that one test skips and says why
    (under CI=true it must run)
  - ruff, then pytest against real llama-server processes (~35 min on 2 cores)
EOF

source "$REPO/scripts/setup_env.sh" dev
cd "$REPO"
ruff check .
ruff format --check .

# Every temporary file of the run (pytest's folders, slot files, chromium's profile)
# goes to one folder, removed on exit.
scratch="$(mktemp -d "${TMPDIR:-/tmp}/npu-spec-tests-XXXXXX")"
mkdir -p "$scratch/tmp"
cleanup() {
  rm -rf "$scratch"
  if [ "${NPU_SPEC_KEEP_TEST_MODELS:-0}" != "1" ]; then
    rm -rf "$REPO/.cache/test-models"
  fi
}
trap cleanup EXIT

set +e
TMPDIR="$scratch/tmp" python -m pytest -q -p no:cacheprovider --basetemp="$scratch/pytest" "$@"
status=$?
set -e
# pytest exits 5 when it collected no tests: that is a failure, not a pass.
if [ "$status" -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$status"
