#!/usr/bin/env bash
# A production S3 server for the S3 tests and bench/pull_s3.py: SeaweedFS (Apache-2.0), pinned in
# tests/s3server/go.mod (+ go.sum), built from the Go module proxy into the repo's git-ignored
# .work/seaweedfs/. Rebuilt only when go.mod/go.sum change. Go's module and build caches
# (GOMODCACHE, GOCACHE) stay where the machine keeps them, so a fresh clone on the same machine
# relinks in seconds; a cold machine downloads ~500 modules and compiles for several minutes.
# lane: build
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.work/seaweedfs
stamp=$(cat tests/s3server/go.mod tests/s3server/go.sum | sha256sum | cut -c1-16)
if [[ -x $out/weed && -f $out/stamp && $(cat $out/stamp) == "$stamp" ]]; then
  exit 0
fi
command -v go >/dev/null || { echo "seaweedfs: the go command is missing" >&2; exit 1; }
mkdir -p $out
start=$(date +%s)
(cd tests/s3server && go build -mod=readonly -buildvcs=false -trimpath -ldflags "-s -w" -o ../../$out/weed.tmp github.com/seaweedfs/seaweedfs/weed)
mv $out/weed.tmp $out/weed
echo "$stamp" >$out/stamp
echo "seaweedfs: built $($out/weed version 2>/dev/null | head -1) in $(($(date +%s) - start)) s"
