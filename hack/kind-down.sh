#!/usr/bin/env bash
# Delete the kind cluster made by hack/kind-up.sh (and everything in it).
set -euo pipefail

cluster="${KIND_CLUSTER_NAME:-fractional-dra}"

if ! command -v kind > /dev/null 2>&1; then
  echo "kind-down: 'kind' is not installed: https://kind.sigs.k8s.io/docs/user/quick-start/#installation" >&2
  exit 1
fi
if kind get clusters 2> /dev/null | grep -qx "${cluster}"; then
  kind delete cluster --name "${cluster}"
else
  echo "kind-down: no cluster named ${cluster}"
fi
