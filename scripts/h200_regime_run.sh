#!/usr/bin/env bash
# The H200 side of the regime server's validation (docs/BENCHMARKS.md, "The regime
# server"), in stages that fit one device call each; run from the repository root on the
# device machine with the pinned source in .llama-src/ and wheels in .whl/ (carried).
#   start   install wheels, build llama-server (CUDA) and the 14B-shape models, in the
#           background (setsid: they outlive the call), and wait for them
#   costs   verify-cost (parts a-g, 512 and 4k), the regime file built from it
#   costs-background  the same, left running after the call (for `WAIT_COSTS=1 emulate`)
#   bench   the real bench cells: plain and the oracle (k3, formula) at X = 0.12, 0.27
#   regime  the same cells on the regime server built from `costs`, on this host
#   strix   the Strix Halo regime files' cells (plain, defaults, k = 2, formula), this host
#   emulate the same cells on the committed regime file, on this host: needs only the
#           wheels and the pinned source (the tokenizer), no build and no models
#   formula the 4k formula cells (X = 0.12, 0.27) three times each, real and emulated on
#           this host one after the other: is the draft-length rule repeatable?
#   concurrency  scripts/h200_concurrency_run.sh bench (many users, issue 30)
#   chain   start, costs, formula and emulate (on the file just built), strix, in a row
#   s14     start, the 512 cells real and emulated, the 4k clear-stale A/B, strix
#   s15     start, verify-cost part i (the regime file rebuilt with it), the 512 and 4k
#           cells with the defaults (real), the 3-turn chats real then emulated on this
#           host (X = 0.12, with the defaults)
#   vulkan  a Vulkan llama-server (carried .debs in .cache/vkdebs, docs/VULKAN.md), its
#           verify-cost (parts a-g, 512 and 4k), the h200-vulkan-14b-f16 regime file, and
#           its cells real (plain, fixed k = 3, formula at X = 0.12) then emulated here
#   s16     start (with the Vulkan build beside it); the 4k and 512 cells with the
#           defaults (real, CUDA); then vulkan
#   s16b    the Vulkan part again on a fresh machine (the first lost its hold after the
#           512 half of verify-cost): the Vulkan build beside the models; verify-cost
#           at 4k and part i; the regime file from those and the committed 512 half; the
#           cells real, then the 512 cells emulated here
#   vulkan-rest  after vulkan-build and the models: the Vulkan verify-cost at 4k and part
#           i, the regime file (with the committed 512 half), the Vulkan cells real
#   s17     start with the Vulkan build beside it; the 512 and 4k cells with the defaults
#           and the formula at X = 0.12 (CUDA, real, 2 repeats); vulkan-rest
#   s18     start; then, side by side on separate cores: the real CUDA cells with the
#           defaults (512 at X = 0.12 and 0.27, 2 repeats; the 3-turn chats at both;
#           verify-cost part f with the slot files in /tmp and in /dev/shm; 4k at 0.12,
#           2 repeats) on cores 0-7, and emulations on 8-15 (the Strix Halo 14B chats and
#           single turns, the 32B single turns, the committed Vulkan file's cells, the
#           committed CUDA file's 512 cells and chats)
#   s19     start; then, side by side: the real CUDA cells with the defaults (3-turn chats
#           of 4 prompts; 512 and 4k single turns over all 8 prompts; always speculating at
#           512, every run checked exactly) on cores 0-7, and on 8-15 the same chats on the
#           committed CUDA file and the Strix Halo 14B chats
#   s20     start; then, side by side: the real CUDA 4k single turns with the defaults
#           over all 8 prompts and the always-speculating gen-lru at 512 (2 repeats), every
#           run checked exactly, on cores 0-7; on 8-15 the Strix Halo 14B single turns
#           (2 repeats) and chats with runner-up lines on and off (oracle runner-up hits 0.42)
#   s21     start; then, side by side: the real CUDA 4k single turns with the defaults
#           over all 8 prompts and the always-speculating gen-lru at 512 (2 repeats), every
#           run checked exactly, on cores 0-7; the Strix Halo 14B single turns (2 repeats)
#           then 3-turn chats with the code before the change (carried in ab-before/) on
#           8-11 and after it on 12-15 (defaults, runner-up hits 0.42)
#   s22     no build: side by side on this host's CPUs, the Strix Halo 14B 3-turn chats
#           then single turns with the code before the change (carried in ab-before/) on
#           0-3 and after it on 4-7 (the single turns also with --send-ahead off), and the
#           Strix Halo 32B 3-turn chats after it on 8-15
#   s23     start; verify-cost parts a, h, m at 512 (k = 3, 4) with llama.cpp's graph
#           reuse on and off (LLAMA_GRAPH_REUSE_DISABLE), and without CUDA graphs
#           (GGML_CUDA_DISABLE_GRAPHS); always speculating on gen-lru at
#           512 with every round logged (defaults, --pad-rounds on, --send-ahead off, fixed
#           k = 3 with and without padding), the defaults and padding again with graph
#           reuse off, the 3-turn chats with and without padding, and the 512 single
#           turns with the defaults over all 8 prompts; beside them on cores 8-15 the
#           Strix Halo 14B 3-turn chats with this code
#   s26     s23 cut to the 16 minutes of device time left to session 26: start; always
#           speculating on gen-lru at 512 with every round logged (defaults and fixed
#           k = 3, each with and without --pad-rounds); verify-cost parts a, h, m at 512
#           with graph reuse on, then off; the 3-turn chats with and without padding;
#           beside them on cores 8-15 the Strix Halo 14B 3-turn chats with this code; last,
#           the 512 single turns over all 8 prompts with the defaults, with and without padding
#   s26q    s26 cut to one call: start; the padding A/B with the defaults (always speculating,
#           gen-lru at 512, rounds logged); verify-cost parts a, h, m at 512 (graph reuse on)
#   s28     after s26q, on its warm machine: the 3-turn chats and the 512 single turns over
#           all 8 prompts, each with and without --pad-rounds
#   s28b    start; --pad-rounds auto against off (always speculating, gen-lru and
#           chat-travel at 512, 2 repeats, rounds logged); the 512 single turns over all 8
#           prompts with the defaults
#   s29     start; --pad-rounds auto against off (always speculating, gen-lru and
#           chat-travel at 512, 2 repeats, rounds logged) beside llama.cpp's own drafting;
#           the 3-turn chats always speculating with auto; the 512 single turns over all
#           8 prompts with the defaults; beside them the Strix Halo 14B (cores 8-11) and
#           32B (12-15) 3-turn chats with the defaults
#   s30     s29 again for an H200 (s29 got an H100): the same A/B beside llama.cpp's
#           drafting, the oracle following second flips (--oracle-sub-branches 2); the
#           3-turn chats by cost (always copying: s29's row); the 512 single turns
#           with the defaults; beside them the Strix Halo 14B 3-turn chats alone on 8-15
#   s30a    s30's A/B, then its chats, nothing beside them
#   s30b    s30's A/B alone, without llama.cpp's drafting or second flips
#   s30c    the cold fill alone: one always-speculating run of gen-lru and chat-travel
#   s31     s30's A/B (auto against off, llama.cpp's drafting beside) with the real drafter
#           on CUDA and on the host CPU in the same run, then a draft step for B = 1..16
#           sequences on CUDA and 8 host cores, the chats by cost. Needs the .ortgpu
#           parts (onnxruntime-gpu: `bash scripts/ort_gpu_parts.sh` here first). The first
#           call carries [".whl", ".llama-src", ".ortgpu/SHA256"] and runs `background
#           s31`; the next six carry one part each ([".ortgpu/part-N"]) and run `collect
#           s31 20`, back to back (a machine idle for 30 s goes back), while `start` builds
#   s31a    s31 cut to ~700 s: no second flips, no host-CPU drafter, no chats or Strix cell
#   s32     after s31 (an H100, session 32): the real drafter's rows alone (CUDA from the fp16
#           copy /tmp/m14/draft16, and the host CPU) beside plain, llama.cpp's drafting and
#           the oracle with auto, then the draft step for B sequences; the Strix 14B chats
#           beside; the same calls as s31
#   s32a    s32 cut to ~800 s: the real drafter on CUDA only, its draft step on CUDA only;
#           then 512-token cold answers always speculating (auto) against plain
#   s35     CUDA graph draft steps off and on (drafter_sessions), then s34's A/B
#   graphs  s35's graph cells alone, no llama-server
#   s36     the defaults with the real drafter on CUDA and on host cores, the warm-up at 4k
#   bs      verify rounds with the server's sampling on the GPU (-bs) against the CPU's
#   drafterprof  the real drafter's time node by node on CUDA and the host CPU, no
#           llama-server (~300 s; the calls of s31)
#   drafterquick  drafterprof cut to ~200 s: a random-weight fp16 drafter, CUDA at 512 only
#   ortcheck  onnxruntime-gpu carried in parts, and a CUDA draft step for B sequences
#           alone; its first call carries [".whl-gguf", ".ortgpu/SHA256", ".ortgpu/part-0"]
#   strix14 TREE CORES NAME OPTIONS...  one Strix Halo 14B cell run from the checkout TREE
#   background STAGE   run STAGE after this call returns (results in /tmp/bg-STAGE)
#   collect STAGE S    wait up to S seconds for a background STAGE; its results to $OUT
# Results go to $OUT.
set -euo pipefail
STAGE="$1"
source scripts/device_env.sh
BENCH_COMMON=(--prompt-ids gen-lru,chat-travel --modes plain,oracle -k 6 --repeats 1
  --ceiling-ks 1,2,3,4,6 --oracle-acceptance 0.77 --oracle-delay-steps 0.12,0.27
  --proxy-variant 'k3=--plain-runs off -k 3 --fixed-k' --proxy-variant 'spec=--plain-runs off')
# verify-cost parts a-g as the regime files are built from (with --context and -o)
COSTS_PARTS=(-k 1,2,3,4,6 --new-tokens 1,2,3,4,5,6,7,8,9,11,13,16,24,32,48,64
  --parts a,b,c,d,e,f,g --np-ks none --repeats 8 --warmup 2)
# the Vulkan cells: plain, fixed k = 3 and the formula at X = 0.12 (with --context)
VK_CELLS=(-n 128 --prompt-ids gen-lru,chat-travel --modes plain,oracle -k 6 --repeats 1
  --ceiling-ks 1,2,3,4,6 --oracle-acceptance 0.77 --oracle-delay-steps 0.12
  --proxy-variant 'k3=--plain-runs off -k 3 --fixed-k' --proxy-variant 'spec=--plain-runs off')
# the Strix Halo cells (with --regime, -n and any --turns): the seed's drafter, the
# defaults (no near-tie branches: the emulated target writes its script and never flips)
STRIX=(--context 512 --prompt-ids gen-lru,chat-travel --modes plain,oracle -k 4 --repeats 1
  --ceiling-ks 1,2,3,4 --oracle-acceptance 0.8 --oracle-delay-ms 11 --oracle-branches 0
  --proxy-variant 'defaults=')
VK_DESCRIPTION="NVIDIA H200, Vulkan, llama.cpp b11434, Qwen3-14B-shape f16 target, -fa on"
make_models() {  # the 14B-shape target in /tmp/m14, in the background (/tmp/models.done);
  # DRAFTER=1: also the proxy's drafter folder (the same draft function, fp32 ONNX) and
  # its fp16 copy in /tmp/m14/draft16 for CUDA (ONNX Runtime's CUDA attention takes no fp32)
  local no_drafter=--no-drafter half=true
  if [ "${DRAFTER:-0}" = 1 ]; then
    no_drafter=
    half="python3 -c 'from npu_draft.onnx_writer import float16_copy
float16_copy(\"/tmp/m14/draft\", \"/tmp/m14/draft16\")'"
  fi
  setsid nohup bash -c "python3 -m proxy.cli make-models /tmp/m14 --target-shape qwen3-14b \
    --draft noisy:0.025 --draft-shape qwen3-0.6b --draft-dtype q8_0 $no_drafter \
    && $half && touch /tmp/models.done" > /tmp/models.log 2>&1 < /dev/null &
}
ort_gpu() {  # [SECONDS]: onnxruntime-gpu (CUDA 13 build), whose wheel is over one call's
  # carry, from the parts that calls carry one each into .ortgpu/ (scripts/ort_gpu_parts.sh;
  # the whole archive's sha256 in ORT_SHA or .ortgpu/SHA256, carried by the first call);
  # unpacked to /tmp/ortsite, ahead of the image's CPU build
  local got waited=0 want="${ORT_SHA:-$(cat .ortgpu/SHA256)}"
  until got="$(cat .ortgpu/part-? 2>/dev/null | sha256sum | cut -d' ' -f1)"
        [ "$got" = "$want" ]; do
    sleep 10; waited=$((waited + 10))
    [ "$waited" -lt "${1:-600}" ] || { echo "ORT parts incomplete"; ls -la .ortgpu; return 1; }
  done
  mkdir -p /tmp/ortsite
  cat .ortgpu/part-? | python3 -c "import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/ortsite')"
  export PYTHONPATH="/tmp/ortsite:$PYTHONPATH"
  # the CUDA 13 libraries that the image's PyTorch brought (cuBLAS, cuDNN, cuFFT, ...)
  LD_LIBRARY_PATH="$(python3 -c "import glob, sys
print(':'.join(d for p in sys.path for d in glob.glob(p + '/nvidia/**/lib', recursive=True)))"):/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
  export LD_LIBRARY_PATH
  python3 -c "import onnxruntime as o; print(o.__version__, o.__file__, o.get_available_providers())"
  # a provider that fails to load falls back to the CPU quietly: a one-node session says
  # whether CUDA really takes it, before any cell counts on it
  python3 -c "import onnxruntime as o
from onnx import TensorProto, helper
info = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [4])
graph = helper.make_graph([helper.make_node('Relu', ['x'], ['y'])], 'g', [info('x')], [info('y')])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 17)], ir_version=9)
got = o.InferenceSession(model.SerializeToString(), providers=['CUDAExecutionProvider']).get_providers()
print('session providers', got)
raise SystemExit(0 if 'CUDAExecutionProvider' in got else 1)"
}
batch_cost() {  # NAME OPTIONS...: issue 29 item 3 (after ort_gpu): one table of a draft
  # step for B = 1..16 sequences at 512 and 4096 cached positions (cores 0-7)
  taskset -c 0-7 python3 scripts/drafter_batch_cost.py --batches 1,2,4,8,16 \
    --contexts 512,4096 "${@:2}" -o "$OUT/h200-drafter-batch-cost-$1.json" | tail -12 \
    || echo "batch cost $1 FAILED"
}
drafter_batches() {  # PROVIDERS...: batch_cost of the 0.6B-shape drafter folder in /tmp/m14
  # (fp16 for cuda, fp32 for cpu)
  local folder
  for provider in "$@"; do
    folder=/tmp/m14/draft; [ "$provider" = cuda ] && folder=/tmp/m14/draft16
    batch_cost "$provider" "$folder" --provider "$provider" --repeats 7
  done
}
start_with_vulkan() {  # start, with the Vulkan build (VK_JOBS jobs) beside it; waits for both
  install_sources
  setsid nohup bash -c "VK_JOBS=${VK_JOBS:-8} bash scripts/h200_regime_run.sh vulkan-build \
    && touch /tmp/vk.done" > /tmp/vk.log 2>&1 < /dev/null &
  bash scripts/h200_regime_run.sh start
  wait_for /tmp/vk.done 420 || tail -5 /tmp/vk.log  # no build beside the timed cells
}
random_drafter16() {  # a random-weight 0.6B-shape fp16 drafter in /tmp/rd16 (the writer's
  # graph, as make-models exports it; after install_wheels)
  python3 -c "import json
from pathlib import Path
from npu_draft.batch_step import random_drafter
from npu_draft.factory.shapes import DRAFT_SHAPES
from npu_draft.onnx_runner import DecoderSpec
shape, folder = DRAFT_SHAPES['qwen3-0.6b'], Path('/tmp/rd16')
random_drafter(shape, folder, context=4096, float16=True)
spec = DecoderSpec(shape.layers, shape.kv_heads, shape.head_dim, shape.vocab, 4096)
(folder / 'npu_draft.json').write_text(json.dumps({'decoder': spec.to_json()}))"
}
session_cells() {  # scripts/drafter_sessions.py on /tmp/rd16 (after random_drafter16 and
  # ort_gpu): at 512 in both orders (a slower step in the second way is then the order's);
  # 4000, not 4096: the drafts need room in the 4096-token context
  for cell in 512:pooled,fresh 512:fresh,pooled 4000:pooled,fresh; do
    taskset -c 0-7 python3 scripts/drafter_sessions.py /tmp/rd16 --provider cuda \
      --length "${cell%%:*}" --ways "${cell#*:}" -k 8 --requests 6 --no-cross-check \
      -o "$OUT/h200-drafter-sessions-${cell//[:,]/-}.json" || echo "sessions $cell FAILED"
  done
}
graph_cells() {  # CUDA graph steps off and on, in both orders, pooled sessions at 512 and
  # 4000 on /tmp/rd16 (after random_drafter16 and ort_gpu)
  for cell in 512:off,on 512:on,off 4000:off,on; do
    taskset -c 0-7 python3 scripts/drafter_sessions.py /tmp/rd16 --provider cuda \
      --length "${cell%%:*}" --ways pooled --graphs "${cell#*:}" -k 8 --requests 6 \
      --no-cross-check -o "$OUT/h200-drafter-graphs-${cell//[:,]/-}.json" \
      || echo "graphs $cell FAILED"
  done
}
profile() {  # NAME FOLDER OPTIONS...: scripts/drafter_profile.py (after ort_gpu; cores 0-7)
  taskset -c 0-7 python3 scripts/drafter_profile.py "$2" "${@:3}" \
    -o "$OUT/h200-drafter-profile-$1.json" || echo "profile $1 FAILED"
}
strix_cell() {  # SIZE TREE CORES NAME OPTIONS...: a Strix Halo cell (runner-up hits 0.42)
  # run from the checkout TREE (the code before a change: ab-before/, carried, copied to
  # /tmp first: a later call replaces or removes it in the checkout, under a cell still
  # running there)
  local size="$1" tree="$2" cores="$3" name="$4"; shift 4
  (cd "$tree" && PYTHONPATH="/tmp/site:$PWD" taskset -c "$cores" python3 -m proxy.cli \
    bench --regime "strix-halo-vulkan-$size" "${STRIX[@]}" --oracle-runner-up-hits 0.42 "$@" \
    --work-dir "/tmp/s$size-$name" -o "$OUT/h200-host-strix-$size-$name.json" | tail -14) \
    || echo "strix $size $name FAILED"
}
strix14() { strix_cell 14b "$@"; }  # TREE CORES NAME OPTIONS...
use_vulkan() {  # after vulkan-build: its run-time exports, and $vk, the binary
  # shellcheck disable=SC1091
  . /tmp/vk.sh
  vk="$(cat /tmp/vk.bin)"
}

single8_defaults() {  # CTX [BENCH OPTIONS...]: the real CUDA single turns with the
  # defaults over all 8 prompts, every run checked exactly (cores 0-7)
  taskset -c 0-7 python3 -m proxy.cli bench --target /tmp/m14/target.gguf \
    --server-args='-ngl 99 -fa on' --context "$1" -n 128 \
    --prompt-ids edit-rename,edit-bugfix,gen-lru,gen-cli,sum-incident,sum-paper,chat-travel,chat-explain \
    --modes plain,oracle -k 6 --repeats 1 --ceiling-ks 1,2,3,4,6 --oracle-acceptance 0.77 \
    --oracle-delay-steps 0.12 --proxy-variant 'defaults=' "${@:2}" --exact-check all \
    --work-dir "/tmp/single-$1" -o "$OUT/h200-single8-$1.json" | tail -25 \
    || echo "single $1 FAILED"
}
exact_gen_lru() {  # always speculating, gen-lru at 512, 2 repeats, checked exactly (cores 0-7)
  taskset -c 0-7 python3 -m proxy.cli bench --target /tmp/m14/target.gguf \
    --server-args='-ngl 99 -fa on' --context 512 -n 128 --prompt-ids gen-lru \
    --modes plain,oracle -k 6 --repeats 2 --ceiling-ks 1,2,3,4,6 --oracle-acceptance 0.77 \
    --oracle-delay-steps 0.12 --proxy-variant 'spec=--plain-runs off' --exact-check all \
    --work-dir /tmp/exact -o "$OUT/h200-spec-exact-gen-lru.json" | tail -25 \
    || echo "exact FAILED"
}
spec_cells() {  # NAME PROMPTS REPEATS VARIANTS...: always speculating (each --proxy-variant
  # gets --plain-runs off --log-rounds), the PROMPTS at 512, checked exactly (cores 0-7);
  # each round's line from the proxies' logs to $OUT. BUILTIN=1: llama.cpp's own
  # drafting beside them (the fair builtin: the 0.6B-shape draft on the GPU, k = 6);
  # SUB_BRANCHES=N: the oracle also follows N second flips per branch; N_TOKENS: the
  # answer's length (128)
  local name="$1" prompts="$2" repeats="$3"; shift 3
  local variants=() modes=(--modes plain,oracle) names=""
  for v in "$@"; do
    variants+=(--proxy-variant "${v%%=*}=--plain-runs off --log-rounds ${v#*=}")
    names="${names:+$names,}${v%%=*}"
  done
  [ "${BUILTIN:-0}" = 1 ] && modes=(--modes plain,builtin,oracle --draft-gguf /tmp/m14/draft.gguf
    --builtin-args='-ngld 99')
  # CUDA_DRAFTER=1 (after ort_gpu, with BUILTIN=1): the real drafter in the same run, on
  # CUDA with the defaults and always speculating, and with the defaults on the host CPU
  # (HOST_CPU_DRAFTER=0: not on the host CPU)
  local drafter=(--proxy-variant 'cuda=--drafter /tmp/m14/draft16 --log-rounds'
    --proxy-variant 'cudaspec=--drafter /tmp/m14/draft16 --plain-runs off --log-rounds')
  local drafter_names=cuda,cudaspec
  if [ "${HOST_CPU_DRAFTER:-1}" = 1 ]; then
    drafter+=(--proxy-variant 'cpu=--provider cpu --log-rounds'); drafter_names+=,cpu
  fi
  # CUDA_NO_OVERLAP=1: also always speculating on CUDA with no drafting while the server
  # verifies (on one GPU the two take turns, so overlap may only slow both)
  if [ "${CUDA_NO_OVERLAP:-0}" = 1 ]; then
    drafter+=(--proxy-variant 'cudaseq=--drafter /tmp/m14/draft16 --plain-runs off --overlap off --runner-up-lines off --log-rounds')
    drafter_names+=,cudaseq
  fi
  # (no VARIANTS: no oracle rows)
  local oracle=(--oracle-mode-variants "$names") cuda_modes=plain,builtin,proxy,oracle
  [ -z "$names" ] && oracle=() && cuda_modes=plain,builtin,proxy
  cuda_modes="${CUDA_MODES:-$cuda_modes}"  # e.g. plain,proxy: no llama.cpp drafting
  [ "${CUDA_DRAFTER:-0}" = 1 ] && modes=(--modes "$cuda_modes" --models /tmp/m14
    --builtin-args='-ngld 99' --provider cuda "${drafter[@]}"
    --proxy-mode-variants "$drafter_names" "${oracle[@]}")
  taskset -c 0-7 python3 -m proxy.cli bench --target /tmp/m14/target.gguf \
    --server-args='-ngl 99 -fa on' --context 512 -n "${N_TOKENS:-128}" --prompt-ids "$prompts" \
    "${modes[@]}" -k 6 --repeats "$repeats" --ceiling-ks 1,2,3,4,6 \
    --oracle-sub-branches "${SUB_BRANCHES:-0}" \
    --oracle-acceptance 0.77 --oracle-delay-steps 0.12 "${variants[@]}" --exact-check all \
    --work-dir "/tmp/spec-$name" -o "$OUT/h200-spec-$name.json" | tail -25 \
    || echo "spec $name FAILED"
  for log in "/tmp/spec-$name"/logs/*.proxy.log; do
    grep -h 'rounds.log' "$log" > "$OUT/rounds-$name-$(basename "$log" .proxy.log).log" || true
  done
}
spec_gen_lru() { spec_cells "$1" gen-lru 3 "${@:2}"; }  # NAME VARIANTS...
spec_ab() { spec_cells "$1" gen-lru,chat-travel "${AB_REPEATS:-2}" "${@:2}"; }  # NAME VARIANTS...
ab_summaries() {  # after `spec_ab auto 'auto=' 'off=...'`: what auto chose to pad, each
  # generation's first round and rate, and the cold fill against plain per variant
  python3 scripts/round_log_summary.py --verdict "$OUT"/rounds-auto-*-auto.log || true
  python3 scripts/round_log_summary.py --generations "$OUT"/rounds-auto-*.log || true
  for v in auto off; do
    python3 scripts/round_log_summary.py --fill "$OUT/h200-spec-auto.json" \
      "$OUT"/rounds-auto-*-"$v".log || true
  done
}
spec_chats() {  # VARIANTS...: always speculating, 3-turn chats of gen-lru and chat-travel
  # at 512, rounds logged (cores 0-7)
  local variants=()
  for v in "$@"; do variants+=(--proxy-variant "${v%%=*}=--plain-runs off --log-rounds ${v#*=}"); done
  taskset -c 0-7 python3 -m proxy.cli bench --target /tmp/m14/target.gguf \
    --server-args='-ngl 99 -fa on' --context 512 --turns 3 -n 400 \
    --prompt-ids gen-lru,chat-travel --modes plain,oracle -k 6 --repeats 1 \
    --ceiling-ks 1,2,3,4,6 --oracle-acceptance 0.77 --oracle-delay-steps 0.12 \
    "${variants[@]}" --work-dir /tmp/spec-chats -o "$OUT/h200-spec-chats.json" | tail -25 \
    || echo "spec chats FAILED"
  for log in /tmp/spec-chats/logs/*.proxy.log; do
    grep -h 'rounds.log' "$log" > "$OUT/rounds-chats-$(basename "$log" .proxy.log).log" || true
  done
}
graph_costs() {  # NAME: verify-cost parts a, h, m at 512, k = 3 and 4 (cores 0-7)
  taskset -c 0-7 python3 -m proxy.cli verify-cost --target /tmp/m14/target.gguf \
    --variant 'base=-ngl 99 -fa on' --context 512 -k 3,4 --parts a,h,m --np-large 7 \
    --np-ks none --repeats 8 --warmup 2 --work-dir "/tmp/vc-$1" \
    -o "$OUT/h200-vc-$1.json" | tail -20 || echo "verify-cost $1 FAILED"
}

case "$STAGE" in
  start)
    install_sources
    setsid nohup bash -c "python3 -m proxy.cli install-server --jobs 14 --source $SRC \
      --cmake-args='-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90' && touch /tmp/build.done" \
      > /tmp/build.log 2>&1 < /dev/null &
    make_models
    wait_for /tmp/models.done 540 || tail -5 /tmp/models.log
    wait_for /tmp/build.done 540 || tail -5 /tmp/build.log
    nvidia-smi --query-gpu=name,memory.used --format=csv
    ;;
  costs)  # COSTS_OUT: where the results go (default $OUT; a folder that outlives the call
           # when run in the background after `start`)
    dest="${COSTS_OUT:-$OUT}"
    mkdir -p "$dest"
    npu verify-cost --target /tmp/m14/target.gguf --variant 'base=-ngl 99 -fa on' \
      --context 512,4k "${COSTS_PARTS[@]}" --work-dir /tmp/vc \
      -o "$dest/h200-verify-cost.json" | tail -45
    python3 -m proxy.bench.regime.build "$dest/h200-verify-cost.json" --name h200-cuda-14b-f16 \
      --description "NVIDIA H200, CUDA, llama.cpp b11434, Qwen3-14B-shape f16 target, -fa on" \
      -o "$dest/h200-cuda-14b-f16.toml"
    cp "$dest/h200-cuda-14b-f16.toml" /tmp/h200-cuda-14b-f16.toml
    ;;
  costs-background)  # after `start`: costs in the background, for a later `emulate`
    setsid nohup bash -c "COSTS_OUT=/tmp/costs bash scripts/h200_regime_run.sh costs \
      && touch /tmp/costs.done" > /tmp/costs.log 2>&1 < /dev/null &
    ;;
  bench)
    npu bench --target /tmp/m14/target.gguf --server-args='-ngl 99 -fa on' --context 512,4k \
      -n 128 "${BENCH_COMMON[@]}" --time-budget-s 420 --work-dir /tmp/bench1 \
      -o "$OUT/h200-s10-single.json" | tail -40
    ;;
  chat)
    npu bench --target /tmp/m14/target.gguf --server-args='-ngl 99 -fa on' --context 512 \
      --turns 3 -n 400 "${BENCH_COMMON[@]}" --time-budget-s 420 --work-dir /tmp/bench2 \
      -o "$OUT/h200-s10-chat.json" | tail -40
    ;;
  regime)
    npu bench --regime /tmp/h200-cuda-14b-f16.toml --context 512,4k -n 128 \
      "${BENCH_COMMON[@]}" --time-budget-s 250 --work-dir /tmp/bench3 \
      -o "$OUT/h200-s10-single-emulated.json" | tail -30
    npu bench --regime /tmp/h200-cuda-14b-f16.toml --context 512 --turns 3 -n 400 \
      "${BENCH_COMMON[@]}" --time-budget-s 250 --work-dir /tmp/bench4 \
      -o "$OUT/h200-s10-chat-emulated.json" | tail -30
    ;;
  emulate)  # REGIME: the file (default: the committed one); WAIT_COSTS=1: first wait for
            # costs-background and use its file
    install_sources
    if [ "${WAIT_COSTS:-0}" = 1 ]; then
      wait_for /tmp/costs.done 500 || { tail -20 /tmp/costs.log; exit 1; }
      tail -60 /tmp/costs.log; cp /tmp/costs/* "$OUT/"
      REGIME=/tmp/h200-cuda-14b-f16.toml
    fi
    REGIME="${REGIME:-proxy/bench/regime/regimes/h200-cuda-14b-f16.toml}"
    npu bench --regime "$REGIME" --context 512,4k -n 128 "${BENCH_COMMON[@]}" \
      --time-budget-s 230 --work-dir /tmp/bench3 -o "$OUT/h200-host-single-emulated.json" | tail -30
    [ "${EMULATE_CHAT:-1}" = 1 ] || exit 0
    npu bench --regime "$REGIME" --context 512 --turns 3 -n 400 "${BENCH_COMMON[@]}" \
      --time-budget-s 230 --work-dir /tmp/bench4 -o "$OUT/h200-host-chat-emulated.json" | tail -30
    ;;
  strix)  # the Strix Halo regimes on this host's CPUs, 32B and 14B side by side (no
          # near-tie branches: the emulated target writes its script and never flips, and
          # each branch is a plain 128-token request, 12 s on the 32B)
    install_sources
    for size in 32b 14b; do
      npu bench --regime "strix-halo-vulkan-$size" -n 128 "${STRIX[@]}" \
        --proxy-variant 'k2=--plain-runs off -k 2 --fixed-k' \
        --proxy-variant 'spec=--plain-runs off' --time-budget-s 330 --work-dir "/tmp/strix-$size" \
        -o "$OUT/h200-host-strix-$size-single.json" > "/tmp/strix-$size.log" 2>&1 &
    done
    wait
    for size in 32b 14b; do grep -v "INFO proxy" "/tmp/strix-$size.log" | head -12; done
    ;;
  formula)  # FORMULA_CONTEXT: 4k (default) or 512; FORMULA_K3=1 adds the fixed k = 3 cells;
            # FORMULA_NOREUSE=0 drops the --slot-file-reuse off cells, FORMULA_DEFAULTS=1
            # adds the defaults; FORMULA_REAL_ONLY=1 skips the emulated run,
            # FORMULA_EMULATED_ONLY=1 the real one
    ctx="${FORMULA_CONTEXT:-4k}"
    FORMULA=(--context "$ctx" -n 128 --prompt-ids gen-lru,chat-travel --modes plain,oracle -k 6
      --repeats "${FORMULA_REPEATS:-3}" --ceiling-ks 1,2,3,4,6 --oracle-acceptance 0.77
      --oracle-delay-steps "${FORMULA_X:-0.12,0.27}" --proxy-variant 'spec=--plain-runs off')
    [ "${FORMULA_NOREUSE:-1}" = 1 ] && \
      FORMULA+=(--proxy-variant 'noreuse=--plain-runs off --slot-file-reuse off')
    [ "${FORMULA_K3:-0}" = 1 ] && FORMULA+=(--proxy-variant 'k3=--plain-runs off -k 3 --fixed-k')
    [ "${FORMULA_DEFAULTS:-0}" = 1 ] && FORMULA+=(--proxy-variant 'defaults=')
    [ "${FORMULA_KEEP:-0}" = 1 ] && \
      FORMULA+=(--proxy-variant 'keep=--plain-runs off --clear-stale-copies off')
    [ "${FORMULA_EMULATED_ONLY:-0}" = 1 ] || \
      npu bench --target /tmp/m14/target.gguf --server-args='-ngl 99 -fa on' "${FORMULA[@]}" \
        --work-dir "/tmp/formula1-$ctx" -o "$OUT/h200-formula-$ctx.json" | tail -25
    [ "${FORMULA_REAL_ONLY:-0}" = 1 ] && exit 0
    npu bench --regime "${REGIME:-proxy/bench/regime/regimes/h200-cuda-14b-f16.toml}" \
      "${FORMULA[@]}" --work-dir "/tmp/formula2-$ctx" \
      -o "$OUT/h200-host-formula-$ctx-emulated.json" | tail -25
    ;;
  chain)  # start, costs, then the 4k formula cells and the single cells emulated on the
          # file just built, then the Strix Halo cells: one background run (`background
          # chain`, then `collect chain S` until done)
    bash scripts/h200_regime_run.sh start
    COSTS_OUT="$OUT" bash scripts/h200_regime_run.sh costs
    REGIME=/tmp/h200-cuda-14b-f16.toml bash scripts/h200_regime_run.sh formula \
      || echo "formula FAILED"
    REGIME=/tmp/h200-cuda-14b-f16.toml EMULATE_CHAT=0 bash scripts/h200_regime_run.sh emulate \
      || echo "emulate FAILED"
    bash scripts/h200_regime_run.sh strix || echo "strix FAILED"
    ;;
  s14)  # session 14's chain: start; the 512 cells (formula, k3, defaults) real and
        # emulated; the 4k clear-stale A/B, real only; the Strix Halo cells on this host
    bash scripts/h200_regime_run.sh start
    FORMULA_CONTEXT=512 FORMULA_K3=1 FORMULA_NOREUSE=0 FORMULA_DEFAULTS=1 \
      bash scripts/h200_regime_run.sh formula || echo "formula 512 FAILED"
    FORMULA_CONTEXT=4k FORMULA_NOREUSE=0 FORMULA_KEEP=1 FORMULA_X=0.12 FORMULA_REPEATS=2 \
      FORMULA_REAL_ONLY=1 bash scripts/h200_regime_run.sh formula || echo "formula 4k FAILED"
    bash scripts/h200_regime_run.sh strix || echo "strix FAILED"
    ;;
  s15)  # session 15's chain: start; part i; the 512 cells (formula, k3, defaults) and the
        # 4k ones (formula, defaults), real only; the 3-turn chats at X = 0.12 with the
        # defaults, real then emulated on this host
    bash scripts/h200_regime_run.sh start
    npu verify-cost --target /tmp/m14/target.gguf --variant 'base=-ngl 99 -fa on' \
      --context 512,4k --parts i --repeats 6 --warmup 1 --work-dir /tmp/vci \
      -o "$OUT/h200-verify-cost-i.json" | tail -6 || echo "verify-cost i FAILED"
    python3 -m proxy.bench.regime.build benchmarks/results/h200-s13-verify-cost.json \
      "$OUT/h200-verify-cost-i.json" --name h200-cuda-14b-f16 \
      --description "NVIDIA H200, CUDA, llama.cpp b11434, Qwen3-14B-shape f16 target, -fa on" \
      -o "$OUT/h200-cuda-14b-f16.toml" | tail -3 || echo "build FAILED"
    FORMULA_CONTEXT=512 FORMULA_K3=1 FORMULA_NOREUSE=0 FORMULA_DEFAULTS=1 FORMULA_X=0.12 \
      FORMULA_REAL_ONLY=1 \
      bash scripts/h200_regime_run.sh formula || echo "formula 512 FAILED"
    FORMULA_CONTEXT=4k FORMULA_NOREUSE=0 FORMULA_DEFAULTS=1 FORMULA_X=0.12 FORMULA_REPEATS=2 \
      FORMULA_REAL_ONLY=1 bash scripts/h200_regime_run.sh formula || echo "formula 4k FAILED"
    CHAT=(--context 512 --turns 3 -n 400 "${BENCH_COMMON[@]}" --oracle-delay-steps 0.12
      --proxy-variant 'defaults=' --time-budget-s 400)
    npu bench --target /tmp/m14/target.gguf --server-args='-ngl 99 -fa on' "${CHAT[@]}" \
      --work-dir /tmp/chat1 -o "$OUT/h200-chat.json" | tail -25 || echo "chat FAILED"
    regime="$OUT/h200-cuda-14b-f16.toml"  # rebuilt with part i, else the committed one
    [ -s "$regime" ] || regime=proxy/bench/regime/regimes/h200-cuda-14b-f16.toml
    npu bench --regime "$regime" "${CHAT[@]}" \
      --work-dir /tmp/chat2 -o "$OUT/h200-host-chat-emulated.json" | tail -25 \
      || echo "chat emulated FAILED"
    ;;
  vulkan-build)  # in the background beside `start`; /tmp/vk.sh: the run-time exports
    install_sources
    scripts/vulkan_prefix.sh .cache/vkdebs /tmp/vk > /tmp/vk.env
    head -1 /tmp/vk.env > /tmp/vk.sh
    # shellcheck disable=SC1091
    . /tmp/vk.sh
    eval "python3 -m proxy.cli install-server --jobs ${VK_JOBS:-8} --source $SRC $(tail -1 /tmp/vk.env)" \
      | tail -1 > /tmp/vk.bin
    "$(cat /tmp/vk.bin)" --list-devices
    ;;
  vulkan)
    wait_for /tmp/vk.done 600 || { tail -20 /tmp/vk.log; exit 1; }
    use_vulkan
    npu verify-cost --target /tmp/m14/target.gguf --llama-server "$vk" \
      --variant 'vulkan=-ngl 99 -fa on' --context 512,4k "${COSTS_PARTS[@]}" \
      --work-dir /tmp/vcvk -o "$OUT/h200-vulkan-verify-cost.json" | tail -45
    python3 -m proxy.bench.regime.build "$OUT/h200-vulkan-verify-cost.json" \
      --name h200-vulkan-14b-f16 --description "$VK_DESCRIPTION" \
      -o "$OUT/h200-vulkan-14b-f16.toml" | tail -3
    npu bench --target /tmp/m14/target.gguf --llama-server "$vk" --server-args='-ngl 99 -fa on' \
      --context 512,4k "${VK_CELLS[@]}" --time-budget-s 330 --work-dir /tmp/vkbench1 \
      -o "$OUT/h200-vulkan-cells.json" | tail -25 || echo "vulkan cells FAILED"
    npu bench --regime "$OUT/h200-vulkan-14b-f16.toml" --context 512,4k "${VK_CELLS[@]}" \
      --time-budget-s 330 --work-dir /tmp/vkbench2 \
      -o "$OUT/h200-host-vulkan-cells-emulated.json" | tail -25 || echo "vulkan emulated FAILED"
    ;;
  s16)  # session 16's chain (see the list above)
    start_with_vulkan
    FORMULA_CONTEXT=4k FORMULA_NOREUSE=0 FORMULA_DEFAULTS=1 FORMULA_X=0.12 FORMULA_REPEATS=2 \
      FORMULA_REAL_ONLY=1 bash scripts/h200_regime_run.sh formula || echo "formula 4k FAILED"
    FORMULA_CONTEXT=512 FORMULA_K3=1 FORMULA_NOREUSE=0 FORMULA_DEFAULTS=1 FORMULA_X=0.12 \
      FORMULA_REPEATS=2 FORMULA_REAL_ONLY=1 \
      bash scripts/h200_regime_run.sh formula || echo "formula 512 FAILED"
    bash scripts/h200_regime_run.sh vulkan || echo "vulkan FAILED"
    ;;
  s16b)
    install_sources
    make_models
    VK_JOBS=12 bash scripts/h200_regime_run.sh vulkan-build > /tmp/vk.log 2>&1 && touch /tmp/vk.done
    tail -3 /tmp/vk.log
    wait_for /tmp/models.done 400 || tail -5 /tmp/models.log
    bash scripts/h200_regime_run.sh vulkan-rest
    npu bench --regime "$OUT/h200-vulkan-14b-f16.toml" --context 512 "${VK_CELLS[@]}" \
      --time-budget-s 170 --work-dir /tmp/vkbench2 \
      -o "$OUT/h200-host-vulkan-cells-emulated.json" | tail -25 || echo "vulkan emulated FAILED"
    ;;
  vulkan-rest)  # after vulkan-build and the models: verify-cost at 4k and part i, the
                # regime file from those and the committed 512 half, the cells real
    use_vulkan
    npu verify-cost --target /tmp/m14/target.gguf --llama-server "$vk" \
      --variant 'vulkan=-ngl 99 -fa on' --context 4k "${COSTS_PARTS[@]}" --work-dir /tmp/vcvk \
      -o "$OUT/h200-vulkan-verify-cost-4k.json" | tail -25
    npu verify-cost --target /tmp/m14/target.gguf --llama-server "$vk" \
      --variant 'vulkan=-ngl 99 -fa on' --context 512,4k --parts i --repeats 6 --warmup 1 \
      --work-dir /tmp/vcvki -o "$OUT/h200-vulkan-verify-cost-i.json" | tail -6
    python3 -m proxy.bench.regime.build benchmarks/results/h200-s16-vulkan-verify-cost-512.json \
      "$OUT/h200-vulkan-verify-cost-4k.json" "$OUT/h200-vulkan-verify-cost-i.json" \
      --name h200-vulkan-14b-f16 --description "$VK_DESCRIPTION" \
      -o "$OUT/h200-vulkan-14b-f16.toml" | tail -3
    npu bench --target /tmp/m14/target.gguf --llama-server "$vk" --server-args='-ngl 99 -fa on' \
      --context 512,4k "${VK_CELLS[@]}" --time-budget-s 330 --work-dir /tmp/vkbench1 \
      -o "$OUT/h200-vulkan-cells.json" | tail -25 || echo "vulkan cells FAILED"
    ;;
  s17)  # session 17's chain (see the list above)
    VK_JOBS=6 start_with_vulkan
    FORMULA_CONTEXT=512 FORMULA_NOREUSE=0 FORMULA_DEFAULTS=1 FORMULA_X=0.12 \
      FORMULA_REPEATS=2 FORMULA_REAL_ONLY=1 \
      bash scripts/h200_regime_run.sh formula || echo "formula 512 FAILED"
    FORMULA_CONTEXT=4k FORMULA_NOREUSE=0 FORMULA_DEFAULTS=1 FORMULA_X=0.12 FORMULA_REPEATS=2 \
      FORMULA_REAL_ONLY=1 bash scripts/h200_regime_run.sh formula || echo "formula 4k FAILED"
    bash scripts/h200_regime_run.sh vulkan-rest || echo "vulkan-rest FAILED"
    ;;
  s18)  # session 18's chain (see the list above)
    bash scripts/h200_regime_run.sh start
    (
      taskset -c 8-11 python3 -m proxy.cli bench --regime strix-halo-vulkan-14b "${STRIX[@]}" \
        --turns 3 -n 400 --work-dir /tmp/s14c -o "$OUT/h200-host-strix-14b-chat.json" \
        | tail -12 || echo "strix 14b chat FAILED"
      taskset -c 8-11 python3 -m proxy.cli bench --regime strix-halo-vulkan-14b "${STRIX[@]}" \
        -n 128 --work-dir /tmp/s14s -o "$OUT/h200-host-strix-14b-single.json" \
        | tail -12 || echo "strix 14b single FAILED"
      taskset -c 8-11 python3 -m proxy.cli bench --regime h200-cuda-14b-f16 --context 512 \
        --turns 3 -n 400 "${BENCH_COMMON[@]}" --proxy-variant 'defaults=' --time-budget-s 500 \
        --work-dir /tmp/chat2 -o "$OUT/h200-host-chat-emulated.json" | tail -25 \
        || echo "chat emulated FAILED"
    ) > /tmp/emu-a.log 2>&1 &
    (
      taskset -c 12-15 python3 -m proxy.cli bench --regime h200-vulkan-14b-f16 --context 512,4k \
        "${VK_CELLS[@]}" --work-dir /tmp/vkemu -o "$OUT/h200-host-vulkan-cells-emulated.json" \
        | tail -25 || echo "vulkan emulated FAILED"
      taskset -c 12-15 python3 -m proxy.cli bench --regime strix-halo-vulkan-32b "${STRIX[@]}" \
        -n 128 --work-dir /tmp/s32s -o "$OUT/h200-host-strix-32b-single.json" \
        | tail -12 || echo "strix 32b single FAILED"
      FORMULA_CONTEXT=512 FORMULA_NOREUSE=0 FORMULA_DEFAULTS=1 FORMULA_X=0.12,0.27 \
        FORMULA_REPEATS=2 FORMULA_EMULATED_ONLY=1 taskset -c 12-15 \
        bash scripts/h200_regime_run.sh formula || echo "formula 512 emulated FAILED"
    ) > /tmp/emu-b.log 2>&1 &
    FORMULA_CONTEXT=512 FORMULA_NOREUSE=0 FORMULA_DEFAULTS=1 FORMULA_X=0.12,0.27 \
      FORMULA_REPEATS=2 FORMULA_REAL_ONLY=1 \
      taskset -c 0-7 bash scripts/h200_regime_run.sh formula || echo "formula 512 FAILED"
    taskset -c 0-7 python3 -m proxy.cli bench --target /tmp/m14/target.gguf \
      --server-args='-ngl 99 -fa on' --context 512 --turns 3 -n 400 "${BENCH_COMMON[@]}" \
      --proxy-variant 'defaults=' --time-budget-s 500 --work-dir /tmp/chat1 \
      -o "$OUT/h200-chat.json" | tail -25 || echo "chat FAILED"
    df -h /tmp /dev/shm | tail -2
    for place in /tmp/vcf /dev/shm/vcf; do  # slot files on the disk's page cache or tmpfs
      name="$(basename "$(dirname "$place")")"
      taskset -c 0-7 python3 -m proxy.cli verify-cost --target /tmp/m14/target.gguf \
        --variant 'base=-ngl 99 -fa on' --context 512,4k --parts f --repeats 4 --warmup 1 \
        --work-dir "$place" -o "$OUT/h200-verify-cost-f-$name.json" | tail -4 \
        || echo "verify-cost f $place FAILED"
    done
    FORMULA_CONTEXT=4k FORMULA_NOREUSE=0 FORMULA_DEFAULTS=1 FORMULA_X=0.12 FORMULA_REPEATS=2 \
      FORMULA_REAL_ONLY=1 taskset -c 0-7 bash scripts/h200_regime_run.sh formula \
      || echo "formula 4k FAILED"
    wait
    cat /tmp/emu-a.log /tmp/emu-b.log | grep -v "INFO proxy"
    ;;
  s19)  # session 19's chain (see the list above): the drafts checked beside plain runs
    bash scripts/h200_regime_run.sh start
    CHAT4=(--context 512 --turns 3 -n 400 --prompt-ids gen-lru,chat-travel,gen-cli,chat-explain
      --modes plain,oracle -k 6 --repeats 1 --ceiling-ks 1,2,3,4,6 --oracle-acceptance 0.77
      --oracle-delay-steps 0.12 --proxy-variant 'defaults=')
    (
      taskset -c 8-11 python3 -m proxy.cli bench --regime h200-cuda-14b-f16 "${CHAT4[@]}" \
        --work-dir /tmp/chat2 -o "$OUT/h200-host-chat4-emulated.json" | tail -25 \
        || echo "chat emulated FAILED"
    ) > /tmp/emu-a.log 2>&1 &
    (
      taskset -c 12-15 python3 -m proxy.cli bench --regime strix-halo-vulkan-14b "${STRIX[@]}" \
        --turns 3 -n 400 --work-dir /tmp/s14c -o "$OUT/h200-host-strix-14b-chat.json" \
        | tail -12 || echo "strix 14b chat FAILED"
    ) > /tmp/emu-b.log 2>&1 &
    taskset -c 0-7 python3 -m proxy.cli bench --target /tmp/m14/target.gguf \
      --server-args='-ngl 99 -fa on' "${CHAT4[@]}" --work-dir /tmp/chat1 \
      -o "$OUT/h200-chat4.json" | tail -25 || echo "chat FAILED"
    for ctx in 512 4k; do single8_defaults "$ctx"; done
    exact_gen_lru
    wait
    cat /tmp/emu-a.log /tmp/emu-b.log | grep -v "INFO proxy"
    ;;
  s20)  # session 22's chain (see the list above)
    bash scripts/h200_regime_run.sh start
    LINES=(--oracle-runner-up-hits 0.42 --proxy-variant 'nolines=--runner-up-lines off')
    (
      taskset -c 8-11 python3 -m proxy.cli bench --regime strix-halo-vulkan-14b "${STRIX[@]}" \
        "${LINES[@]}" -n 128 --repeats 2 --work-dir /tmp/s14s \
        -o "$OUT/h200-host-strix-14b-single-lines.json" | tail -14 || echo "strix single FAILED"
    ) > /tmp/emu-a.log 2>&1 &
    (
      taskset -c 12-15 python3 -m proxy.cli bench --regime strix-halo-vulkan-14b "${STRIX[@]}" \
        "${LINES[@]}" --turns 3 -n 400 --work-dir /tmp/s14c \
        -o "$OUT/h200-host-strix-14b-chat-lines.json" | tail -14 || echo "strix chat FAILED"
    ) > /tmp/emu-b.log 2>&1 &
    single8_defaults 4k  # as run on 2026-12-03 this cell had --ceiling-ks none: refused
    exact_gen_lru
    wait
    cat /tmp/emu-a.log /tmp/emu-b.log | grep -v "INFO proxy"
    ;;
  s21)  # session 23's chain (see the list above)
    bash scripts/h200_regime_run.sh start
    (
      strix14 ab-before 8-11 single-before -n 128 --repeats 2
      strix14 ab-before 8-11 chat-before --turns 3 -n 400
    ) > /tmp/emu-a.log 2>&1 &
    (
      strix14 . 12-15 single-after -n 128 --repeats 2
      strix14 . 12-15 chat-after --turns 3 -n 400
    ) > /tmp/emu-b.log 2>&1 &
    single8_defaults 4k
    exact_gen_lru
    wait
    cat /tmp/emu-a.log /tmp/emu-b.log | grep -v "INFO proxy"
    ;;
  s22)  # session 24's chain (see the list above)
    install_sources
    # the code before the change, out of the checkout: a later call that does not carry
    # ab-before/ removes it there (the single turns after the chats found it gone)
    rm -rf /tmp/ab-before && cp -r ab-before /tmp/ab-before
    (
      strix14 /tmp/ab-before 0-3 chat-before --turns 3 -n 400
      strix14 /tmp/ab-before 0-3 single-before -n 128 --repeats 2
    ) > /tmp/emu-a.log 2>&1 &
    (
      strix14 . 4-7 chat-after --turns 3 -n 400
      strix14 . 4-7 single-after -n 128 --repeats 2 --proxy-variant 'noahead=--send-ahead off'
    ) > /tmp/emu-b.log 2>&1 &
    strix_cell 32b . 8-15 chat-after --turns 3 -n 400 > /tmp/emu-c.log 2>&1 &
    wait
    cat /tmp/emu-a.log /tmp/emu-b.log /tmp/emu-c.log | grep -v "INFO proxy"
    ;;
  s23)  # session 25's chain (see the list above)
    bash scripts/h200_regime_run.sh start
    # whether this machine's onnxruntime could run a real drafter on CUDA (issue 29, item 4)
    python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())" \
      || echo "no onnxruntime"
    # beside the GPU cells: the Strix Halo 14B 3-turn chats with this code (cores 8-15)
    strix14 . 8-15 chat-s23 --turns 3 -n 400 > /tmp/emu-a.log 2>&1 &
    graph_costs reuse
    LLAMA_GRAPH_REUSE_DISABLE=1 graph_costs noreuse
    GGML_CUDA_DISABLE_GRAPHS=1 graph_costs nocudagraphs
    spec_gen_lru now 'spec=' 'pad=--pad-rounds on' 'noahead=--send-ahead off' \
      'k3=-k 3 --fixed-k' 'k3pad=-k 3 --fixed-k --pad-rounds on'
    LLAMA_GRAPH_REUSE_DISABLE=1 spec_gen_lru noreuse 'spec=' 'pad=--pad-rounds on'
    spec_chats 'spec=' 'pad=--pad-rounds on'
    python3 scripts/round_log_summary.py "$OUT"/rounds-*.log || true
    single8_defaults 512  # the defaults target, with sending ahead (last: least needed)
    wait
    grep -v "INFO proxy" /tmp/emu-a.log
    ;;
  s26)  # session 26's chain (see the list above): the padding A/B first, as it decides
         # whether --pad-rounds stays
    bash scripts/h200_regime_run.sh start
    strix14 . 8-15 chat-s26 --turns 3 -n 400 > /tmp/emu-a.log 2>&1 &
    spec_gen_lru now 'spec=' 'pad=--pad-rounds on' 'k3=-k 3 --fixed-k' \
      'k3pad=-k 3 --fixed-k --pad-rounds on'
    python3 scripts/round_log_summary.py "$OUT"/rounds-*.log || true
    graph_costs reuse
    LLAMA_GRAPH_REUSE_DISABLE=1 graph_costs noreuse
    spec_chats 'spec=' 'pad=--pad-rounds on'
    single8_defaults 512 --proxy-variant 'defpad=--pad-rounds on'
    wait
    grep -v "INFO proxy" /tmp/emu-a.log
    ;;
  s26q)  # the least of s26 that decides --pad-rounds (see the list above)
    bash scripts/h200_regime_run.sh start
    spec_gen_lru now 'spec=' 'pad=--pad-rounds on'
    python3 scripts/round_log_summary.py "$OUT"/rounds-*.log || true
    graph_costs reuse
    ;;
  s28)  # after s26q on the same warm machine (no build): the rest of s26's padding A/B
    spec_chats 'spec=' 'pad=--pad-rounds on'
    single8_defaults 512 --proxy-variant 'defpad=--pad-rounds on'
    ;;
  s28b)  # --pad-rounds auto (the new default) checked: start; always speculating on
         # gen-lru and chat-travel, auto against off; the 512 single turns, defaults
    bash scripts/h200_regime_run.sh start
    spec_ab auto 'auto=' 'off=--pad-rounds off'
    python3 scripts/round_log_summary.py "$OUT"/rounds-auto-*.log || true
    single8_defaults 512
    ;;
  s29)  # session 29: --pad-rounds auto end to end (see the list above)
    bash scripts/h200_regime_run.sh start
    strix14 . 8-11 chat-s29 --turns 3 -n 400 > /tmp/emu-a.log 2>&1 &
    strix_cell 32b . 12-15 chat-s29 --turns 3 -n 400 > /tmp/emu-b.log 2>&1 &
    BUILTIN=1 spec_ab auto 'auto=' 'off=--pad-rounds off'
    python3 scripts/round_log_summary.py --verdict "$OUT"/rounds-auto-*-auto.log || true
    python3 scripts/round_log_summary.py --generations "$OUT"/rounds-auto-*.log || true
    spec_chats 'auto='
    single8_defaults 512
    wait
    grep -v "INFO proxy" /tmp/emu-a.log /tmp/emu-b.log
    ;;
  s30)  # s29 again with copy-by-cost and the trial fix; the chats by cost only (always
        # copying is s29's chats row), to fit a session that lost device time to failed starts
    bash scripts/h200_regime_run.sh start
    strix14 . 8-15 chat-s30 --turns 3 -n 400 > /tmp/emu-a.log 2>&1 &
    BUILTIN=1 SUB_BRANCHES=2 spec_ab auto 'auto=' 'off=--pad-rounds off'
    ab_summaries
    spec_chats 'cost='
    python3 scripts/round_log_summary.py --generations "$OUT"/rounds-chats-*.log || true
    single8_defaults 512
    wait
    grep -v "INFO proxy" /tmp/emu-a.log
    ;;
  s31)  # s30's A/B, then issue 29 items 3 and 4 on CUDA (onnxruntime-gpu carried in parts
        # by the calls that collect), then the chats by cost; the Strix Halo 14B chats beside
    DRAFTER=1 bash scripts/h200_regime_run.sh start
    strix14 . 8-15 chat-s31 --turns 3 -n 400 > /tmp/emu-a.log 2>&1 &
    cuda=0
    ort_gpu 240 && cuda=1
    CUDA_DRAFTER=$cuda BUILTIN=1 SUB_BRANCHES=2 spec_ab auto 'auto=' 'off=--pad-rounds off'
    ab_summaries
    [ "$cuda" = 1 ] && drafter_batches cuda cpu
    spec_chats 'cost='
    python3 scripts/round_log_summary.py --generations "$OUT"/rounds-chats-*.log || true
    wait
    grep -v "INFO proxy" /tmp/emu-a.log
    ;;
  s31a)  # s31 for ~700 s of device time: the A/B without second flips, the real drafter on
         # CUDA only, the CUDA draft step; no chats, no Strix Halo cell
    DRAFTER=1 bash scripts/h200_regime_run.sh start
    cuda=0
    ort_gpu 200 && cuda=1
    HOST_CPU_DRAFTER=0 CUDA_DRAFTER=$cuda BUILTIN=1 spec_ab auto 'auto=' 'off=--pad-rounds off'
    ab_summaries
    [ "$cuda" = 1 ] && drafter_batches cuda
    ;;
  s32)  # the real drafter's rows after s31's fixes (~1,000 s): the drafter on CUDA from its
        # fp16 copy (defaults, always speculating) and on the host CPU, beside plain,
        # llama.cpp's drafting and the oracle with --pad-rounds auto; the draft step for B
        # sequences on CUDA (fp16) and the host CPU; the Strix Halo 14B chats beside
    DRAFTER=1 bash scripts/h200_regime_run.sh start
    strix14 . 8-15 chat-s32 --turns 3 -n 400 > /tmp/emu-a.log 2>&1 &
    cuda=0
    ort_gpu 240 && cuda=1
    CUDA_DRAFTER=$cuda BUILTIN=1 spec_ab auto 'auto='
    [ "$cuda" = 1 ] && drafter_batches cuda cpu
    wait
    grep -v "INFO proxy" /tmp/emu-a.log
    ;;
  s32a)  # s32 cut to ~800 s: the real drafter on CUDA only (no host-CPU variant, no CPU
         # draft step: s31 measured both), the Strix Halo 14B chats beside; then 512-token
         # answers, always speculating with auto, against plain
    DRAFTER=1 bash scripts/h200_regime_run.sh start
    strix14 . 8-15 chat-s32 --turns 3 -n 400 > /tmp/emu-a.log 2>&1 &
    cuda=0
    ort_gpu 240 && cuda=1
    HOST_CPU_DRAFTER=0 CUDA_DRAFTER=$cuda BUILTIN=1 spec_ab auto 'auto='
    [ "$cuda" = 1 ] && drafter_batches cuda
    # a cold answer of 512 tokens: the fill spread over four times the rounds
    N_TOKENS=512 SUB_BRANCHES=2 spec_cells long gen-lru,chat-travel 1 'auto='
    python3 scripts/round_log_summary.py --fill "$OUT/h200-spec-long.json" \
      "$OUT"/rounds-long-*-auto.log || true
    wait
    grep -v "INFO proxy" /tmp/emu-a.log
    ;;
  s34)  # s32a's first cell again after the drafter's threads were pooled (the real drafter
        # on CUDA with the defaults and always speculating, beside plain, llama.cpp's
        # drafting), then the runner's own per-token draft latency on CUDA
        # (bench_drafter, no profiler) at 512 and 4k (~800 s; the calls of s32a;
        # S34_ORACLE=1: the oracle's rows too; AB_REPEATS=1: ~650 s; CUDA_MODES=plain,proxy
        # and AB_REPEATS=1: ~500 s)
    DRAFTER=1 bash scripts/h200_regime_run.sh start
    ort_gpu 240 || exit 1
    HOST_CPU_DRAFTER=0 CUDA_DRAFTER=1 BUILTIN=1 spec_ab auto ${S34_ORACLE:+'auto='}
    python3 scripts/round_log_summary.py --generations "$OUT"/rounds-auto-*.log || true
    taskset -c 0-7 python3 scripts/bench_drafter.py --drafter /tmp/m14/draft16 --backends onnx \
      --provider cuda --contexts 512,4096 --repeats 2 || echo "bench_drafter FAILED"
    ;;
  s35)  # CUDA graph steps (npu_draft.decode_graph) off and on, in both orders, with the
        # pooled sessions at 512 and 4000 (random fp16 drafter); then s34's A/B, whose CUDA
        # drafter rows now step through graphs (~800 s; the calls of s32a)
    DRAFTER=1 bash scripts/h200_regime_run.sh start
    ort_gpu 240 || exit 1
    random_drafter16
    graph_cells
    HOST_CPU_DRAFTER=0 CUDA_DRAFTER=1 BUILTIN=1 spec_ab auto ${S34_ORACLE:+'auto='}
    python3 scripts/round_log_summary.py --generations "$OUT"/rounds-auto-*.log || true
    grep -h "CUDA graph" /tmp/spec-auto/logs/*.proxy.log | head -5 || true
    ;;
  s36)  # the defaults' loss beside plain runs (0.92x in s34 with graphs): plain and the
        # defaults with the real drafter on CUDA and on 8 host cores (fp32: no GPU beside
        # the server), always speculating on CUDA with and without drafting during the
        # verify, 2 repeats; then a first 4,000-token
        # prompt after the whole-context warm-up (~900 s; the calls of s32a)
    DRAFTER=1 bash scripts/h200_regime_run.sh start
    ort_gpu 240 || exit 1
    CUDA_MODES=plain,proxy HOST_CPU_DRAFTER=1 CUDA_DRAFTER=1 CUDA_NO_OVERLAP=1 BUILTIN=1 \
      AB_REPEATS=${AB_REPEATS:-2} spec_ab auto
    python3 scripts/round_log_summary.py --generations "$OUT"/rounds-auto-*.log || true
    # the plain runs' wall and server ms a token, by what the drafter did beside them
    python3 scripts/round_log_summary.py --runs "$OUT"/rounds-auto-*.log || true
    # the gate's choices and whole requests passed through, per proxy
    grep -H -E "requests: |pass|CUDA graph" /tmp/spec-auto/logs/*.proxy.log \
      > "$OUT/gate-lines.txt" 2>&1 || true
    random_drafter16
    taskset -c 0-7 python3 scripts/drafter_sessions.py /tmp/rd16 --provider cuda --length 4000 \
      --ways pooled -k 8 --requests 4 --no-cross-check -o "$OUT/h200-drafter-warm-4000.json" \
      || echo "warm 4000 FAILED"
    ;;
  bs)  # verify rounds with the server's sampling on the GPU (`-bs`, per request
       # `backend_sampling`) against the CPU's: verify-cost at 512, k = 1, 2, 4, 6, plain
       # steps too (~450 s with the start; .whl and .llama-src only). BS_KS, BS_REPEATS:
       # fewer cells; BS_CHECK=0: no backend_sampling_check.py after it
    bash scripts/h200_regime_run.sh start
    taskset -c 0-7 python3 -m proxy.cli verify-cost --target /tmp/m14/target.gguf \
      --variant 'base=-ngl 99 -fa on' --variant 'bs=-ngl 99 -fa on -bs' --context 512 \
      -k "${BS_KS:-1,2,4,6}" --parts a,h --np-large 7 --np-ks none --repeats "${BS_REPEATS:-8}" \
      --warmup 2 --work-dir /tmp/vc-bs -o "$OUT/h200-vc-bs.json" | tail -30 \
      || echo "verify-cost bs FAILED"
    # the proxy's own requests both ways, alternating, and whether their tokens agree
    [ "${BS_CHECK:-1}" = 1 ] && { taskset -c 0-7 python3 scripts/backend_sampling_check.py \
      --model /tmp/m14/target.gguf -k 4 --rounds 40 --server-arg '-ngl 99 -fa on' \
      -o "$OUT/h200-bs-check.json" || echo "bs check FAILED"; }
    ;;
  graphs)  # s35's graph cells alone, no llama-server (~200 s; the calls of drafterquick)
    install_wheels
    random_drafter16
    ort_gpu 200
    graph_cells
    ;;
  drafterprof)  # the real drafter's time node by node (scripts/drafter_profile.py): the
                # 0.6B-shape drafter beside a small target (no llama-server), on CUDA from
                # its fp16 copy at 512 and 4k, at 512 a token per run, and on 8 host cores
                # (fp32); then bench_drafter's prefill and re-sync on CUDA (~300 s; the
                # calls of s31: .whl, .llama-src and .ortgpu/SHA256 first, then a part each)
    install_sources
    python3 -m proxy.cli make-models /tmp/md --target-shape small --draft-shape qwen3-0.6b \
      --draft noisy:0.025 > /tmp/md.log 2>&1 || { tail -20 /tmp/md.log; exit 1; }
    python3 -c "from npu_draft.onnx_writer import float16_copy
float16_copy('/tmp/md/draft', '/tmp/md/draft16')"
    ort_gpu 420
    profile cuda-512 /tmp/md/draft16 --provider cuda --length 512
    profile cuda-4096 /tmp/md/draft16 --provider cuda --length 4096
    profile cuda-512-chunk1 /tmp/md/draft16 --provider cuda --length 512 --prefill-chunk 1
    profile cpu-512 /tmp/md/draft --provider cpu --length 512
    taskset -c 0-7 python3 scripts/bench_drafter.py --drafter /tmp/md/draft16 --backends onnx \
      --provider cuda --contexts 128,512,4096 || echo "bench_drafter FAILED"
    ;;
  drafterquick)  # drafterprof's first answer in ~200 s: a random-weight 0.6B-shape fp16
                 # drafter (the writer's graph, as make-models exports it) profiled on CUDA
                 # at 512, in runs of 512 and of one token (the first call carries .whl and
                 # .ortgpu/SHA256, the next six a part each)
    install_wheels
    random_drafter16
    ort_gpu 200
    # random weights flip near-ties between CUDA and the CPU: no start-up comparison
    for chunk in 512 1; do
      profile "cuda-512-chunk$chunk" /tmp/rd16 --provider cuda --length 512 \
        --prefill-chunk "$chunk" --no-cross-check
    done
    ;;
  sessions)  # the thread fix in ~200 s, no llama-server: scripts/drafter_sessions.py on
             # CUDA, each request's prompt intake and draft step through pooled worker
             # threads (the product) against a new thread per session (before), a random
             # fp16 0.6B-shape drafter at 512 and 4k (the calls of drafterquick; ~110 s)
    install_wheels
    random_drafter16
    ort_gpu 200
    session_cells
    ;;
  ortcheck)  # onnxruntime-gpu from the .ortgpu parts (.ortgpu/SHA256; the first call carries
             # .whl-gguf, gguf's wheel alone, to leave room for a part), then issue 29 item
             # 3's draft step for B sequences on CUDA (the random-weight real Qwen3-0.6B
             # shape, fp32 and fp16) and on 8 host cores; no llama-server, no models
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl-gguf/*.whl
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    ort_gpu 420
    for dtype in f32 f16; do batch_cost "cuda-$dtype" --provider cuda --dtype "$dtype" --repeats 7; done
    batch_cost host-cpu-f32 --provider cpu --threads 8 --repeats 5
    ;;
  s30a)  # s30's A/B alone, then its chats: for a session left with ~900 s of device time
    bash scripts/h200_regime_run.sh start
    BUILTIN=1 SUB_BRANCHES=2 spec_ab auto 'auto=' 'off=--pad-rounds off'
    ab_summaries
    spec_chats 'cost='
    python3 scripts/round_log_summary.py --generations "$OUT"/rounds-chats-*.log || true
    ;;
  s30b)  # s30's A/B alone, without llama.cpp's drafting or second flips (~360 s)
    bash scripts/h200_regime_run.sh start
    spec_ab auto 'auto=' 'off=--pad-rounds off'
    ab_summaries
    ;;
  s30c)  # the cold fill alone: one always-speculating run of two prompts, its rounds'
         # copies and the rate after them (--generations; ~300 s with the start)
    bash scripts/h200_regime_run.sh start
    spec_cells fill gen-lru,chat-travel 1 'auto='
    python3 scripts/round_log_summary.py --generations "$OUT"/rounds-fill-*.log || true
    python3 scripts/round_log_summary.py --fill "$OUT/h200-spec-fill.json" "$OUT"/rounds-fill-*.log || true
    ;;
  strix14)  # TREE CORES NAME OPTIONS...: one Strix Halo 14B cell (install_sources first)
    install_sources
    strix14 "${@:2}"
    ;;
  concurrency)  # issue 30's H200 run (scripts/h200_concurrency_run.sh), here to run it in
                # the background
    bash scripts/h200_concurrency_run.sh bench
    ;;
  background)  # STAGE: outlives the call; `collect STAGE` fetches its results
    mkdir -p "/tmp/bg-$2"
    setsid nohup bash -c "OUT=/tmp/bg-$2 bash scripts/h200_regime_run.sh $2 && touch /tmp/bg-$2.done" \
      > "/tmp/bg-$2.log" 2>&1 < /dev/null &
    ;;
  collect)  # STAGE SECONDS: what is there by then comes back, finished or not
    done=0; wait_for "/tmp/bg-$2.done" "$3" && done=1
    grep -v "INFO proxy" "/tmp/bg-$2.log" | tail -60 || true  # nothing but INFO lines yet
    # one archive: a stage may write more files than a call brings back (8)
    tar czf "$OUT/bg-$2.tgz" -C "/tmp/bg-$2" .
    grep -v "INFO proxy" "/tmp/bg-$2.log" > "$OUT/bg-$2.log" || true
    [ "$done" = 1 ] || { echo "STAGE $2 STILL RUNNING"; exit 1; }
    ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
