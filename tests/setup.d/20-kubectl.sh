#!/usr/bin/env bash
# kubectl for the Kubernetes API test server's tests (tests/test_kubeapi*.py): Debian's kubernetes-client.
set -euo pipefail
if ! command -v kubectl >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq kubernetes-client >/dev/null
fi
