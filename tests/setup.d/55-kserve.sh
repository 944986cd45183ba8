#!/usr/bin/env bash
# KServe's own controller manager (and its local-model controller) built from its published Go module
# into .work/kserve/bin (tests/kserve/go.mod pins the release); the KServe tests run it against the
# real control plane. Rebuilt only when the pin changes; also fetches the module whose manifests
# (CRDs, webhooks, RBAC, config map) those tests read from the Go module cache.
# lane: build
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v go >/dev/null; then
  echo "Go is needed to build KServe's controller for the tests (the polyglot machines have it)" >&2
  exit 1
fi
.venv/bin/python -m tests.kserve build
