"""Turn the environment (KServe's initializer contract) into per-backend settings.

This is the only module that reads ``os.environ``; sources get a ``Settings`` and never look
at the environment themselves, so the agent can build settings per download from a secret
without touching its own process environment. Values here may be secrets: ``Settings`` has a
redacting ``repr`` and nothing here logs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from modelcache.errors import ModelcacheError

DEFAULT_CA_BUNDLE_MOUNT = "/etc/ssl/custom-certs"
DEFAULT_PVC_ROOT = "/mnt/pvc"


def _truthy(value: str | None, default: bool = False) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def parse_patterns(value: str | None) -> tuple[str, ...]:
    """``STORAGE_ALLOW_PATTERNS`` / ``STORAGE_IGNORE_PATTERNS``: a JSON list or comma-separated."""
    if not value or not value.strip():
        return ()
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelcacheError(f"storage patterns {text!r} are not a valid JSON list: {exc}") from exc
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ModelcacheError(f"storage patterns {text!r} must be a JSON list of strings")
        return tuple(i.strip() for i in items if i.strip())
    return tuple(p.strip() for p in text.split(",") if p.strip())


@dataclass(frozen=True)
class HTTPSettings:
    #: host -> extra request headers, from the env variables ``<host>-headers`` (JSON objects).
    headers: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    verify: bool = True
    #: Extra CA certificates, trusted in addition to the system store.
    ca_bundle: str | None = None
    connect_timeout: float = 15.0
    read_timeout: float = 60.0

    def headers_for(self, host: str) -> dict[str, str]:
        return dict(self.headers.get(host, {}))

    def __repr__(self) -> str:
        return f"HTTPSettings(hosts_with_headers={sorted(self.headers)}, verify={self.verify})"


@dataclass(frozen=True)
class LocalSettings:
    #: Where ``pvc://claim/path`` is mounted: ``<pvc_root>/<claim>/<path>``... see sources.local.
    pvc_root: str = DEFAULT_PVC_ROOT


DEFAULT_OCI_DOCKER_CONFIG = "/mnt/oci-fetch-auth/config.json"
DEFAULT_HDFS_SECRET_DIR = "/var/secrets/kserve-hdfscreds"


@dataclass(frozen=True)
class OCISettings:
    """KServe's OCI fetch mode: a docker config for auth, and whether the registry is plain http."""

    docker_config: str = DEFAULT_OCI_DOCKER_CONFIG
    insecure: bool = False


@dataclass(frozen=True)
class HDFSSettings:
    """The files of KServe's HDFS secret dir. TLS_* hold file paths (KServe passes paths on)."""

    secret_dir: str = DEFAULT_HDFS_SECRET_DIR
    namenode: str = ""
    user_proxy: str | None = None
    root_path: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_skip_verify: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    n_threads: int = 2
    kerberos_principal: str | None = None
    kerberos_keytab: str | None = None

    def __repr__(self) -> str:
        return f"HDFSSettings(namenode={self.namenode!r}, secret_dir={self.secret_dir!r})"


@dataclass(frozen=True)
class Settings:
    http: HTTPSettings = field(default_factory=HTTPSettings)
    local: LocalSettings = field(default_factory=LocalSettings)
    oci: OCISettings = field(default_factory=OCISettings)
    hdfs: HDFSSettings = field(default_factory=HDFSSettings)
    allow_patterns: tuple[str, ...] = ()
    ignore_patterns: tuple[str, ...] = ()
    #: The environment snapshot these settings were built from, for backends that read more.
    env: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return f"Settings(http={self.http!r}, local={self.local!r})"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        return cls(
            http=_http_settings(env),
            local=LocalSettings(pvc_root=env.get("MODELCACHE_PVC_ROOT", DEFAULT_PVC_ROOT)),
            oci=OCISettings(
                docker_config=env.get("KSERVE_OCI_DOCKER_CONFIG") or DEFAULT_OCI_DOCKER_CONFIG,
                insecure=(env.get("KSERVE_OCI_INSECURE_REGISTRY") or "").strip().lower() in ("1", "true", "yes"),
            ),
            hdfs=hdfs_settings(env.get("HDFS_SECRET_DIR") or DEFAULT_HDFS_SECRET_DIR),
            allow_patterns=parse_patterns(env.get("STORAGE_ALLOW_PATTERNS")),
            ignore_patterns=parse_patterns(env.get("STORAGE_IGNORE_PATTERNS")),
            env=env,
        )


def ca_bundle_from_env(env: Mapping[str, str]) -> str | None:
    """The custom CA bundle KServe's initializer would use, if any.

    KServe mounts a ConfigMap with ``cabundle.crt`` and names it in ``CA_BUNDLE_CONFIGMAP_NAME``;
    ``MODELCACHE_CA_BUNDLE`` names a file directly.
    """
    if env.get("MODELCACHE_CA_BUNDLE"):
        return env["MODELCACHE_CA_BUNDLE"]
    if env.get("CA_BUNDLE_CONFIGMAP_NAME"):
        mount = env.get("CA_BUNDLE_VOLUME_MOUNT_POINT") or DEFAULT_CA_BUNDLE_MOUNT
        path = os.path.join(mount, "cabundle.crt")
        if not os.path.isfile(path):
            raise ModelcacheError(
                f"Failed to find ca bundle file({path}): CA_BUNDLE_CONFIGMAP_NAME is set "
                "but the ConfigMap is not mounted at CA_BUNDLE_VOLUME_MOUNT_POINT"
            )
        return path
    return None


def _http_settings(env: Mapping[str, str]) -> HTTPSettings:
    headers: dict[str, dict[str, str]] = {}
    for name, value in env.items():
        if not name.endswith("-headers") or len(name) <= len("-headers"):
            continue
        host = name[: -len("-headers")]
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            # The value is likely a secret: name the variable, never echo it.
            raise ModelcacheError(f"environment variable '{name}' is not a JSON object of headers") from exc
        if not isinstance(parsed, dict):
            raise ModelcacheError(f"environment variable '{name}' must be a JSON object of headers")
        headers[host] = {str(k): str(v) for k, v in parsed.items()}
    return HTTPSettings(
        headers=headers,
        verify=_truthy(env.get("MODELCACHE_HTTP_VERIFY_SSL"), default=True),
        ca_bundle=ca_bundle_from_env(env),
        connect_timeout=float(env.get("MODELCACHE_CONNECT_TIMEOUT", "15")),
        read_timeout=float(env.get("MODELCACHE_READ_TIMEOUT", "60")),
    )


_HDFS_FILE_SECRETS = ("TLS_CERT", "TLS_KEY", "TLS_CA", "KERBEROS_KEYTAB")


def hdfs_settings(secret_dir: str) -> HDFSSettings:
    """Read KServe's HDFS secret dir: one file per key; certificate and keytab files by path."""
    values: dict[str, str] = {}
    if os.path.isdir(secret_dir):
        for name in os.listdir(secret_dir):
            path = os.path.join(secret_dir, name)
            if not os.path.isfile(path):
                continue
            if name in _HDFS_FILE_SECRETS:
                values[name] = path
            else:
                with open(path, encoding="utf-8") as f:
                    values[name] = f.read().strip()
    headers: dict[str, str] = {}
    if values.get("HEADERS"):
        try:
            parsed = json.loads(values["HEADERS"])
        except json.JSONDecodeError as exc:
            raise ModelcacheError(f"HDFS secret file '{secret_dir}/HEADERS' is not a JSON object") from exc
        if not isinstance(parsed, dict):
            raise ModelcacheError(f"HDFS secret file '{secret_dir}/HEADERS' must be a JSON object of headers")
        headers = {str(k): str(v) for k, v in parsed.items()}
    try:
        n_threads = int(values.get("N_THREADS") or 2)
    except ValueError as exc:
        raise ModelcacheError(f"HDFS secret file '{secret_dir}/N_THREADS' is not an integer") from exc
    return HDFSSettings(
        secret_dir=secret_dir,
        namenode=values.get("HDFS_NAMENODE", ""),
        user_proxy=values.get("USER_PROXY") or None,
        root_path=values.get("HDFS_ROOTPATH") or None,
        tls_cert=values.get("TLS_CERT"),
        tls_key=values.get("TLS_KEY"),
        tls_ca=values.get("TLS_CA"),
        tls_skip_verify=(values.get("TLS_SKIP_VERIFY") or "").lower() == "true",
        headers=headers,
        n_threads=max(1, n_threads),
        kerberos_principal=values.get("KERBEROS_PRINCIPAL") or None,
        kerberos_keytab=values.get("KERBEROS_KEYTAB"),
    )
