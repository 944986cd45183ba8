#!/usr/bin/env bash
# OCI source tests: the Debian distribution v2 registry (started by tests/fixtures/oci.py).
set -euo pipefail
if ! command -v docker-registry >/dev/null && [ ! -x /usr/bin/docker-registry ]; then
  apt-get update -qq
  # postinst's service start is refused by policy-rc.d in containers; the fixture starts it.
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq docker-registry >/dev/null
fi
