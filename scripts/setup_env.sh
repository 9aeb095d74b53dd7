#!/usr/bin/env bash
# Create .venv (if needed), install npu-spec into it, and build the pinned llama-server.
# Usage: setup_env.sh [EXTRAS]  (none for the demo; dev or export add PyTorch)
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (everything is cached).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-}"

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "npu-spec needs Python >= 3.11 (found $("$PYTHON" --version))" >&2; exit 1; }
[ -x "$REPO/.venv/bin/python" ] || "$PYTHON" -m venv "$REPO/.venv"
# shellcheck disable=SC1091
source "$REPO/.venv/bin/activate"
python -m pip install --quiet --upgrade pip
if [ -n "$EXTRAS" ]; then
  # Only `dev` and `export` need PyTorch (the tests compare with transformers; export-drafter
  # --precision int4 runs onnxruntime-genai's model builder); the demo and `serve` need none.
  # Pinned to 2.13.0 because this project's machines keep that CPU wheel on disk and pip
  # takes it from there. Elsewhere PyPI's torch==2.13.0 for Linux is the CUDA build, several
  # GB with its nvidia-* libraries; install a CPU build first if you want a smaller venv.
  python -c 'import torch' 2>/dev/null || python -m pip install --quiet "torch==2.13.0"
fi
python -m pip install --quiet -e "$REPO${EXTRAS:+[$EXTRAS]}"
npu-spec install-server
