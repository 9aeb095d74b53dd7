#!/usr/bin/env bash
# compose.yaml end to end on this machine: build the images, run the stack without the GPU
# and the NPU (tests/deploy/compose.smoke.yaml), and check it over its published ports:
# a greedy chat through the proxy equals llama-server alone, X-Npu-Spec, the API key of
# the env file, a restart of llama-server, and that `compose down` leaves nothing behind.
#
#   scripts/compose_smoke.sh        # needs the dev venv: scripts/setup_env.sh dev
#
# Docker where a daemon answers, podman otherwise (installed from Debian when missing,
# with podman-compose from PyPI). Podman keeps all its state in the smoke's own folder,
# so nothing of the machine's own containers or images is touched. Images no registry
# can give are made here: a Debian bookworm root filesystem (debootstrap) tagged as the
# Dockerfile's FROM names, and llama-server from the pinned llama.cpp source
# (tests/deploy/llama-server.Containerfile). Everything is removed at the end, pass or fail.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${NPU_SPEC_PYTHON:-$REPO/.venv/bin/python}
PODMAN_COMPOSE_VERSION=1.6.0
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
HEALTH_TIMEOUT_S=${HEALTH_TIMEOUT_S:-600}
STARTED=$(date +%s)

say() { printf 'compose-smoke: %s\n' "$*"; }
die() { say "FAIL: $*" >&2; exit 1; }
elapsed() { echo "$(( $(date +%s) - STARTED )) s"; }

[ -x "$PY" ] && "$PY" -c "import proxy, npu_draft" 2>/dev/null \
  || die "no dev venv at $PY: run scripts/setup_env.sh dev first"
cd "$REPO"

# --- engine ------------------------------------------------------------------------------
WORK=$(mktemp -d /var/tmp/npu-spec-smoke.XXXXXX)
PROJECT=npusmoke$$
ENGINE=""
ENV_FILE=""
CNI_RULES=""
MADE_IMAGES=()  # docker only: images this run added (podman's whole store is WORK's)
cni_rules() { iptables -t nat -S 2>/dev/null | grep -c -- CNI- || true; }

if command -v docker >/dev/null && docker info >/dev/null 2>&1 \
    && docker compose version >/dev/null 2>&1; then
  ENGINE=docker
  COMPOSE=(docker compose)
  say "engine: docker ($(docker version --format '{{.Server.Version}}')) with docker compose"
else
  ENGINE=podman
  if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
      || die "no docker daemon and no podman: install podman runc containernetworking-plugins uidmap debootstrap"
    say "no docker daemon: installing podman from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      podman runc containernetworking-plugins uidmap debootstrap >/dev/null
  fi
  # All of podman's state (images, containers, networks, events) lives under WORK.
  mkdir -p "$WORK/podman/cni"
  cat >"$WORK/podman/storage.conf" <<EOF
[storage]
driver = "vfs"
graphroot = "$WORK/podman/storage"
runroot = "$WORK/podman/run"
EOF
  # vfs, cgroupfs, a file for events and runc: what works without systemd or overlayfs.
  limits=""
  NOFILE=$(ulimit -Hn)
  if [ "$NOFILE" != unlimited ] && [ "$NOFILE" -lt 1048576 ] \
      && ! (ulimit -Hn 1048576) 2>/dev/null; then
    # podman asks for nofile=1048576 by default and runc fails to set it
    limits="default_ulimits = [\"nofile=$NOFILE:$NOFILE\", \"nproc=32768:32768\"]"
    say "open-files hard limit is $NOFILE and cannot be raised here (no CAP_SYS_RESOURCE): containers get nofile=$NOFILE, nproc=32768"
  fi
  cat >"$WORK/podman/containers.conf" <<EOF
[containers]
$limits
[network]
network_config_dir = "$WORK/podman/cni"
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$WORK/podman/events.log"
runtime = "runc"
tmp_dir = "$WORK/podman/libpod"
EOF
  export CONTAINERS_STORAGE_CONF=$WORK/podman/storage.conf
  command -v iptables >/dev/null && CNI_RULES=$(cni_rules)  # port forwarding lives there
  export CONTAINERS_CONF=$WORK/podman/containers.conf
  # PyPI's podman-compose: Debian's 1.0.3 predates the `!reset` tags of the override file.
  python3 -m venv "$WORK/compose-venv"
  "$WORK/compose-venv/bin/pip" install -q "podman-compose==$PODMAN_COMPOSE_VERSION" 2>&1 \
    | grep -v '^WARNING' || true
  COMPOSE=("$WORK/compose-venv/bin/podman-compose")
  say "engine: podman $(podman version --format '{{.Client.Version}}') with podman-compose $PODMAN_COMPOSE_VERSION (PyPI)"
fi

FILES=(-f compose.yaml -f tests/deploy/compose.smoke.yaml)
compose() { "${COMPOSE[@]}" -p "$PROJECT" --env-file "$ENV_FILE" "${FILES[@]}" --profile ab "$@"; }
containers() { "$ENGINE" ps -aq --filter "label=com.docker.compose.project=$PROJECT" "$@"; }
container_of() { containers --filter "label=com.docker.compose.service=$1" | head -n1; }

cleanup() {
  local rc=$? left
  set +e
  trap - EXIT INT TERM
  if [ -n "$ENGINE" ] && [ -f "$ENV_FILE" ]; then
    if [ "$rc" != 0 ]; then
      for c in $(containers); do
        "$ENGINE" logs --tail 30 "$c" 2>&1 | sed "s/^/  [$("$ENGINE" inspect -f '{{.Name}}' "$c")] /" >&2
      done
    fi
    compose down -v >"$WORK/down.log" 2>&1 || cat "$WORK/down.log" >&2
  fi
  [ "$ENGINE" = podman ] && MADE_IMAGES=($(podman images -q 2>/dev/null | sort -u))
  [ -n "$ENGINE" ] && [ ${#MADE_IMAGES[@]} -gt 0 ] \
    && "$ENGINE" rmi -f "${MADE_IMAGES[@]}" >/dev/null 2>&1
  left=0
  if [ "$ENGINE" = podman ]; then  # the store is the smoke's own: anything in it is left over
    left=$( { podman ps -aq; podman volume ls -q; podman images -q
              podman network ls --format '{{.Name}}' | grep -vx podman; } 2>/dev/null | wc -l)
    if [ -n "$CNI_RULES" ] && [ "$(cni_rules)" != "$CNI_RULES" ]; then
      say "FAIL: the host's CNI firewall rules changed ($CNI_RULES before, $(cni_rules) now)" >&2
      left=$(( left + 1 ))
    fi
  elif [ "$ENGINE" = docker ]; then
    left=$( { containers; for i in "${MADE_IMAGES[@]}"; do docker image inspect -f x "$i"; done
              docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT"
              docker network ls -q --filter "label=com.docker.compose.project=$PROJECT"
            } 2>/dev/null | wc -l)
  fi
  rm -rf "$WORK"
  if [ "$left" != 0 ]; then
    say "FAIL: $left containers, volumes, networks or images left after compose down" >&2
    rc=1
  else
    say "clean: no container, volume, network or image of the smoke is left"
  fi
  if [ "$rc" = 0 ]; then say "PASS in $(elapsed)"; else say "FAILED after $(elapsed)" >&2; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

have_image() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }
qualified() {  # python:3.12 -> docker.io/library/python:3.12, as docker names it; podman
  local first=${1%%/*}  # would tag a short name as localhost/python:3.12
  case $1 in
    */*) case $first in *.*|*:*|localhost) echo "$1" ;; *) echo "docker.io/$1" ;; esac ;;
    *) echo "docker.io/library/$1" ;;
  esac
}
pull() {  # the registry's image where one answers; else the caller makes a stand-in
  have_image "$1" && return 0
  if timeout 600 "$ENGINE" pull -q "$1" >/dev/null 2>&1; then
    MADE_IMAGES+=("$1"); say "pulled $1"; return 0
  fi
  return 1
}

# --- images ------------------------------------------------------------------------------
ROOTFS_IMAGE=localhost/npu-spec-smoke/bookworm:latest
rootfs_image() {  # Debian bookworm with Python 3.11 and venv, as one image
  have_image "$ROOTFS_IMAGE" && return 0
  command -v debootstrap >/dev/null \
    || die "no registry answers and there is no debootstrap to make stand-ins: apt-get install debootstrap"
  say "making a Debian bookworm image with debootstrap (no registry answers)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$WORK/rootfs" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -5 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
  rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
  tar -C "$WORK/rootfs" -c . | "$ENGINE" import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'CMD ["/bin/bash"]' - "$ROOTFS_IMAGE" >"$WORK/import.log" 2>&1 \
    || { tail -5 "$WORK/import.log" >&2; die "importing the root filesystem failed"; }
  rm -rf "$WORK/rootfs"
  MADE_IMAGES+=("$ROOTFS_IMAGE")
}

# The Dockerfile's FROM images (a stage name is no image): stand-ins keep their names, so
# the real Dockerfile builds unchanged.
for base in $(awk 'toupper($1) == "FROM" && $2 !~ /\$/ {print $2}' Dockerfile); do
  pull "$base" && continue
  rootfs_image
  "$ENGINE" tag "$ROOTFS_IMAGE" "$(qualified "$base")"
  MADE_IMAGES+=("$(qualified "$base")")
  say "stand-in $base: Debian bookworm, Python $("$ENGINE" run --rm "$ROOTFS_IMAGE" python3 -c 'import platform; print(platform.python_version())')"
done

LLAMA_IMAGE=$("$PY" -c "from tests.deploy.stack import read_env_file; print(read_env_file()['LLAMA_IMAGE'])")
if ! pull "$LLAMA_IMAGE"; then
  rootfs_image
  LLAMA_IMAGE=localhost/npu-spec-smoke/llama-server:cpu
  source_dir=$("$PY" -c "from proxy.server.server_install import fetch_source; print(fetch_source())")
  cmake_args=$("$PY" -c "from proxy.server.server_install import BASE_CMAKE_ARGS; print(' '.join(BASE_CMAKE_ARGS))")
  say "building stand-in $LLAMA_IMAGE from $source_dir (CPU backend; takes minutes)"
  t0=$(date +%s)
  "$ENGINE" build -q -f tests/deploy/llama-server.Containerfile \
    --build-arg BASE="$ROOTFS_IMAGE" --build-arg CMAKE_ARGS="$cmake_args" \
    -t "$LLAMA_IMAGE" "$source_dir" >"$WORK/llama-build.log" 2>&1 \
    || { tail -20 "$WORK/llama-build.log" >&2; die "the llama-server stand-in did not build"; }
  MADE_IMAGES+=("$LLAMA_IMAGE")
  say "llama-server stand-in built in $(( $(date +%s) - t0 )) s: $("$ENGINE" run --rm "$LLAMA_IMAGE" --version 2>&1 | grep -m1 version)"
fi

# The host's CA bundle reaches pip as a build secret (a TLS-inspecting proxy needs it);
# it is mounted for one RUN and is checked below to be in no layer of the image.
CA_BUNDLE=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
build_proxy() {  # ORT_BUILD, then extra build arguments
  local ort=$1; shift
  local args=(build --build-arg "ORT_BUILD=$ort" -t "npu-spec:$ort" "$@")
  [ -s "$CA_BUNDLE" ] && args+=(--secret "id=ca-certificates,src=$CA_BUNDLE")
  [ "$ENGINE" = podman ] && args+=(--format docker)  # OCI images drop HEALTHCHECK
  "$ENGINE" "${args[@]}" .
}

say "VitisAI variant: building without AMD's packages must stop at them"
if build_proxy vitisai >"$WORK/vitisai.log" 2>&1; then
  die "ORT_BUILD=vitisai built without AMD's packages"
fi
have_image npu-spec:vitisai && die "ORT_BUILD=vitisai left an image behind a failed build"
# the message ends its line (BuildKit puts a step prefix before it; the echoed RUN
# command has more after it)
MESSAGE="ORT_BUILD=vitisai: put AMD's XRT *.deb files in npu-packages/"
awk -v m="$MESSAGE" 'length($0) >= length(m) && substr($0, length($0) - length(m) + 1) == m \
    {found = 1} END {exit !found}' "$WORK/vitisai.log" \
  || { tail -5 "$WORK/vitisai.log" >&2; die "ORT_BUILD=vitisai failed without its one-line message"; }
say "VitisAI variant stops with: $MESSAGE"

say "building npu-spec:cpu from the Dockerfile"
t0=$(date +%s)
build_proxy cpu >"$WORK/proxy-build.log" 2>&1 \
  || { tail -20 "$WORK/proxy-build.log" >&2; die "the proxy image did not build"; }
MADE_IMAGES+=(npu-spec:cpu)
say "npu-spec:cpu built in $(( $(date +%s) - t0 )) s"

# The host's own CA certificates (those not from Debian's ca-certificates) must be in no
# file of the image: the secret was used, not baked in.
if [ "$ENGINE" = podman ] && compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  mnt=$(podman image mount npu-spec:cpu)
  for crt in /usr/local/share/ca-certificates/*.crt; do
    line=$(sed -n '2p' "$crt")  # the first base64 line identifies the certificate
    if grep -rqsF -- "$line" "$mnt"; then
      podman image unmount npu-spec:cpu >/dev/null; die "$crt is baked into npu-spec:cpu"
    fi
  done
  podman image unmount npu-spec:cpu >/dev/null
  say "host CA certificates: used by the build, in no file of npu-spec:cpu"
fi

# --- the stack ---------------------------------------------------------------------------
say "making the demo models (npu-spec make-models)"
"$PY" -m proxy.cli make-models "$WORK/models" >"$WORK/models.log" 2>&1 \
  || { tail -5 "$WORK/models.log" >&2; die "npu-spec make-models failed"; }

API_KEY=$("$PY" -c "import secrets; print(secrets.token_urlsafe(18))")
read -r PROXY_PORT LLAMA_PORT AB_PORT < <("$PY" -c "
from proxy.server.llama_server import free_port
print(*sorted({free_port() for _ in range(8)})[:3])")
{
  cat .env.example
  echo "# compose_smoke.sh: the demo models, no NPU, free ports, a key"
  echo "MODELS_DIR=$WORK/models"
  echo "TARGET_MODEL=target.gguf"
  echo "DRAFTER_DIR=$WORK/models/draft"
  echo "NPU_GID=0"  # compose.yaml demands it; the override drops group_add
  echo "LLAMA_IMAGE=$LLAMA_IMAGE"
  echo "NPU_SPEC_API_KEY=$API_KEY"
  echo "PROXY_PORT=$PROXY_PORT"
  echo "LLAMA_PORT=$LLAMA_PORT"
  echo "AB_PORT=$AB_PORT"
} >"$WORK/smoke.env"
ENV_FILE=$WORK/smoke.env

# Host limits compose.yaml asks for but a root without CAP_SYS_RESOURCE cannot give, and
# what podman 4.3 lacks: a third compose file, written here, with only what this host needs.
if [ "$ENGINE" = podman ]; then
  proxy_lines="" server_lines=""
  memlock=$(ulimit -Hl)
  if [ "$memlock" != unlimited ] && ! (ulimit -Hl unlimited) 2>/dev/null; then
    # XRT's pinned buffers need memlock; no NPU here, so the host's own limit will do.
    # A service's own ulimits replace podman's defaults: repeat nofile and nproc.
    bytes=$(( memlock * 1024 ))
    ulimits="memlock: {soft: $bytes, hard: $bytes}"
    [ -n "$limits" ] && ulimits+=", nofile: {soft: $NOFILE, hard: $NOFILE}, nproc: {soft: 32768, hard: 32768}"
    proxy_lines+="    ulimits: {$ulimits}"$'\n'
    say "memlock hard limit is ${memlock} KiB and cannot be raised here: npu-spec gets that"
  fi
  if ! podman create --help | grep -q -- --health-startup-interval; then
    # podman < 4.6 has no start interval; the health checks keep their own interval
    proxy_lines+="    healthcheck: {start_interval: !reset null}"$'\n'
    server_lines+="    healthcheck: {start_interval: !reset null}"$'\n'
  fi
  {
    echo "services:"
    [ -n "$proxy_lines" ] && printf '  npu-spec:\n%s' "$proxy_lines"
    if [ -n "$server_lines" ]; then
      printf '  llama-server:\n%s  llama-server-plain:\n%s' "$server_lines" "$server_lines"
    fi
    [ -n "$proxy_lines$server_lines" ] || echo "  npu-spec: {}"
  } >"$WORK/host.yaml"
  FILES+=(-f "$WORK/host.yaml")
fi

# podman runs health checks from systemd timers; without systemd the smoke runs the
# container's own check itself, and only a check run now counts (a restart keeps the old
# status until the next one)
if [ "$ENGINE" = podman ] && [ ! -d /run/systemd/system ]; then
  say "no systemd: the smoke runs each container's own health check (podman healthcheck run)"
  healthy() { podman healthcheck run "$1" >/dev/null 2>&1; }
else
  healthy() { [ "$("$ENGINE" inspect -f '{{.State.Health.Status}}' "$1")" = healthy ]; }
fi
wait_healthy() {  # service...
  local deadline=$(( $(date +%s) + HEALTH_TIMEOUT_S )) s c
  for s in "$@"; do
    c=$(container_of "$s")
    [ -n "$c" ] || die "no container for service $s"
    until healthy "$c"; do
      [ "$(date +%s)" -lt "$deadline" ] || die "$s not healthy after ${HEALTH_TIMEOUT_S} s"
      [ "$("$ENGINE" inspect -f '{{.State.Running}}' "$c")" = true ] || die "$s is not running"
      sleep 3
    done
    say "$s: healthy ($(elapsed))"
  done
}

# llama-server first: podman-compose ignores `condition: service_healthy` before podman
# 4.6, so the smoke keeps compose.yaml's start order itself.
say "compose up: llama-server and the plain A/B server"
compose up -d --no-build llama-server llama-server-plain >"$WORK/up.log" 2>&1 \
  || { tail -20 "$WORK/up.log" >&2; die "compose up failed"; }
wait_healthy llama-server llama-server-plain
say "compose up: npu-spec"
compose up -d --no-build npu-spec >>"$WORK/up.log" 2>&1 \
  || { tail -20 "$WORK/up.log" >&2; die "compose up failed"; }
wait_healthy npu-spec

PROXY=http://127.0.0.1:$PROXY_PORT
LLAMA=http://127.0.0.1:$LLAMA_PORT
AB=http://127.0.0.1:$AB_PORT
HOST_IP=$(hostname -I 2>/dev/null | awk '{print $1}')
check() { "$PY" -m tests.deploy.smoke_checks "$@" || die "check $1 failed"; }

check greedy --proxy "$PROXY" --reference "$AB" --key "$API_KEY" | sed 's/^/  /'
check auth --proxy "$PROXY" --server "$LLAMA" --key "$API_KEY" ${HOST_IP:+--host-ip "$HOST_IP"} \
  | sed 's/^/  /'

say "restarting the llama-server container"
compose restart llama-server >>"$WORK/up.log" 2>&1 || die "compose restart llama-server failed"
wait_healthy llama-server npu-spec
check greedy --proxy "$PROXY" --reference "$AB" --key "$API_KEY" | sed 's/^/  after restart: /'

say "compose down"
