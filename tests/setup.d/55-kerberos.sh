#!/usr/bin/env bash
# Kerberos for the HDFS tests: a real MIT KDC (krb5-kdc, kadmin.local from krb5-admin-server,
# kinit from krb5-user; started by tests/fixtures/kdc.py with its own realm and files) and the
# client side, gssapi + requests-gssapi (the 'kerberos' extra), which build against libkrb5-dev.
set -euo pipefail
cd "$(dirname "$0")/../.."
need=()
[[ -x /usr/sbin/krb5kdc ]] || need+=(krb5-kdc)
[[ -x /usr/sbin/kadmin.local ]] || need+=(krb5-admin-server)
command -v kinit >/dev/null || need+=(krb5-user)
command -v krb5-config >/dev/null || need+=(libkrb5-dev)
if ((${#need[@]})); then
  apt-get update -qq
  # The packages' postinst asks for a default realm and tries to start services: neither is
  # wanted here (policy-rc.d refuses the start in containers; the fixture starts its own KDC).
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${need[@]}" >/dev/null
fi
if ! .venv/bin/python -c "import gssapi, requests_gssapi" 2>/dev/null; then
  .venv/bin/pip install -q -e '.[kerberos]'
fi
