#!/bin/sh
# prune-venv.sh VENV: cut from the image's venv what no role loads at run time, then compile the
# rest to bytecode. Run in the Dockerfile's build stage; the sizes are in README.md, "Image".
set -eu
venv=$1
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')

# kubernetes.aio: the client's asyncio twin (68 MB with bytecode); everything here uses the sync
# client, and nothing outside kubernetes/aio imports it.
rm -rf "$sp/kubernetes/aio"

# botocore's models of ~450 AWS services (28 MB): keep S3 and what its credential providers create
# clients for (sts: assume-role and IRSA web identity; sso, sso-oidc: SSO profiles; signin: login
# profiles). A pinned botocore that lacks one of them fails here rather than at run time.
keep="s3 sts sso sso-oidc signin"
for k in $keep; do
  [ -d "$sp/botocore/data/$k" ] || { echo "prune-venv: $sp/botocore/data/$k missing: update the keep list" >&2; exit 1; }
done
for d in "$sp"/botocore/data/*/; do
  case " $keep " in *" $(basename "$d") "*) ;; *) rm -rf "$d" ;; esac
done

# Test suites shipped inside packages.
find "$sp" -mindepth 2 -type d -name tests -prune -exec rm -rf {} +

# Debug info in extension modules (zstandard's two backends carry 21 MB of it); symbols stay.
find "$sp" -name '*.so' -type f -exec strip --strip-debug {} +

# Bytecode on purpose: the root file system is read-only in deploy/, so without shipped .pyc every
# start compiles every import again (measured: ~3 s -> ~8.5 s for the modules the roles load).
# unchecked-hash: valid whatever the files' mtimes become in a layer; sources never change in an image.
find "$sp" -name __pycache__ -type d -prune -exec rm -rf {} +
"$venv/bin/python" -m compileall -q -j0 --invalidation-mode unchecked-hash "$sp"
