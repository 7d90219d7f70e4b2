# One command per task. `make demo` and `make test` work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0

.PHONY: install demo test test-unit test-integration test-e2e test-browser bench lint format clean vendor

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, from its CPU wheel: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	# dev: tests and linters; examples: what examples/ imports (the tests and `make demo` run them);
	# the framework extras: the integrations' tests and examples
	$(PIP) install --quiet -e '.[dev,examples,lightning,transformers,jax]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/phalanx demo

test: install
	$(VENV)/bin/pytest

test-unit: install
	$(VENV)/bin/pytest tests/unit

test-integration: install
	$(VENV)/bin/pytest tests/integration

test-e2e: install
	$(VENV)/bin/pytest tests/e2e

test-browser: install
	$(VENV)/bin/pytest tests/browser

bench: install
	$(PY) -m bench.run_all

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy phalanx stack server scheduler worker_agent

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# the dashboard's front-end files, again from the npm registry, checked against their digests
vendor:
	bash web/vendor.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
