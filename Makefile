# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-deps demo lint bench fuzz clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# System packages and servers the tests start (nginx, registry, azurite, ...): one script per backend.
test-deps: install
	@for s in tests/setup.d/*.sh; do echo "setup: $$s"; bash $$s || exit 1; done

test: test-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# The property-based fuzzers (tests marked fuzz), randomized and MODELCACHE_FUZZ_SCALE (25) times
# longer than their bounded run in `make test`; failures are kept in .work/hypothesis and replayed first.
fuzz: install
	MODELCACHE_FUZZ=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m fuzz --timeout 3600 \
		--hypothesis-show-statistics $(PYTEST_ARGS) tests

# The main job on a local Kubernetes control plane (built from Go modules on the first run, ~10 min),
# then the same without a cluster (CLI and standalone agent).
demo: install
	bash tests/setup.d/50-cluster.sh
	$(BIN)/python -m tests.cluster.demo
	$(BIN)/python -m modelcache.demo

lint: install
	$(BIN)/ruff check .

bench: test-deps
	$(BIN)/python bench/pull_http.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
