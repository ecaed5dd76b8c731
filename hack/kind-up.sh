#!/usr/bin/env bash
# Create the kind cluster "fractional-dra", build the image, load it into the nodes and install
# the chart with fake devices (profile h100-8x on both workers). Idempotent: an existing cluster
# is reused and the release upgraded.
#
# Environment: KIND_NODE_IMAGE (default kindest/node:v1.35.0), FAKE_PROFILE (default h100-8x),
# IMAGE (default fractional-dra:dev), KIND_CLUSTER_NAME (default fractional-dra).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cluster="${KIND_CLUSTER_NAME:-fractional-dra}"
node_image="${KIND_NODE_IMAGE:-kindest/node:v1.35.0}"
image="${IMAGE:-fractional-dra:dev}"
profile="${FAKE_PROFILE:-h100-8x}"
namespace="fractional-system"
context="kind-${cluster}"

need() {
  if ! command -v "$1" > /dev/null 2>&1; then
    echo "kind-up: '$1' is not installed: $2" >&2
    exit 1
  fi
}
need docker "https://docs.docker.com/engine/install/"
need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation (v0.31+ for Kubernetes 1.35)"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
need helm "https://helm.sh/docs/intro/install/ (v3.8+ or v4)"
if ! docker info > /dev/null 2>&1; then
  echo "kind-up: docker is installed but its daemon does not answer (is it running? may you use it?)" >&2
  exit 1
fi

if kind get clusters 2> /dev/null | grep -qx "${cluster}"; then
  echo "kind-up: reusing cluster ${cluster}"
else
  kind create cluster --name "${cluster}" --image "${node_image}" \
    --config "${repo_root}/hack/kind-config.yaml" --wait 120s
fi

# The same hermetic build as `make image` (wheels from the host, network off), with docker.
CONTAINER_RUNTIME=docker IMAGE="${image}" "${repo_root}/hack/image-build.sh"
kind load docker-image --name "${cluster}" "${image}"

helm upgrade --install fractional-dra "${repo_root}/charts/fractional-dra" \
  --kube-context "${context}" \
  --namespace "${namespace}" --create-namespace \
  --set fakeDevices.enabled=true \
  --set-string fakeDevices.profile="${profile}" \
  --set-string fakeDevices.nodeSelector.fractional\\.dev/fake-node=true \
  --set-string image.repository="${image%:*}" \
  --set-string image.tag="${image##*:}" \
  --set image.pullPolicy=Never \
  --set logFormat=text \
  --wait --timeout 5m

kubectl --context "${context}" -n "${namespace}" rollout status daemonset/fractional-dra-agent --timeout 120s
echo "kind-up: waiting for both workers to publish their devices"
for _ in $(seq 1 60); do
  nodes="$(kubectl --context "${context}" get resourceslices \
    --field-selector spec.driver=fractional.dev -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' |
    sort -u | grep -c . || true)"
  if [[ "${nodes}" -ge 2 ]]; then
    break
  fi
  sleep 2
done
kubectl --context "${context}" get resourceslices --field-selector spec.driver=fractional.dev
echo "kind-up: ready. Try: kubectl --context ${context} apply -f examples/inference-fractional.yaml; make kind-e2e"
