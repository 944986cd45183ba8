# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The image's Python packages, pinned with hashes (`make lock` renews them from pyproject.toml).
LOCK := requirements/image.txt
BUILD_LOCK := requirements/image-build.txt
SRC_LOCK := requirements/image-src.txt
# The image reference: the `images:` entry (newName, newTag) of deploy/kustomization.yaml is the one
# place it is set; `make image push` and `kubectl apply -k deploy/` both use it (deploy/README.md).
KUSTOMIZATION ?= deploy/kustomization.yaml
IMAGE_NAME := $(shell sed -n 's/^ *newName: *//p' $(KUSTOMIZATION))
IMAGE_TAG := $(shell sed -n 's/^ *newTag: *//p' $(KUSTOMIZATION))
IMAGE ?= $(IMAGE_NAME):$(IMAGE_TAG)
# The release: pyproject.toml's version, also the image's org.opencontainers.image.version label.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
CONTAINER_TOOL ?= $(shell command -v podman >/dev/null && echo podman || echo docker)
# Empty: the Dockerfile's default (the public python:3.11-slim).
BASE_IMAGE ?=
# Extra `build` flags, e.g. --network host (see README, "Image").
IMAGE_BUILD_FLAGS ?=

.PHONY: install check test test-servers test-deps demo lint bench fuzz chaos clean image image-size push lock print-image \
	chart ops-check

# The tests run on the versions the image ships: the lock is the venv's constraints (without its
# hashes, which pip would otherwise demand of the test-only packages too).
$(STAMP): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	sed -e 's/ *\\$$//' -e '/^ *--hash=/d' -e '/^ *#/d' $(LOCK) > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# System packages and servers the tests start (nginx, registry, azurite, ...): one script per backend.
test-deps: install
	@bash tests/setup.sh

# The test tiers (tests/tiers.py marks each test from the fixtures it requests; docs/development.md):
# `check` runs lint and the tests that need nothing but the venv; `test-servers` sets up and runs
# everything but what is built from Go (the control plane, KServe, SeaweedFS); `test` (CI) all.
# On every core (pytest-xdist): the cluster tests on one worker, since they share one control
# plane; the tests of a heavy session server (MiniDFS) likewise; the image is built once (a lock).
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider
TEST_WORKERS ?= auto
XDIST := -n $(TEST_WORKERS) --dist loadgroup

check: lint
	$(PYTEST) $(XDIST) -m unit $(PYTEST_ARGS)

test-servers: install
	@bash tests/setup.sh --no-go
	$(PYTEST) $(XDIST) -m "not go" $(PYTEST_ARGS)

# --durations: the slowest tests in every CI log, to keep the cold run inside its budget.
test: test-deps lint
	$(PYTEST) $(XDIST) --durations=25 $(PYTEST_ARGS)

# The chaos tests for longer than in `make test`: the cluster's (CHAOS_SECONDS, default 15 min;
# CHAOS_SEED=<seed> replays the sequence of steps a failed run printed), then the store's kill -9
# loop over pull/refresh/rm/gc (KILL_LOOP_RUNS, default 300; KILL_LOOP_SEED=<seed> replays one).
chaos: install
	bash tests/setup.d/00-base.sh
	bash tests/setup.d/50-cluster.sh
	CHAOS_SECONDS=$${CHAOS_SECONDS:-900} $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/test_chaos.py
	KILL_LOOP_RUNS=$${KILL_LOOP_RUNS:-300} $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/test_kill_loop.py

# The property-based fuzzers (tests marked fuzz), randomized and MODELCACHE_FUZZ_SCALE (25) times
# longer than their bounded run in `make test`; failures are kept in .work/hypothesis and replayed first.
fuzz: install
	MODELCACHE_FUZZ=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m fuzz --timeout 3600 \
		--hypothesis-show-statistics $(PYTEST_ARGS) tests

# The main job on a local Kubernetes cluster whose nodes run pods (the control plane, kubelet and
# containerd built from Go modules on the first run, ~15 min; the image with podman, ~5 min), then
# the same without a cluster (CLI and standalone agent). Needs root (kubelets).
DEMO_IMAGE_FLAGS := --network host -v /etc/ssl/certs:/etc/ssl/certs:ro
demo: install
	bash tests/setup.d/20-nodes.sh
	bash tests/setup.d/50-cluster.sh
	bash tests/setup.d/50-image.sh
	CONTAINERS_CONF=$(CURDIR)/.work/image/containers.conf $(MAKE) image CONTAINER_TOOL=podman \
	  IMAGE_BUILD_FLAGS="$(DEMO_IMAGE_FLAGS)"
	$(BIN)/python -m tests.cluster.demo
	$(BIN)/python -m examples.demo

# ruff, the import rules (pyproject's [tool.importlinter]: the core never imports the roles or
# Kubernetes code, the core's folders import only the floors below them) and the type checker
# ([tool.mypy]).
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

# The Helm chart is rendered from deploy/ (charts/generate.py): run after every change to deploy/ or
# monitoring/alerts.yaml and commit the result (tests/test_chart.py fails on a stale chart).
chart: install
	$(BIN)/python charts/generate.py

# The offline operations checks: the chart (not stale, helm lint, helm template = kubectl kustomize
# with default values and with each component), the alert rules (promtool check and test rules),
# the dashboard's queries, and `promtool check metrics` on a scraped agent and coordinator (and a
# real Prometheus firing an alert through them) on the local control plane. Needs Helm, promtool
# and the control plane built (`make test-deps`, or tests/setup.d/35-prometheus.sh,
# 50-cluster.sh and 56-helm.sh).
OPS_TESTS := tests/test_chart.py tests/test_alerts.py tests/test_dashboard.py tests/test_prometheus.py
ops-check: install
	$(PYTEST) $(OPS_TESTS) $(PYTEST_ARGS)

bench: test-deps
	$(BIN)/python bench/pull_http.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

image: $(LOCK) $(BUILD_LOCK) $(SRC_LOCK)
	$(CONTAINER_TOOL) build $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) --build-arg VERSION=$(VERSION) \
	  $(IMAGE_BUILD_FLAGS) -t $(IMAGE) .

# Size over the base and the five biggest contributors (podman; README.md, "Image").
image-size:
	CONTAINER_TOOL=$(CONTAINER_TOOL) $(PY) image/size.py $(IMAGE) \
	  $(or $(BASE_IMAGE),$(shell sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile))

push:
	$(CONTAINER_TOOL) push $(IMAGE)

print-image:
	@echo $(IMAGE)

# Re-resolve the pins (for every platform, Python 3.11 as in the image); review the diff, run the
# tests (`make install` picks the new pins up), commit the three files. gssapi (the kerberos extra,
# for HDFS) has no Linux wheel: it is pinned apart, in $(SRC_LOCK), and built from its hashed
# sdist in the image's build stage (with Cython from $(BUILD_LOCK)); every other package is a wheel.
lock:
	test -x .work/uv/bin/uv || { $(PY) -m venv .work/uv && .work/uv/bin/pip install -q uv; }
	.work/uv/bin/uv pip compile pyproject.toml --extra kerberos --no-emit-package gssapi --universal \
	  --python-version 3.11 --generate-hashes -q -o $(LOCK)
	printf 'gssapi>=1.8\n' | .work/uv/bin/uv pip compile - --no-deps --universal --python-version 3.11 \
	  --generate-hashes -q -o $(SRC_LOCK)
	printf 'pip\nsetuptools>=77\nwheel\ncython>=3.0.3,<4\n' | .work/uv/bin/uv pip compile - --universal \
	  --python-version 3.11 --generate-hashes -q -o $(BUILD_LOCK)
