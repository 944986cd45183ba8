# One image for every role:
#   storage-initializer SRC DEST [...]   (default entrypoint: a drop-in for KServe's storage-initializer image)
#   modelcache-agent                     (DaemonSet; command set in deploy/agent/daemonset.yaml)
#   modelcache-coordinator               (Deployment; command set in deploy/coordinator/deployment.yaml)
#   modelcache pull URI --root DIR       (CLI)
# Build: docker build -t ghcr.io/modelcache/modelcache:0.1.0 .

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/venv && /opt/venv/bin/pip install -q -U pip
# README.m[d]: the wildcard keeps the build working before README.md exists.
COPY pyproject.toml README.m[d] ./
COPY modelcache ./modelcache
COPY initializer ./initializer
COPY agent ./agent
COPY coordinator ./coordinator
RUN /opt/venv/bin/pip install -q . && /opt/venv/bin/pip check

FROM python:3.11-slim
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# UID/GID 1000 as KServe's storage-initializer; /mnt owned by it (KServe's image does the same),
# and KServe's entrypoint path kept for ClusterStorageContainers that name it as the command.
RUN groupadd --gid 1000 modelcache \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin modelcache \
 && mkdir -p /mnt/models /storage-initializer/scripts \
 && chown 1000:1000 /mnt /mnt/models \
 && ln -s /opt/venv/bin/storage-initializer /storage-initializer/scripts/initializer-entrypoint
COPY --from=build /opt/venv /opt/venv
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["storage-initializer"]
