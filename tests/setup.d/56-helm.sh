#!/usr/bin/env bash
# Helm (Apache-2.0), pinned in tests/helm/go.mod (+ go.sum), built from the Go module proxy into the
# repo's git-ignored .work/helm/ for the chart's tests and `make ops-check` (charts/modelcache/).
# Rebuilt only when go.mod, go.sum or this script change. Cold (empty module and build caches):
# 12.6 min at load 10-16 on 2 cores, 245 s of CPU and 410 MB of modules (docs/development.md).
# lane: build
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.work/helm
stamp=$(cat tests/helm/go.mod tests/helm/go.sum "$0" | sha256sum | cut -c1-16)
if [[ -x $out/helm && -f $out/stamp && $(cat $out/stamp) == "$stamp" ]]; then
  exit 0
fi
command -v go >/dev/null || { echo "helm: the go command is missing" >&2; exit 1; }
mkdir -p $out
start=$(date +%s)
# What Helm's own Makefile sets: its version, and the Kubernetes version its default capabilities
# (.Capabilities.KubeVersion, a chart's kubeVersion check in `helm template`/`lint`) report; without
# them it claims v1.20.0. Read from the pins, so a bump follows.
helm_version=$(sed -n 's/^\thelm.sh\/helm\/v3 \(v[0-9.]*\).*/\1/p' tests/helm/go.mod)
k8s_minor=$(sed -n 's/^\tk8s.io\/client-go v0\.\([0-9]*\)\..*/\1/p' tests/helm/go.mod)
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  ldflags="$ldflags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done
(cd tests/helm && go build -mod=readonly -buildvcs=false -trimpath -ldflags "$ldflags" -o ../../$out/helm.tmp helm.sh/helm/v3/cmd/helm)
mv $out/helm.tmp $out/helm
echo "$stamp" >$out/stamp
echo "helm: built $($out/helm version --short 2>/dev/null) in $(($(date +%s) - start)) s"
