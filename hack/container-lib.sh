#!/usr/bin/env bash
# Sourced by the image scripts: picks the container runtime and sets CTR (the command as an array)
# and CTR_NAME (docker | podman). Docker when its daemon answers; otherwise podman, which
# container_install can install from Debian. Override with CONTAINER_RUNTIME=docker|podman.
#
# podman: CONTAINERS_CONF points at hack/containers.conf (no default ulimits) and, when runc is
# installed, `--runtime runc` is passed (crun refuses hybrid cgroup v1/v2 hosts).
set -euo pipefail

CONTAINER_LIB_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

docker_works() {
  command -v docker > /dev/null 2>&1 && timeout 20 docker info > /dev/null 2>&1
}

# Install podman and runc from Debian when missing (root and apt-get needed). Bounded in time.
container_install() {
  if docker_works || command -v podman > /dev/null 2>&1; then
    return 0
  fi
  if [[ "$(id -u)" != 0 ]] || ! command -v apt-get > /dev/null 2>&1; then
    echo "container-lib: no working docker and no podman; install one (Debian: apt-get install podman runc)" >&2
    return 1
  fi
  echo "container-lib: installing podman and runc from Debian" >&2
  timeout 300 apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq \
      podman runc > /dev/null
}

container_detect() {
  local wanted="${CONTAINER_RUNTIME:-}"
  if [[ -z "${wanted}" ]]; then
    if docker_works; then
      wanted=docker
    elif command -v podman > /dev/null 2>&1; then
      wanted=podman
    else
      echo "container-lib: no working docker (daemon unreachable) and no podman" >&2
      return 1
    fi
  fi
  case "${wanted}" in
    docker)
      CTR_NAME=docker
      CTR=(docker)
      ;;
    podman)
      CTR_NAME=podman
      export CONTAINERS_CONF="${CONTAINERS_CONF:-${CONTAINER_LIB_DIR}/containers.conf}"
      CTR=(podman)
      if command -v runc > /dev/null 2>&1; then
        CTR+=(--runtime runc)
      fi
      ;;
    *)
      echo "container-lib: CONTAINER_RUNTIME must be docker or podman, not '${wanted}'" >&2
      return 1
      ;;
  esac
  export CTR_NAME
}

# The name a locally built image has in the runtime's store (podman prefixes localhost/).
local_image_name() {
  local name="$1"
  if [[ "${CTR_NAME}" == podman && "${name%%/*}" == "${name}" ]]; then
    name="localhost/${name}"
  fi
  printf '%s\n' "${name}"
}

image_exists() {
  "${CTR[@]}" image inspect "$1" > /dev/null 2>&1
}
