#!/usr/bin/env bash
# What the browser test (tests/clients/test_web_ui_browser.py) needs, built once and
# cached: llama.cpp's web UI from the pinned source (npm ci + npm run build, served by
# the test's llama-server with --path, so llama-server itself needs no rebuild),
# Debian's chromium, and playwright-core to drive it. Prints the three paths.
#
# The stock llama-server build embeds no UI here: its CMake fetches a prebuilt one
# from Hugging Face, which this machine cannot reach, and LLAMA_BUILD_UI=ON would
# rebuild the whole server for the same npm build this script does.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
read -r SRC BUILD CACHE < <(cd "$REPO" && "$PY" -c '
from proxy.server.server_install import LLAMA_CPP_BUILD, cache_root, fetch_source
print(fetch_source(), LLAMA_CPP_BUILD, cache_root())')
ROOT="$CACHE/web-ui"
DIST="$ROOT/dist-$BUILD"
DRIVER="$ROOT/driver"
PLAYWRIGHT_VERSION=1.56.1  # the version the UI's own e2e tests pin

if [ ! -f "$DIST/index.html" ]; then
  work="$ROOT/build-$BUILD"
  rm -rf "$work" && mkdir -p "$work" && cp -r "$SRC/tools/ui/." "$work/"
  echo "building llama.cpp's web UI ($BUILD) in $work" >&2
  (cd "$work" && npm ci --no-audit --no-fund --loglevel=error >&2 && npm run build >&2)
  rm -rf "$DIST.partial" && cp -r "$work/dist" "$DIST.partial" && mv "$DIST.partial" "$DIST"
  rm -rf "$work"  # node_modules alone is ~700 MB
fi

if ! command -v chromium >/dev/null; then
  echo "installing Debian's chromium" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium fonts-dejavu-core >&2
fi

if [ ! -d "$DRIVER/node_modules/playwright-core" ]; then
  mkdir -p "$DRIVER"
  (cd "$DRIVER" && echo '{"private": true}' > package.json \
    && npm install --no-audit --no-fund --loglevel=error "playwright-core@$PLAYWRIGHT_VERSION" >&2)
fi
echo "$DIST"
command -v chromium
echo "$DRIVER/node_modules"
