#!/usr/bin/env bash
# The main job on a fresh machine: provision llama-server, make the demo models, serve the proxy.
# Options after the script name go to `npu-spec serve` (e.g. --port 9000 -k 6).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# "" = no extras (the demo drafter is written without PyTorch); an empty argument, since a
# sourced script without arguments would see this script's own (the serve options).
source "$REPO/scripts/setup_env.sh" ""
MODELS="${NPU_SPEC_DEMO_MODELS:-$REPO/.models/demo}"
[ -f "$MODELS/manifest.json" ] || npu-spec make-models "$MODELS" --draft noisy
exec npu-spec serve --target "$MODELS/target.gguf" --drafter "$MODELS/draft" "$@"
