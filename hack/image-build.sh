#!/usr/bin/env bash
# `make image`: a hermetic build of fractional-dra:dev (in podman's store localhost/fractional-dra:dev).
#   1. wheelhouse/: the runtime dependencies (not the demo extra) as Python 3.11 manylinux wheels,
#      plus setuptools and wheel to build the project, downloaded on the host with the host's pip;
#      redone only when pyproject.toml changes;
#   2. the base (hack/image-base.sh): python:3.11-slim, or an equivalent Debian bookworm base;
#   3. the build with the network off: the Dockerfile installs from wheelhouse/ when it holds wheels.
# Environment: IMAGE (default fractional-dra:dev), CONTAINER_RUNTIME, PYTHON_IMAGE, PYTHON (a
# Python 3.11+ with pip, default .venv/bin/python), PIP_PLATFORM_ARCH (default: uname -m).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
# shellcheck source=/dev/null  # container-lib.sh is checked on its own
source "${repo_root}/hack/container-lib.sh"
container_detect

image="$(local_image_name "${IMAGE:-fractional-dra:dev}")"
python="${PYTHON:-.venv/bin/python}"
arch="${PIP_PLATFORM_ARCH:-$(uname -m)}"
wheelhouse="wheelhouse"
stamp="${wheelhouse}/.pyproject.sha256"

log() { echo "image-build: $*" >&2; }

# -- 1. wheelhouse ------------------------------------------------------------------------------
want="$(sha256sum pyproject.toml | cut -d' ' -f1) ${arch}"
if [[ ! -f "${stamp}" || "$(cat "${stamp}")" != "${want}" ]]; then
  log "downloading the runtime wheels for CPython 3.11 ${arch} into ${wheelhouse}/"
  # The runtime dependencies (no extras), and what building the project itself needs.
  mapfile -t requirements < <("${python}" -c '
import tomllib
pyproject = tomllib.load(open("pyproject.toml", "rb"))
print("\n".join(pyproject["project"]["dependencies"] + pyproject["build-system"]["requires"]))')
  # Bookworm has glibc 2.36: every manylinux tag up to it fits.
  platforms=(--platform "manylinux2014_${arch}")
  for minor in $(seq 17 36); do
    platforms+=(--platform "manylinux_2_${minor}_${arch}")
  done
  find "${wheelhouse}" -name '*.whl' -delete
  rm -f "${stamp}"
  mkdir -p build
  if ! timeout 600 "${python}" -m pip download --quiet --disable-pip-version-check \
    --dest "${wheelhouse}" --only-binary=:all: --implementation cp --python-version 3.11 \
    --abi cp311 "${platforms[@]}" "${requirements[@]}" > build/image-wheels.log 2>&1; then
    log "pip download failed; the last lines of build/image-wheels.log:"
    tail -n 20 build/image-wheels.log >&2
    exit 1
  fi
  echo "${want}" > "${stamp}"
fi
log "$(find "${wheelhouse}" -name '*.whl' | wc -l) wheels, $(du -sm "${wheelhouse}" | cut -f1) MB"

# -- 2. base ------------------------------------------------------------------------------------
base="$(hack/image-base.sh)"

# -- 3. build, network off ----------------------------------------------------------------------
log "building ${image} on ${base} with ${CTR_NAME}, network off"
started="${SECONDS}"
timeout 1200 "${CTR[@]}" build --network none --build-arg "PYTHON_IMAGE=${base}" -t "${image}" .
size_bytes="$("${CTR[@]}" image inspect --format '{{.Size}}' "${image}")"
log "built ${image} in $((SECONDS - started)) s: $((size_bytes / 1000000)) MB"
