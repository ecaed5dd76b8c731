#!/usr/bin/env bash
# Delete the kind cluster made by hack/kind-up.sh (and everything in it), with the same provider
# (KIND_PROVIDER / KIND_EXPERIMENTAL_PROVIDER, else docker when its daemon answers, else podman:
# hack/kind_settings.py) and kind v0.33.0 (PATH, else hack/upstream-build.sh's cache).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
python="${PYTHON:-.venv/bin/python}"
cluster="${KIND_CLUSTER_NAME:-fractional-dra}"

settings="$("${python}" hack/kind_settings.py env)" || exit 1
eval "${settings}"
export KIND_EXPERIMENTAL_PROVIDER="${KIND_PROVIDER}"

kind="$(command -v kind || true)"
if [[ -z "${kind}" ]] || ! "${kind}" version 2> /dev/null | grep -q "kind ${KIND_VERSION} "; then
  env_lines="$(COMPONENTS=kind hack/upstream-build.sh --print-env 2> /dev/null)" || {
    echo "kind-down: kind ${KIND_VERSION} is not installed: go install sigs.k8s.io/kind@${KIND_VERSION}" >&2
    exit 1
  }
  eval "${env_lines}"
  kind="${KIND_BIN}/kind"
fi
if "${kind}" get clusters 2> /dev/null | grep -qx "${cluster}"; then
  "${kind}" delete cluster --name "${cluster}"
else
  echo "kind-down: no cluster named ${cluster} (provider ${KIND_PROVIDER})"
fi
