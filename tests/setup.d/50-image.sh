#!/usr/bin/env bash
# Container image tests (tests/test_image*.py): podman with runc, and a local stand-in for the
# Dockerfile's base image, since no registry but the package registries can be reached here.
#
# The base is made once from Debian's packages with debootstrap (~3 min) and tagged with the
# public name the Dockerfile's BASE_IMAGE defaults to, so `make image` builds unchanged; later runs
# find it in podman's storage and skip the debootstrap.
set -euo pipefail
cd "$(dirname "$0")/../.."

BASE_IMAGE=$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
WORK=.work/image
CONF=$WORK/containers.conf

need=()
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${need[@]}" >/dev/null
fi

# crun (podman's default) fails here on setrlimit and hybrid cgroups; runc with no default
# ulimits or pids limit works. A file of our own (CONTAINERS_CONF, which the tests and this
# script set) rather than an edit of /etc/containers.
mkdir -p "$WORK"
cat >"$CONF" <<'EOF'
[containers]
default_ulimits = []
pids_limit = 0

[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF=$PWD/$CONF

if podman image exists "$BASE_IMAGE"; then
  exit 0
fi

# The Debian mirror apt uses here (deb822 .sources or a one-line sources.list).
mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -1 || true)
if [ -z "$mirror" ]; then
  mirror=$(awk '$1 == "deb" && $3 !~ /security/ {print $2; exit}' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}

rootfs=$(mktemp -d "$PWD/$WORK/rootfs.XXXXXX")
trap 'rm -rf "$rootfs"' EXIT
echo "50-image: building the local base $BASE_IMAGE with debootstrap from $mirror (once)"
# python3 3.11 + venv + ca-certificates: what python:3.11-slim gives the Dockerfile.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" \
  >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
# python:3.11-slim has a `python` command; Debian's package has only `python3`.
ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
tar -C "$rootfs" -c . | podman import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$BASE_IMAGE" >/dev/null
echo "50-image: $BASE_IMAGE ready ($(podman image inspect --format '{{.Size}}' "$BASE_IMAGE") bytes)"
