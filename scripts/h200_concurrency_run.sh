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
source scripts/device_env.sh
# 2.5 ms a drafted token: about 0.12 of the 14B f16 plain step (the regime run's X)
CONC_COMMON=(--target /tmp/m14/target.gguf --server-args='-ngl 99 -fa on' --modes plain,oracle
  -k 4 --oracle-acceptance 0.77 --oracle-delay-ms 2.5 --ctx 4096
  --proxy-variant 'defaults=' --proxy-variant 'plain-under-load=--under-load plain')

case "$STAGE" in
  start)  # the same build and models as the regime validation's
    bash scripts/h200_regime_run.sh start
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
