"""Download credentials of one LocalModelNode entry, as KServe would inject them into its Job.

- ``storage``: the ``storage-config`` secret's key (``storage.key``, else ``default_<type>`` when
  the parameters name a type and that key exists, else ``default``) becomes ``STORAGE_CONFIG``,
  and ``storage.parameters`` ``STORAGE_OVERRIDE_CONFIG`` (KServe's storage-spec injection).
- otherwise ``serviceAccountName`` (only when set, as KServe): the secrets attached to that
  service account are read as KServe's credential builder reads them (S3 keys plus the
  ``serving.kserve.io/s3-*`` annotations, the GCS key file, Azure keys, ``https-host`` +
  ``headers``, ``HF_TOKEN``, the HDFS secret's keys as files of a private secret dir).

Tenants (a LocalModelNamespaceCache's entry carries its namespace): the credential namespace is
shared, so a namespace cache may use only what a cluster admin granted to its namespace (the
security review's H3: a tenant named another team's key and sent it to its own endpoint):

- a ServiceAccount (and the Secrets attached to it) with the annotation
  ``modelcache.io/namespaces: "team-a,team-b"`` (or ``"*"``) naming the cache's namespace;
- a key ``K`` of the storage-spec Secret with the annotation ``namespaces.modelcache.io/K`` on
  that Secret, the same way (also the ``default`` key a cache without ``storage.key`` gets);
- and never with ``storage.parameters`` that send the credentials elsewhere or loosen TLS
  (``endpoint_url``, ``ca_bundle``, ``verify_ssl``): ``REDIRECTING_PARAMETERS``, refused for
  namespace caches here and by the cache webhook.

A cluster cache (only cluster admins create those) may use every credential, as in KServe.

The result is an environment *dict* handed to ``Settings.from_env`` for that download only:
the agent's own environment is never read or changed, and nothing here is logged. A GCS key
file is written to a private temporary file that is deleted when the download ends.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from modelcache.errors import AuthError, ModelcacheError
from modelcache.kube.objects import meta
from modelcache.kube.types import LocalModelInfo
from modelcache.sources.credentials import CREDENTIALS_FROM, Settings, redirecting

log = logging.getLogger("agent.credentials")

STORAGE_CONFIG_SECRET = "storage-config"
GCS_KEY_FILE = "gcloud-application-credentials.json"
HDFS_NAMENODE_KEY = "HDFS_NAMENODE"
S3_ACCESS_KEY_NAME = "awsAccessKeyID"
S3_SECRET_KEY_NAME = "awsSecretAccessKey"
ANNOTATION_PREFIX = "serving.kserve.io/"
IRSA_ANNOTATION = "eks.amazonaws.com/role-arn"
#: KServe's ConfigMap (``namespace/name``) whose ``credentials`` block sets cluster-wide defaults.
KSERVE_CONFIG = "kserve/inferenceservice-config"
#: The namespaces whose caches may use a ServiceAccount ("a,b" or "*").
SA_NAMESPACES_ANNOTATION = "modelcache.io/namespaces"
#: Prefix of the annotation, on the storage-spec Secret, naming the namespaces of a key (the suffix).
KEY_NAMESPACES_PREFIX = "namespaces.modelcache.io/"


def granted(annotation: str | None, namespace: str) -> bool:
    """Whether an annotation value ("a,b", "*") names ``namespace``."""
    names = {n.strip() for n in (annotation or "").split(",")}
    return "*" in names or namespace in names




@dataclass(frozen=True)
class S3Option:
    """One S3 setting as KServe's credential builder finds it: the secret's annotation, else a
    secret data key named after the environment variable itself, else ``credentials.s3.<config>``."""

    annotation: str  # after serving.kserve.io/
    env: str  # also the secret data key
    config: str  # key under credentials.s3 of inferenceservice-config


S3_OPTIONS = (
    S3Option("s3-endpoint", "S3_ENDPOINT", "s3Endpoint"),
    S3Option("s3-usehttps", "S3_USE_HTTPS", "s3UseHttps"),
    S3Option("s3-region", "AWS_DEFAULT_REGION", "s3Region"),
    S3Option("s3-verifyssl", "S3_VERIFY_SSL", "s3VerifySSL"),
    S3Option("s3-usevirtualbucket", "S3_USER_VIRTUAL_BUCKET", "s3UseVirtualBucket"),
    S3Option("s3-useaccelerate", "S3_USE_ACCELERATE", "s3UseAccelerate"),
    S3Option("s3-useanoncredential", "awsAnonymousCredential", "s3UseAnonymousCredential"),
    S3Option("s3-cabundle", "AWS_CA_BUNDLE", "s3CABundle"),
)
#: Annotation spellings accepted besides KServe's (both spellings are in use in KServe's docs and users' Secrets).
ANNOTATION_ALIASES = {"s3-verifyssl": ("s3-verify-ssl",)}
#: Secret data keys copied to the same environment variable.
PLAIN_KEYS = (
    "AZ_CLIENT_ID", "AZ_CLIENT_SECRET", "AZ_TENANT_ID", "AZ_SUBSCRIPTION_ID",
    "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_TENANT_ID", "AZURE_SUBSCRIPTION_ID",
    "AZURE_STORAGE_ACCESS_KEY", "AZURE_ACCESS_TOKEN", "HF_TOKEN", "MODELSCOPE_API_TOKEN",
)


@dataclass(frozen=True)
class CredentialConfig:
    """The ``credentials`` block of KServe's ``inferenceservice-config`` (its defaults when absent)."""

    s3: Mapping[str, str] = field(default_factory=dict)
    gcs_credential_file_name: str = GCS_KEY_FILE
    storage_spec_secret_name: str = STORAGE_CONFIG_SECRET

    @property
    def s3_access_key_name(self) -> str:
        return self.s3.get("s3AccessKeyIDName") or S3_ACCESS_KEY_NAME

    @property
    def s3_secret_key_name(self) -> str:
        return self.s3.get("s3SecretAccessKeyName") or S3_SECRET_KEY_NAME

    @classmethod
    def from_config_map(cls, cm: Mapping[str, Any] | None, where: str = KSERVE_CONFIG) -> CredentialConfig:
        raw = ((cm or {}).get("data") or {}).get("credentials")
        if not raw:
            return cls()
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
        except ValueError:
            raise AuthError(f"ConfigMap {where}: its 'credentials' entry is not a JSON object; fix it "
                            "(KServe's controller cannot read it either)") from None
        s3 = {str(k): str(v) for k, v in (doc.get("s3") or {}).items() if v not in (None, "")}
        gcs = doc.get("gcs") or {}
        return cls(s3=s3, gcs_credential_file_name=str(gcs.get("gcsCredentialFileName") or GCS_KEY_FILE),
                   storage_spec_secret_name=str(doc.get("storageSpecSecretName") or STORAGE_CONFIG_SECRET))


class SecretReader(Protocol):
    def secret(self, name: str) -> dict[str, Any] | None: ...
    def service_account(self, name: str) -> dict[str, Any] | None: ...
    def credential_config(self) -> CredentialConfig: ...


def secret_bytes(secret: Mapping[str, Any]) -> dict[str, bytes]:
    """A Secret's values as the kubelet would mount them: raw bytes (a keytab is not text)."""
    out = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    out.update({k: str(v).encode() for k, v in (secret.get("stringData") or {}).items()})
    return out


def secret_data(secret: Mapping[str, Any]) -> dict[str, str]:
    """Text values (env variables); a value that is not UTF-8 is kept out rather than failing all."""
    out: dict[str, str] = {}
    for k, v in secret_bytes(secret).items():
        with contextlib.suppress(UnicodeDecodeError):
            out[k] = v.decode("utf-8")
    return out


def _annotations(obj: Mapping[str, Any] | None) -> dict[str, str]:
    return dict(meta(obj).annotations)


def storage_env(info: LocalModelInfo, reader: SecretReader, config: CredentialConfig | None = None) -> dict[str, str]:
    """``STORAGE_CONFIG`` / ``STORAGE_OVERRIDE_CONFIG`` for an entry with ``storage``."""
    assert info.storage is not None
    config = config or CredentialConfig()
    name = config.storage_spec_secret_name
    params = dict(info.storage.parameters or {})
    secret = reader.secret(name)
    if secret is None:
        raise AuthError(f"model {info.status_key}: secret '{name}' not found in the credentials "
                        "namespace; create it or drop the entry's storage field")
    data = secret_data(secret)
    key = _spec_key(info, data)
    if info.namespace:
        _tenant_may_use_key(info, name, key if key in data else None, secret)
    env: dict[str, str] = {}
    if key in data:
        env["STORAGE_CONFIG"] = data[key]
    elif not params:
        raise AuthError(f"model {info.status_key}: secret '{name}' has no key '{key}'; "
                        "add it or set storage.key to an existing key")
    if params:
        env["STORAGE_OVERRIDE_CONFIG"] = json.dumps(params)
    return env


def _spec_key(info: LocalModelInfo, data: Mapping[str, str]) -> str:
    """The storage-spec Secret's key an entry reads: ``storage.key``, else ``default_<type>`` when the
    parameters name a type and that key exists, else ``default`` (KServe's)."""
    assert info.storage is not None
    if info.storage.key:
        return info.storage.key
    params = info.storage.parameters or {}
    typed = f"default_{params['type']}" if params.get("type") else ""
    return typed if typed in data else "default"


def _tenant_may_use_account(info: LocalModelInfo, name: str, sa: Mapping[str, Any]) -> None:
    if info.namespace and not granted(_annotations(sa).get(SA_NAMESPACES_ANNOTATION), info.namespace):
        raise AuthError(f"model {info.status_key}: service account '{name}' is not granted to namespace "
                        f"{info.namespace}; a cluster admin grants it with the annotation {SA_NAMESPACES_ANNOTATION}: "
                        f"\"{info.namespace}\" on that ServiceAccount in the credentials namespace")


def _tenant_may_use_key(info: LocalModelInfo, secret_name: str, key: str | None, secret: Mapping[str, Any]) -> None:
    """Refuse a namespace cache's redirecting parameters, and a key (None: none of the Secret's
    is used) not granted to its namespace."""
    ns = str(info.namespace)
    params = dict(info.storage.parameters or {}) if info.storage else {}
    if bad := redirecting(params):
        raise AuthError(f"model {info.status_key}: a LocalModelNamespaceCache may not set storage.parameters "
                        f"{', '.join(bad)} (they would send the credentials of Secret '{secret_name}' elsewhere); "
                        "put the endpoint in the Secret's key, or use a LocalModelCache")
    if key is not None and not granted(_annotations(secret).get(KEY_NAMESPACES_PREFIX + key), ns):
        raise AuthError(f"model {info.status_key}: key '{key}' of Secret '{secret_name}' is not granted to namespace "
                        f"{ns}; a cluster admin grants it with the annotation {KEY_NAMESPACES_PREFIX}{key}: \"{ns}\" "
                        f"on that Secret in the credentials namespace")


def s3_env(annotations: Mapping[str, str], data: Mapping[str, str] | None, config: CredentialConfig,
           fallback_annotations: Mapping[str, str] | None = None) -> dict[str, str]:
    """S3 settings by KServe's precedence: annotation, secret data key, ``credentials.s3``.

    ``fallback_annotations`` (an IRSA service account's) fill only what the secret and the config
    leave unset: KServe builds them first and lets the secret's settings, config defaults
    included, override them (``utils.MergeEnvs``, service_account_credentials.go).
    """
    def annotated(source: Mapping[str, str], opt: S3Option) -> str | None:
        for name in (opt.annotation, *ANNOTATION_ALIASES.get(opt.annotation, ())):
            if ANNOTATION_PREFIX + name in source:
                return source[ANNOTATION_PREFIX + name]
        return None

    def value(opt: S3Option) -> str:
        found = annotated(annotations, opt)
        if found is None and data is not None and opt.env in data:
            found = data[opt.env]
        if found is None and opt.config in config.s3:
            found = config.s3[opt.config]
        if found is None and fallback_annotations is not None:
            found = annotated(fallback_annotations, opt)
        return found or ""

    env: dict[str, str] = {}
    values = {opt.env: value(opt).strip() for opt in S3_OPTIONS}
    endpoint = values.pop("S3_ENDPOINT")
    use_https = values.pop("S3_USE_HTTPS")
    if endpoint:
        # KServe: a scheme on the endpoint decides S3_USE_HTTPS; else S3_USE_HTTPS "0" means
        # http and anything else https. AWS_ENDPOINT_URL is what the download reads.
        lower = endpoint.lower()
        if lower.startswith(("https://", "http://")):
            use_https = "1" if lower.startswith("https://") else "0"
            host, url = endpoint.split("://", 1)[1], endpoint
        else:
            host, url = endpoint, ("http://" if use_https == "0" else "https://") + endpoint
        if use_https:
            env["S3_USE_HTTPS"] = use_https
        env["S3_ENDPOINT"], env["AWS_ENDPOINT_URL"] = host, url
    env.update({k: v for k, v in values.items() if v})
    return env


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def service_account_env(info: LocalModelInfo, reader: SecretReader, key_dir: str,
                        config: CredentialConfig | None = None, found: list[str] | None = None) -> dict[str, str]:
    """``found``: the names of the Secrets read are appended to it (what an auth error names)."""
    config = config or CredentialConfig()
    name = info.service_account_name or "default"
    sa = reader.service_account(name)
    if sa is None:
        raise AuthError(f"model {info.status_key}: service account '{name}' not found in the credentials namespace")
    sa_annotations = _annotations(sa)
    irsa = IRSA_ANNOTATION in sa_annotations
    _tenant_may_use_account(info, name, sa)
    env: dict[str, str] = {}
    for ref in sa.get("secrets") or []:
        secret = reader.secret(str(ref.get("name", "")))
        if secret is None:
            continue  # KServe skips (and logs) a missing secret
        if found is not None:
            found.append(str(ref.get("name", "")))
        raw = secret_bytes(secret)
        data = secret_data(secret)
        if config.s3_secret_key_name in data:
            env["AWS_ACCESS_KEY_ID"] = data.get(config.s3_access_key_name, "")
            env["AWS_SECRET_ACCESS_KEY"] = data[config.s3_secret_key_name]
            env.update(s3_env(_annotations(secret), data, config, sa_annotations if irsa else None))
        if config.gcs_credential_file_name in raw:
            path = os.path.join(key_dir, GCS_KEY_FILE)
            _write_private(path, raw[config.gcs_credential_file_name])
            env["GOOGLE_APPLICATION_CREDENTIALS"] = path
        if data.get(HDFS_NAMENODE_KEY):
            # KServe mounts such a secret at /var/secrets/kserve-hdfscreds: one file per key, its
            # bytes as stored (a keytab is binary).
            folder = os.path.join(key_dir, "hdfs")
            os.makedirs(folder, mode=0o700, exist_ok=True)
            for key, value in raw.items():
                if "/" in key or key.startswith("."):
                    continue
                _write_private(os.path.join(folder, key), value)
            env["HDFS_SECRET_DIR"] = folder
        if data.get("https-host") and data.get("headers"):
            env[f"{data['https-host']}-headers"] = data["headers"]
        for k in PLAIN_KEYS:
            if data.get(k):
                env[k] = data[k]
    if "AWS_SECRET_ACCESS_KEY" not in env and irsa:
        # IRSA: no static keys; the S3 settings come from the service account and the config.
        # (KServe reads a service account's s3-* annotations only when it has the IRSA one.)
        env.update(s3_env(sa_annotations, None, config))
    return env


def _named(info: LocalModelInfo) -> tuple[str | None, Any]:
    """The credentials an entry names (what the agent would download it with)."""
    storage = info.storage
    spec = None if storage is None else (storage.key or None, dict(storage.parameters or {}) or None)
    return info.service_account_name or None, spec if spec != (None, None) else None


def shared_folder_refusal(info: LocalModelInfo, primary: LocalModelInfo) -> str | None:
    """Why a namespace cache's entry may not use a model folder it shares with ``primary`` (the entry
    whose credentials download it: caches of one URI share one folder, KServe's contract): it names
    other credentials. Otherwise a tenant could name the URI of someone's private model, with no
    credentials or its own, and read the folder downloaded with theirs."""
    if not info.namespace or info is primary or _named(info) == _named(primary):
        return None
    return (f"model {info.status_key}: its URI is also cached with other credentials on this node; a "
            "LocalModelNamespaceCache shares that folder only when it names the same serviceAccountName and "
            "storage (granted to its namespace): name those, or cache another URI")


#: The two spellings of an S3 Secret's keys in use with KServe: its code's default (what applies
#: without the ``inferenceservice-config`` ConfigMap, i.e. no KServe installed) and what KServe's
#: shipped ConfigMap sets.
S3_KEY_SPELLINGS = ((S3_ACCESS_KEY_NAME, S3_SECRET_KEY_NAME), ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))


def misnamed_s3_keys(info: LocalModelInfo, reader: SecretReader, config: CredentialConfig) -> str | None:
    """What to say when a Secret of the entry's service account holds S3 keys under the other
    spelling than the credentials config reads, else None.

    KServe skips such a Secret silently (its endpoint annotations too), and so do we: a node's
    instance role or EKS Pod Identity may be what the user relies on. But when the download then
    fails, this names the cause (seen on real nodes: a Secret written for KServe's shipped
    ConfigMap, on a cluster without KServe, failed with "no AWS credentials")."""
    name = info.service_account_name or "default"
    sa = reader.service_account(name)
    if sa is None or IRSA_ANNOTATION in _annotations(sa):
        return None
    for ref in sa.get("secrets") or []:
        secret = reader.secret(str(ref.get("name", "")))
        data = secret_data(secret) if secret is not None else {}
        if config.s3_secret_key_name in data:
            return None  # read as configured
        for access, secret_key in S3_KEY_SPELLINGS:
            if secret_key in data and secret_key != config.s3_secret_key_name:
                origin = (f"ConfigMap {KSERVE_CONFIG}'s credentials.s3" if "s3SecretAccessKeyName" in config.s3
                          else f"KServe's default: ConfigMap {KSERVE_CONFIG} sets no credentials.s3")
                return (f"Secret '{ref.get('name')}' of service account '{name}' holds its S3 keys as "
                        f"{access}/{secret_key}, but the credentials config reads "
                        f"{config.s3_access_key_name}/{config.s3_secret_key_name} ({origin}), so it was skipped "
                        "as KServe skips it: rename the Secret's keys or set s3AccessKeyIDName/"
                        "s3SecretAccessKeyName there")
    return None


def with_hint(exc: ModelcacheError, hint: str) -> ModelcacheError:
    """``exc`` (same class and attributes, so retries behave the same) with ``hint`` appended."""
    out = copy.copy(exc)
    out.args = (f"{exc}; {hint}",)
    return out


class Credentials:
    """Builds the ``Settings`` of one download; ``reader`` None means no cluster (standalone)."""

    def __init__(self, reader: SecretReader | None, base_env: Mapping[str, str]) -> None:
        self.reader = reader
        self.base_env = dict(base_env)

    def entry_refusal(self, info: LocalModelInfo, primary: LocalModelInfo) -> str | None:
        """Why a namespace cache's entry may not be served the model its record holds: it names
        other credentials than the entry that downloads it, or credentials not granted to its
        namespace (checked on the objects' metadata; nothing is read from a Secret's data)."""
        if not info.namespace or self.reader is None:
            return None
        if why := shared_folder_refusal(info, primary):
            return why
        try:
            grant_check(info, self.reader)
        except AuthError as exc:
            return str(exc)
        return None

    @contextlib.contextmanager
    def env_for(self, info: LocalModelInfo) -> Iterator[dict[str, str]]:
        """The download's environment (credential files in a private folder while it is open)."""
        with tempfile.TemporaryDirectory(prefix="modelcache-agent-cred-") as key_dir:
            env = dict(self.base_env)
            where = "the agent's environment and --download-env"
            hint = None
            if self.reader is not None:
                ns = getattr(self.reader, "namespace", "?")
                if info.storage is not None and (info.storage.key or info.storage.parameters):
                    config = self.reader.credential_config()
                    env.update(storage_env(info, self.reader, config))
                    where = (f"Secret {ns}/{config.storage_spec_secret_name}"
                             + (f" key '{info.storage.key}'" if info.storage.key else "") + " (the entry's storage)")
                elif info.service_account_name:
                    found: list[str] = []
                    config = self.reader.credential_config()
                    env.update(service_account_env(info, self.reader, key_dir, config, found))
                    secrets = ", ".join(f"{ns}/{n}" for n in found) or "(none)"
                    where = (f"Secret{'s' if len(found) != 1 else ''} {secrets} of ServiceAccount "
                             f"{ns}/{info.service_account_name}")
                    if "AWS_SECRET_ACCESS_KEY" not in env:
                        hint = misnamed_s3_keys(info, self.reader, config)
                else:
                    where += " (the entry names no serviceAccountName or storage)"
            env[CREDENTIALS_FROM] = where
            try:
                yield env
            except ModelcacheError as exc:
                if hint is None:
                    raise
                raise with_hint(exc, hint) from exc
            finally:
                env.clear()

    @contextlib.contextmanager
    def settings_for(self, info: LocalModelInfo) -> Iterator[Settings]:
        with self.env_for(info) as env:
            yield Settings.from_env(env)


class KubeSecretReader:
    """Secrets and service accounts of the credentials namespace, and KServe's credential
    defaults, read when a download starts."""

    def __init__(self, kube: Any, namespace: str, kserve_config: str = KSERVE_CONFIG) -> None:
        from modelcache.kube.client import SECRETS, SERVICE_ACCOUNTS

        self.kube, self.namespace = kube, namespace
        self._secrets, self._sas = SECRETS, SERVICE_ACCOUNTS
        self.kserve_config = kserve_config

    def credential_config(self) -> CredentialConfig:
        """KServe's ``credentials`` block; its defaults when the ConfigMap is not there (no KServe
        installed) or not readable (our RBAC names it: another name needs a grant)."""
        from kubernetes.client.exceptions import ApiException

        from modelcache.kube.client import CONFIG_MAPS

        namespace, _, name = self.kserve_config.rpartition("/")
        try:
            cm = self.kube.get_or_none(CONFIG_MAPS, name, namespace or "kserve")
        except ApiException as exc:
            if exc.status != 403:
                raise
            log.warning("cannot read ConfigMap %s (forbidden): KServe's credential defaults are not applied",
                        self.kserve_config)
            cm = None
        return CredentialConfig.from_config_map(cm, self.kserve_config)

    def secret(self, name: str) -> dict[str, Any] | None:
        return self.kube.get_or_none(self._secrets, name, self.namespace)

    def service_account(self, name: str) -> dict[str, Any] | None:
        return self.kube.get_or_none(self._sas, name, self.namespace)


def grant_check(info: LocalModelInfo, reader: SecretReader) -> None:
    """Raise AuthError when a namespace cache's entry names credentials not granted to its
    namespace (the rule storage_env and service_account_env apply, without building anything)."""
    if not info.namespace:
        return
    if info.storage is not None and (info.storage.key or info.storage.parameters):
        name = reader.credential_config().storage_spec_secret_name
        secret = reader.secret(name)
        if secret is None:
            raise AuthError(f"model {info.status_key}: secret '{name}' not found in the credentials namespace")
        key = _spec_key(info, secret_data(secret))
        _tenant_may_use_key(info, name, key if key in secret_data(secret) else None, secret)
    elif info.service_account_name:
        sa = reader.service_account(info.service_account_name)
        if sa is None:
            raise AuthError(f"model {info.status_key}: service account '{info.service_account_name}' not found "
                            "in the credentials namespace")
        _tenant_may_use_account(info, info.service_account_name, sa)
