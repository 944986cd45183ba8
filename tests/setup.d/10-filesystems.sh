#!/usr/bin/env bash
# File systems the integrity tests build (they need root to mount; without root they are skipped,
# or failed in CI):
# - tests/test_writeback_error.py: ext4 on a loop device over a tmpfs: losetup and mount (Debian
#   `mount`), mkfs.ext4 and dumpe2fs (`e2fsprogs`), fallocate (`util-linux`);
# - tests/test_store_integrity.py: a real FUSE mount (`bindfs`) whose locks are host-local.
set -euo pipefail
need=()
command -v losetup >/dev/null || [ -x /sbin/losetup ] || need+=(mount)
command -v mkfs.ext4 >/dev/null || [ -x /sbin/mkfs.ext4 ] || need+=(e2fsprogs)
command -v fallocate >/dev/null || need+=(util-linux)
command -v bindfs >/dev/null || need+=(bindfs)
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${need[@]}" >/dev/null
fi
