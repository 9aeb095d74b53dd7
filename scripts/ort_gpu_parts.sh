#!/usr/bin/env bash
# onnxruntime-gpu for the device machine, in parts that fit one call's carry each (issue 29,
# items 3 and 4). Its wheel (~243 MiB for 1.31.1, CUDA 13 like the image's PyTorch) is over
# the 64 MiB a call carries with the working tree (~30 MiB), but ignored paths stay on a
# warm machine between calls: each call carries one part, and the stages' `ort_gpu` waits
# until all of them are there (by .ortgpu/SHA256) before unpacking.
#
#   bash scripts/ort_gpu_parts.sh [VERSION] [PARTS]
#
# Writes .ortgpu/part-0..PARTS-1, .ortgpu/SHA256, and .whl-gguf (gguf's wheel alone, for
# the `ortcheck` stage, whose first call carries it beside a part instead of all of .whl).
set -euo pipefail
VERSION="${1:-1.31.1}"
PARTS="${2:-6}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
download() {  # the device machine's Python (3.12, x86-64 manylinux)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$@"
}
download "$work" "onnxruntime-gpu==$VERSION"
mkdir "$work/site"
python3 -m zipfile -e "$work"/onnxruntime_gpu-*.whl "$work/site"
# nothing there loads TensorRT's provider; leaving it out saves a part's worth of room
rm -f "$work/site/onnxruntime/capi/libonnxruntime_providers_tensorrt.so"
tar cf - -C "$work/site" . | xz -T0 -9 -c > "$work/ort.tar.xz"
mkdir -p .ortgpu .whl-gguf
rm -f .ortgpu/part-*
split -n "$PARTS" -d -a 1 "$work/ort.tar.xz" .ortgpu/part-
sha256sum < "$work/ort.tar.xz" | cut -d' ' -f1 > .ortgpu/SHA256
download .whl-gguf gguf==0.19.0
ls -la .ortgpu .whl-gguf
