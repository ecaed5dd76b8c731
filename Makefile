# fractional-dra: the two commands a newcomer needs are `make demo` and `make test`.
# Both create the virtualenv (.venv) when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench proto kind-up kind-e2e kind-down clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,demo]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m driver demo

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check driver tests bench hack
	$(VENV)/bin/ruff format --check driver tests bench hack
	$(VENV)/bin/mypy driver

bench: $(STAMP)
	$(PY) bench/run_all.py

proto: $(STAMP)
	$(PY) hack/gen_proto.py

kind-up: $(STAMP)
	hack/kind-up.sh

kind-e2e: $(STAMP)
	$(PY) -m pytest -m e2e tests/e2e

kind-down:
	hack/kind-down.sh

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
