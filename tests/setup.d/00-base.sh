#!/usr/bin/env bash
# System packages the core tests and benchmarks need: nginx (HTTP source), aria2/curl (bench peers).
set -euo pipefail
need=()
command -v nginx >/dev/null || need+=(nginx)
command -v aria2c >/dev/null || need+=(aria2)
command -v curl >/dev/null || need+=(curl)
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
