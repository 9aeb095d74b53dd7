# The npu-spec proxy as a container: `npu-spec serve` in attached mode, in front of a
# llama-server it does not start (compose.yaml runs both). Runtime dependencies only:
# no dev or export extras, no PyTorch.
#
#   docker build -t npu-spec:cpu .                                   # onnxruntime from PyPI
#   docker build -t npu-spec:vitisai --build-arg ORT_BUILD=vitisai .  # AMD Ryzen AI NPU
#
# ORT_BUILD=vitisai builds on Ubuntu 24.04, the system AMD's Linux packages target, and
# installs what you put in ./npu-packages/ (AMD's downloads, not on PyPI): the *.deb
# files of the Ryzen AI NPU driver bundle (XRT and its amdxdna plugin) and the *.whl
# files of the Ryzen AI Software archive (onnxruntime-vitisai and what comes with it).
# docs/STRIX_HALO.md says where to get them.
#
# Behind a TLS-inspecting proxy, give pip the host's CA bundle as a build secret: it is
# mounted for the one RUN that downloads and never becomes part of a layer.
#
#   docker build --secret id=ca-certificates,src=/etc/ssl/certs/ca-certificates.crt -t npu-spec:cpu .
ARG ORT_BUILD=cpu

FROM python:3.12-slim-bookworm AS base-cpu

FROM ubuntu:24.04 AS base-vitisai
ENV XILINX_XRT=/opt/xilinx/xrt \
    LD_LIBRARY_PATH=/opt/xilinx/xrt/lib
# The whole context is mounted, not npu-packages/ alone: without that folder a bind mount
# of it fails with a builder error instead of the message below.
RUN --mount=type=bind,source=.,target=/src \
    set -eu; \
    ls /src/npu-packages/*.deb >/dev/null 2>&1 \
      || { echo "ORT_BUILD=vitisai: put AMD's XRT *.deb files in npu-packages/" >&2; exit 1; }; \
    apt-get update; \
    apt-get install -y --no-install-recommends python3 python3-venv /src/npu-packages/*.deb; \
    rm -rf /var/lib/apt/lists/*

# The package's wheel, built from a copy of its sources in a stage of its own: pip writes
# build/ and *.egg-info next to the sources, and podman's builder writes a read-write
# bind mount of the context through to the checkout. No source layer reaches the image.
FROM base-${ORT_BUILD} AS wheel
COPY pyproject.toml README.md /src/
COPY proxy/ /src/proxy/
COPY npu_draft/ /src/npu_draft/
RUN --mount=type=secret,id=ca-certificates,target=/run/secrets/ca-certificates \
    set -eu; \
    if [ -s /run/secrets/ca-certificates ]; then export PIP_CERT=/run/secrets/ca-certificates; fi; \
    python3 -m venv /tmp/venv; \
    /tmp/venv/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels /src

# Stage names pick the base: only the one asked for is built.
FROM base-${ORT_BUILD}
ARG ORT_BUILD
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/npu-spec \
    PATH=/opt/npu-spec/bin:$PATH

# The wheel and the context (AMD's packages) are bind-mounted, read-only, not copied:
# nothing of them stays in a layer. .dockerignore keeps models and the venv out.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    --mount=type=bind,source=.,target=/src \
    --mount=type=secret,id=ca-certificates,target=/run/secrets/ca-certificates \
    set -eu; \
    if [ -s /run/secrets/ca-certificates ]; then export PIP_CERT=/run/secrets/ca-certificates; fi; \
    python3 -m venv "$VIRTUAL_ENV"; \
    pip install /wheels/npu_spec-*.whl; \
    if [ "$ORT_BUILD" = vitisai ]; then \
      ls /src/npu-packages/*.whl >/dev/null 2>&1 \
        || { echo "ORT_BUILD=vitisai: put the Ryzen AI *.whl files in npu-packages/" >&2; exit 1; }; \
      pip uninstall -y onnxruntime; \
      pip install /src/npu-packages/*.whl; \
      python -c "import onnxruntime as o, sys; sys.exit('VitisAIExecutionProvider' not in o.get_available_providers())" \
        || { echo "ORT_BUILD=vitisai: the installed onnxruntime has no VitisAI provider" >&2; exit 1; }; \
    fi; \
    npu-spec serve --help >/dev/null

# Not root: the NPU is reached through the device node's group (compose.yaml group_add).
# The cache folder exists in the image so that a volume mounted there is the user's.
RUN useradd --create-home --uid 10001 --user-group npu-spec \
    && install -d -o npu-spec -g npu-spec /home/npu-spec/.cache
USER npu-spec
WORKDIR /home/npu-spec

# Inside a container the proxy must listen on every interface (its default is
# 127.0.0.1); the published port decides who reaches it.
ENV NPU_SPEC_HOST=0.0.0.0 \
    NPU_SPEC_PORT=8080
EXPOSE 8080

# /health is passed through to llama-server: healthy means the proxy and its server are up.
HEALTHCHECK --interval=15s --timeout=10s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('NPU_SPEC_PORT', '8080'), timeout=5)"]

ENTRYPOINT ["npu-spec"]
CMD ["serve"]
