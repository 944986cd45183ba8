#!/usr/bin/env bash
# Prometheus and promtool (Apache-2.0) from Debian's package, for the alert rules' unit tests
# (`promtool test rules`), `promtool check metrics` on the agent's and coordinator's /metrics, and
# the test that scrapes them with a real Prometheus (monitoring/, `make ops-check`). The package's
# own service is not started (the tests start their Prometheus on a free port and stop it).
set -euo pipefail
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
# The package's service may have been started by its postinst where an init system runs: it would
# hold :9090 and scrape nothing of ours. Tests never use it; stop it if it runs.
if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
  systemctl stop prometheus || true
fi
