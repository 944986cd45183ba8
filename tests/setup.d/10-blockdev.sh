#!/usr/bin/env bash
# The write-back error test (tests/test_writeback_error.py) builds a small ext4 on a loop device
# over a tmpfs: losetup and mount (Debian `mount`), mkfs.ext4 and dumpe2fs (`e2fsprogs`),
# fallocate (`util-linux`). It needs root to mount; without root it is skipped, or failed in CI.
set -euo pipefail
need=()
command -v losetup >/dev/null || [ -x /sbin/losetup ] || need+=(mount)
command -v mkfs.ext4 >/dev/null || [ -x /sbin/mkfs.ext4 ] || need+=(e2fsprogs)
command -v fallocate >/dev/null || need+=(util-linux)
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${need[@]}" >/dev/null
fi
