#!/usr/bin/env bash
# What the browser test (tests/proxy/test_web_ui_browser.py) needs, built once and
# cached: llama.cpp's web UI from the pinned source (npm ci + npm run build, served by
# the test's llama-server with --path, so llama-server itself needs no rebuild),
# Debian's chromium, and playwright-core to drive it. Prints the three paths.
#
# Where a tool cannot be had (no node/npm, or no chromium and no root or apt-get to
# install it), it prints one line saying why and exits with CANNOT (3): the test then
# skips, except under CI, where it must run.
#
# The stock llama-server build embeds no UI here: its CMake fetches a prebuilt one
# from Hugging Face, which this machine cannot reach, and LLAMA_BUILD_UI=ON would
# rebuild the whole server for the same npm build this script does.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
CANNOT=3

cannot() { echo "$1" >&2; exit "$CANNOT"; }
command -v npm >/dev/null && command -v node >/dev/null \
  || cannot "node and npm are not installed (needed to build llama.cpp's web UI and drive chromium)"
if ! command -v chromium >/dev/null; then
  command -v apt-get >/dev/null || cannot "chromium is not installed and there is no apt-get to install it"
  [ "$(id -u)" -eq 0 ] || cannot "chromium is not installed and installing it needs root (apt-get install chromium)"
fi
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
