#!/usr/bin/env bash
# Runs every tests/setup.d/*.sh (what `make test-deps` does) in two lanes at once, to keep a cold
# CI run inside its budget: the Go builds (CPU-bound, marked "# lane: build") one after another in
# the background, and everything else (package installs, downloads, a debootstrap: mostly waiting
# on the network and the disk) one after another in the foreground. Each script's time is printed;
# the build lane's output comes at the end, whole.
#
# `tests/setup.sh --no-go` (`make test-servers`) leaves the Go builds out: what every test but
# those marked `go` needs (tests/tiers.py).
set -uo pipefail
go=1
case "${1:-}" in
  --no-go) go=0 ;;
  "") ;;
  *) echo "usage: tests/setup.sh [--no-go]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
mkdir -p .work
log=.work/setup-build-lane.log

run() {
  local script=$1 started=$SECONDS
  echo "setup: $script"
  if ! bash "$script"; then
    echo "setup: $script failed" >&2
    return 1
  fi
  echo "setup: $script done in $((SECONDS - started)) s"
}

build=() other=()
for script in tests/setup.d/*.sh; do
  if grep -q '^# lane: build' "$script"; then
    ((go)) && build+=("$script")
  else
    other+=("$script")
  fi
done

( for script in "${build[@]}"; do run "$script" || exit 1; done ) >"$log" 2>&1 &
lane=$!
rc=0
for script in "${other[@]}"; do
  run "$script" || { rc=1; break; }
done
if ((rc)); then
  kill -- "$lane" 2>/dev/null
fi
wait "$lane" || rc=1
cat "$log"
exit "$rc"
