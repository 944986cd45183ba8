#!/usr/bin/env bash
# The real Kubernetes control plane (kube-apiserver, controller-manager, scheduler, kubectl, etcd),
# a node's kubelet and kube-proxy, and the nodes' containerd (tests/cluster/runtime/go.mod),
# built from its published Go modules into .work/cluster/bin (tests/cluster/go.mod pins the versions).
# Rebuilt only when the pins change; the first build on a fresh machine takes ~10 minutes on 2 cores.
# lane: build
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v go >/dev/null; then
  echo "Go is needed to build the test control plane (the polyglot machines have it)" >&2
  exit 1
fi
.venv/bin/python -m tests.cluster build
