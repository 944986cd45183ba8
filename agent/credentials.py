"""Download credentials of one LocalModelNode entry, as KServe would inject them into its Job.

- ``storage``: the ``storage-config`` secret's key (``storage.key``, else ``default_<type>`` when
  the parameters name a type and that key exists, else ``default``) becomes ``STORAGE_CONFIG``,
  and ``storage.parameters`` ``STORAGE_OVERRIDE_CONFIG`` (KServe's storage-spec injection).
- otherwise ``serviceAccountName`` (only when set, as KServe): the secrets attached to that
  service account are read as KServe's credential builder reads them (S3 keys plus the
  ``serving.kserve.io/s3-*`` annotations, the GCS key file, Azure keys, ``https-host`` +
  ``headers``, ``HF_TOKEN``, the HDFS secret's keys as files of a private secret dir).

The result is an environment *dict* handed to ``Settings.from_env`` for that download only:
the agent's own environment is never read or changed, and nothing here is logged. A GCS key
file is written to a private temporary file that is deleted when the download ends.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from modelcache.credentials import Settings
from modelcache.errors import AuthError
from modelcache.kube.types import LocalModelInfo

STORAGE_CONFIG_SECRET = "storage-config"
GCS_KEY_FILE = "gcloud-application-credentials.json"
HDFS_NAMENODE_KEY = "HDFS_NAMENODE"
S3_ACCESS_KEY_NAME = "awsAccessKeyID"
S3_SECRET_KEY_NAME = "awsSecretAccessKey"
ANNOTATION_PREFIX = "serving.kserve.io/"
#: S3 option annotation (after the prefix) -> environment variables it sets (KSERVE-CONTRACTS §5.4).
S3_OPTIONS: dict[str, tuple[str, ...]] = {
    "s3-endpoint": ("S3_ENDPOINT",),
    "s3-usehttps": ("S3_USE_HTTPS",),
    "s3-region": ("AWS_DEFAULT_REGION",),
    "s3-verifyssl": ("S3_VERIFY_SSL",),
    "s3-verify-ssl": ("S3_VERIFY_SSL",),
    "s3-usevirtualbucket": ("S3_USER_VIRTUAL_BUCKET",),
    "s3-useaccelerate": ("S3_USE_ACCELERATE",),
    "s3-useanoncredential": ("awsAnonymousCredential",),
    "s3-cabundle": ("AWS_CA_BUNDLE",),
}
#: Secret data keys copied to the same environment variable.
PLAIN_KEYS = (
    "AZ_CLIENT_ID", "AZ_CLIENT_SECRET", "AZ_TENANT_ID", "AZ_SUBSCRIPTION_ID",
    "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_TENANT_ID", "AZURE_SUBSCRIPTION_ID",
    "AZURE_STORAGE_ACCESS_KEY", "AZURE_ACCESS_TOKEN", "HF_TOKEN", "MODELSCOPE_API_TOKEN",
)


class SecretReader(Protocol):
    def secret(self, name: str) -> dict[str, Any] | None: ...
    def service_account(self, name: str) -> dict[str, Any] | None: ...


def secret_data(secret: Mapping[str, Any]) -> dict[str, str]:
    out = {k: base64.b64decode(v).decode("utf-8") for k, v in (secret.get("data") or {}).items()}
    out.update({k: str(v) for k, v in (secret.get("stringData") or {}).items()})
    return out


def _annotations(obj: Mapping[str, Any] | None) -> dict[str, str]:
    return dict(((obj or {}).get("metadata") or {}).get("annotations") or {})


def storage_env(info: LocalModelInfo, reader: SecretReader) -> dict[str, str]:
    """``STORAGE_CONFIG`` / ``STORAGE_OVERRIDE_CONFIG`` for an entry with ``storage``."""
    assert info.storage is not None
    params = dict(info.storage.parameters or {})
    secret = reader.secret(STORAGE_CONFIG_SECRET)
    if secret is None:
        raise AuthError(f"model {info.status_key}: secret '{STORAGE_CONFIG_SECRET}' not found in the credentials "
                        "namespace; create it or drop the entry's storage field")
    data = secret_data(secret)
    key = info.storage.key
    if not key:
        typed = f"default_{params['type']}" if params.get("type") else ""
        key = typed if typed in data else "default"
    env: dict[str, str] = {}
    if key in data:
        env["STORAGE_CONFIG"] = data[key]
    elif not params:
        raise AuthError(f"model {info.status_key}: secret '{STORAGE_CONFIG_SECRET}' has no key '{key}'; "
                        "add it or set storage.key to an existing key")
    if params:
        env["STORAGE_OVERRIDE_CONFIG"] = json.dumps(params)
    return env


def _s3_env(data: Mapping[str, str], annotations: Mapping[str, str], sa_annotations: Mapping[str, str]
            ) -> dict[str, str]:
    env = {"AWS_ACCESS_KEY_ID": data.get(S3_ACCESS_KEY_NAME, ""), "AWS_SECRET_ACCESS_KEY": data[S3_SECRET_KEY_NAME]}
    for option, variables in S3_OPTIONS.items():
        # An annotation on the secret, else on the service account, else a data key of that name.
        value = annotations.get(ANNOTATION_PREFIX + option) or sa_annotations.get(ANNOTATION_PREFIX + option) \
            or data.get(option)
        if value:
            for var in variables:
                env[var] = value
    return env


def service_account_env(info: LocalModelInfo, reader: SecretReader, key_dir: str) -> dict[str, str]:
    name = info.service_account_name or "default"
    sa = reader.service_account(name)
    if sa is None:
        raise AuthError(f"model {info.status_key}: service account '{name}' not found in the credentials namespace")
    sa_annotations = _annotations(sa)
    env: dict[str, str] = {}
    for ref in sa.get("secrets") or []:
        secret = reader.secret(str(ref.get("name", "")))
        if secret is None:
            continue  # KServe skips (and logs) a missing secret
        data = secret_data(secret)
        if S3_SECRET_KEY_NAME in data:
            env.update(_s3_env(data, _annotations(secret), sa_annotations))
        if GCS_KEY_FILE in data:
            path = os.path.join(key_dir, GCS_KEY_FILE)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(data[GCS_KEY_FILE])
            env["GOOGLE_APPLICATION_CREDENTIALS"] = path
        if data.get(HDFS_NAMENODE_KEY):
            # KServe mounts such a secret at /var/secrets/kserve-hdfscreds: one file per key.
            folder = os.path.join(key_dir, "hdfs")
            os.makedirs(folder, mode=0o700, exist_ok=True)
            for name, value in data.items():
                if "/" in name or name.startswith("."):
                    continue
                fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(value)
            env["HDFS_SECRET_DIR"] = folder
        if data.get("https-host") and data.get("headers"):
            env[f"{data['https-host']}-headers"] = data["headers"]
        for k in PLAIN_KEYS:
            if data.get(k):
                env[k] = data[k]
    if "AWS_SECRET_ACCESS_KEY" not in env:
        # IRSA-style: the S3 options may sit on the service account alone.
        for option, variables in S3_OPTIONS.items():
            annotated = sa_annotations.get(ANNOTATION_PREFIX + option)
            if annotated:
                for var in variables:
                    env[var] = annotated
    return env


class Credentials:
    """Builds the ``Settings`` of one download; ``reader`` None means no cluster (standalone)."""

    def __init__(self, reader: SecretReader | None, base_env: Mapping[str, str]) -> None:
        self.reader = reader
        self.base_env = dict(base_env)

    @contextlib.contextmanager
    def settings_for(self, info: LocalModelInfo) -> Iterator[Settings]:
        with tempfile.TemporaryDirectory(prefix="modelcache-agent-cred-") as key_dir:
            env = dict(self.base_env)
            if self.reader is not None:
                if info.storage is not None and (info.storage.key or info.storage.parameters):
                    env.update(storage_env(info, self.reader))
                elif info.service_account_name:
                    env.update(service_account_env(info, self.reader, key_dir))
            settings = Settings.from_env(env)
            del env
            yield settings


class KubeSecretReader:
    """Secrets and service accounts of the credentials namespace, read when a download starts."""

    def __init__(self, kube: Any, namespace: str) -> None:
        from modelcache.kube.client import SECRETS, SERVICE_ACCOUNTS

        self.kube, self.namespace = kube, namespace
        self._secrets, self._sas = SECRETS, SERVICE_ACCOUNTS

    def secret(self, name: str) -> dict[str, Any] | None:
        return self.kube.get_or_none(self._secrets, name, self.namespace)

    def service_account(self, name: str) -> dict[str, Any] | None:
        return self.kube.get_or_none(self._sas, name, self.namespace)
