# fractional-dra: the two commands a newcomer needs are `make demo` and `make test`.
# Both create the virtualenv (.venv) when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The image `make image` builds (podman stores it as localhost/$(IMAGE)); the chart and kind use it.
IMAGE ?= fractional-dra:dev

.PHONY: demo test test-real lint actionlint bench bench-scale proto go-modules image image-test cluster-up cluster-down e2e kind-up kind-e2e kind-down clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,demo]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m driver demo

test: $(STAMP)
	$(PY) -m pytest

# The tests marked shared, on the real control plane (etcd, kube-apiserver, kube-controller-manager
# of hack/localcluster, K8S_VERSION) instead of the emulator, and the differential corpus sent to it.
# A shared 2-core machine can starve one case past its deadline: the failed ones run once more (as
# in make e2e), and a case that fails twice fails the run.
test-real: $(STAMP)
	$(PY) -m pytest --cluster=real -n0 $(PYTEST_ARGS) || { \
	  echo "test-real: some cases failed; running the failed ones once more"; \
	  $(PY) -m pytest --cluster=real -n0 --last-failed --last-failed-no-failures none $(PYTEST_ARGS); }

lint: $(STAMP)
	$(VENV)/bin/ruff check driver tests bench hack
	$(VENV)/bin/ruff format --check driver tests bench hack
	$(VENV)/bin/mypy driver

# actionlint for tests/test_release.py where its wheel (the `workflows` extra) cannot be installed:
# upstream's binary built from its Go module into ~/.cache/fractional-dra/bin (needs Go).
ACTIONLINT_VERSION ?= v1.7.12
actionlint:
	GOBIN=$(HOME)/.cache/fractional-dra/bin go install github.com/rhysd/actionlint/cmd/actionlint@$(ACTIONLINT_VERSION)

bench: $(STAMP)
	$(PY) bench/run_all.py

# Production size on the real control plane (root, Go, an hour and more): bench/production_scale.py
# on a kwok fleet of SCALE_NODES, then BENCHMARKS.md rewritten with its section (bench/results/scale.json).
SCALE_NODES ?= 1000
SCALE_ARGS ?=
bench-scale: $(STAMP)
	COMPONENTS=control-plane,kwok hack/upstream-build.sh
	$(PY) bench/production_scale.py --nodes $(SCALE_NODES) $(SCALE_ARGS)
	$(PY) bench/run_all.py --report-only

# The kubelet's protos (proto/) and the Kubernetes API types the emulator decodes from protobuf
# bodies (their definitions read from k8s.io/api and k8s.io/apimachinery in the Go module cache).
proto: $(STAMP)
	$(PY) hack/gen_proto.py
	$(PY) hack/gen_k8s_proto.py

# Other projects' files the tests read (Kubernetes' protos, Kueue's and cluster-autoscaler's CRDs),
# fetched from their Go modules into ~/.cache/fractional-dra/go/mod (needs Go). make test fetches
# them itself when Go is installed; without Go, the few tests that need them skip and say so.
go-modules:
	$(PYTHON) hack/gomodules.py

# Hermetic: wheels downloaded on the host (wheelhouse/), then built with the network off; docker
# when its daemon answers, else podman (hack/container-lib.sh).
image: $(STAMP)
	IMAGE=$(IMAGE) PYTHON=$(PY) hack/image-build.sh

# The agent and the controller from the image against the embedded API on the host (tests/image).
image-test: image
	IMAGE=$(IMAGE) PYTHON=$(PY) hack/image-test.sh

# A real cluster on this machine, from upstream's Go modules (hack/upstream-build.sh, cached in
# ~/.cache/fractional-dra): etcd, kube-apiserver, kube-controller-manager, kube-scheduler and two
# kubelet nodes with containerd, then `helm install` of the driver. K8S_VERSION=1.36.3|1.35.4.
cluster-up: $(STAMP)
	$(PY) hack/localcluster up

cluster-down:
	@if test -x $(PY); then $(PY) hack/localcluster down; else $(PYTHON) hack/localcluster down; fi

# tests/e2e against the cluster KUBECONFIG names; without one, the local cluster, up then down.
e2e: $(STAMP)
	PYTHON=$(PY) hack/e2e.sh

kind-up: $(STAMP)
	PYTHON=$(PY) IMAGE=$(IMAGE) hack/kind-up.sh

kind-e2e: $(STAMP)
	PYTHON=$(PY) IMAGE=$(IMAGE) hack/kind-e2e.sh

kind-down: $(STAMP)
	PYTHON=$(PY) hack/kind-down.sh

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find wheelhouse -mindepth 1 ! -name README.md -delete
