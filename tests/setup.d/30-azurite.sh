#!/usr/bin/env bash
# Azurite (Azure Blob emulator) for the Azure source tests, pinned: >=3.36 needs Node >= 21.
# Installed under the repo's git-ignored .work/ so CI clones anywhere work.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=.work/azurite
if [[ -x $dir/node_modules/.bin/azurite-blob ]] && grep -q '"version": "3.35.0"' $dir/node_modules/azurite/package.json 2>/dev/null; then
  exit 0
fi
if ! command -v npm >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq nodejs npm >/dev/null
fi
mkdir -p $dir
(cd $dir && npm install --silent --no-audit --no-fund --no-save azurite@3.35.0 >/dev/null)
