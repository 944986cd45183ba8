#!/usr/bin/env bash
# What the real test nodes (tests/cluster/node.py) take from Debian: runc (containerd's runtime),
# the CNI plugins (bridge, host-local, loopback) and iptables (kube-proxy's rules, inside the nodes'
# own network namespace). kubelet, kube-proxy and containerd are built from Go modules in the build
# lane (50-cluster.sh).
set -euo pipefail
need=()
command -v runc >/dev/null || need+=(runc)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
command -v iptables-restore >/dev/null || need+=(iptables)
command -v nsenter >/dev/null || need+=(util-linux)
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${need[@]}" >/dev/null
fi
