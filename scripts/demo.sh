#!/usr/bin/env bash
# The main job on a fresh machine: provision llama-server, make the demo models, serve the proxy.
# Options after the script name go to `npu-spec serve` (e.g. --port 9000 -k 6).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup_env.sh" export  # export: to build the demo drafter
MODELS="${NPU_SPEC_DEMO_MODELS:-$REPO/.models/demo}"
[ -f "$MODELS/manifest.json" ] || npu-spec make-models "$MODELS" --draft noisy
exec npu-spec serve --target "$MODELS/target.gguf" --drafter "$MODELS/draft" "$@"
