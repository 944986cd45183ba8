# One image for every role:
#   storage-initializer SRC DEST [...]   (default entrypoint: a drop-in for KServe's storage-initializer image)
#   modelcache-agent                     (DaemonSet; command set in deploy/agent/daemonset.yaml)
#   modelcache-coordinator               (Deployment; command set in deploy/coordinator/deployment.yaml)
#   modelcache pull URI --root DIR       (CLI)
# Build: `make image` (tags the reference in deploy/kustomization.yaml). Python packages come only
# from requirements/image.txt and image-build.txt, pinned with hashes (`make lock` renews them).

ARG BASE_IMAGE=docker.io/library/python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# strip (binutils) for image/prune-venv.sh; a C compiler and MIT Kerberos' headers for gssapi (the
# only package without a Linux wheel); this stage only. python:3.11-slim ships Python's headers, a
# Debian python3 base (the tests' stand-in) needs python3-dev for them.
RUN apt-get update -qq \
 && pkgs="binutils gcc libc6-dev libkrb5-dev" \
 && { [ -e "$(python3 -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" ] || pkgs="$pkgs python3-dev"; } \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
# Build tools (pinned pip, setuptools, wheel) in a venv of their own, so none of them reaches the
# runtime venv, which is made without pip: nothing in the image installs packages at run time.
# gssapi is built from its hashed sdist by the build venv (Cython pinned there), then installed
# from that wheel.
COPY requirements/image-build.txt requirements/image.txt requirements/image-src.txt ./requirements/
COPY image/prune-venv.sh ./image/
RUN python3 -m venv /opt/build \
 && /opt/build/bin/pip install -q --require-hashes --no-deps -r requirements/image-build.txt \
 && /opt/build/bin/pip wheel -q --require-hashes --no-deps --no-build-isolation --no-binary :all: \
      -w /tmp/src-wheels -r requirements/image-src.txt \
 && python3 -m venv --without-pip /opt/venv \
 && /opt/build/bin/pip --python /opt/venv/bin/python install -q --no-compile --require-hashes --no-deps \
      -r requirements/image.txt \
 && /opt/build/bin/pip --python /opt/venv/bin/python install -q --no-compile --no-deps --no-index /tmp/src-wheels/*.whl \
 && sh image/prune-venv.sh /opt/venv
# The project last, so a source change rebuilds only this layer; the imports check that pruning
# left every role able to start (and S3 plus its credential services able to make a client).
COPY pyproject.toml README.md ./
COPY modelcache ./modelcache
COPY initializer ./initializer
COPY agent ./agent
COPY coordinator ./coordinator
RUN /opt/build/bin/pip wheel -q --no-deps --no-build-isolation -w /tmp/dist . \
 && /opt/build/bin/pip --python /opt/venv/bin/python install -q --no-compile --no-deps /tmp/dist/*.whl \
 && /opt/build/bin/pip --python /opt/venv/bin/python check \
 && /opt/venv/bin/python -B -c 'import boto3, gssapi, requests_gssapi, initializer.__main__, agent.__main__, coordinator.__main__, modelcache.cli; [boto3.client(s, region_name="us-east-1") for s in ("s3", "sts", "sso", "sso-oidc", "signin")]' \
 && sp=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
 && /opt/venv/bin/python -m compileall -q --invalidation-mode unchecked-hash \
      "$sp/modelcache" "$sp/initializer" "$sp/agent" "$sp/coordinator"

FROM ${BASE_IMAGE}
# The release, as `modelcache --version` reports it (pyproject.toml's version; `make image` passes
# it, tests/test_packaging.py keeps this default equal to it).
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="modelcache" \
      org.opencontainers.image.description="Model weights onto serving nodes: fast, verified, crash-safe; a drop-in for KServe's storage initializer and local model cache" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# UID/GID 1000 as KServe's storage-initializer; /mnt owned by it (KServe's image does the same),
# and KServe's entrypoint path kept for ClusterStorageContainers that name it as the command.
# MIT Kerberos' GSSAPI library for gssapi (HDFS with Kerberos; krb5.conf comes with the pod).
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libgssapi-krb5-2 >/dev/null \
 && apt-get clean && rm -rf /var/lib/apt/lists/* /var/log/apt /var/log/dpkg.log /var/cache/debconf/*-old \
 && groupadd --gid 1000 modelcache \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin modelcache \
 && mkdir -p /mnt/models /storage-initializer/scripts \
 && chown 1000:1000 /mnt /mnt/models \
 && ln -s /opt/venv/bin/storage-initializer /storage-initializer/scripts/initializer-entrypoint
COPY --from=build /opt/venv /opt/venv
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["storage-initializer"]
