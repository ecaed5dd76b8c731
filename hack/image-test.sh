#!/usr/bin/env bash
# `make image-test`: runs tests/image (pytest marker `image`) against the image `make image` built:
# the embedded API on the host, the node agent and the controller in containers.
# Environment: IMAGE (default fractional-dra:dev), CONTAINER_RUNTIME, PYTHON (default .venv/bin/python).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
# shellcheck source=/dev/null  # container-lib.sh is checked on its own
source "${repo_root}/hack/container-lib.sh"
container_detect

image="$(local_image_name "${IMAGE:-fractional-dra:dev}")"
if ! image_exists "${image}"; then
  echo "image-test: ${image} is not in ${CTR_NAME}'s store: run make image first" >&2
  exit 1
fi
export FRACTIONAL_IMAGE="${image}"
FRACTIONAL_IMAGE_RUNTIME="${CTR[*]}"
export FRACTIONAL_IMAGE_RUNTIME
echo "image-test: ${image} with ${FRACTIONAL_IMAGE_RUNTIME}" >&2
# Each test has its own timeout (tests/image); this bounds the whole run.
timeout 900 "${PYTHON:-.venv/bin/python}" -m pytest -m image tests/image -p no:cacheprovider "$@"
