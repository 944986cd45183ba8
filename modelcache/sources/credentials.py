"""Turn the environment (KServe's initializer contract) into per-backend settings.

This is the only module that reads ``os.environ``; sources get a ``Settings`` and never look
at the environment themselves, so the agent can build settings per download from a secret
without touching its own process environment. Values here may be secrets: ``Settings`` has a
redacting ``repr`` and nothing here logs.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

from modelcache.errors import ModelcacheError
from modelcache.sources.cabundle import ca_bundle_from_env, configured_ca_bundle, merged_ca_bundle

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

    @property
    def requests_verify(self) -> bool | str:
        """``verify=`` for requests-based clients: a custom CA is trusted *besides* the public ones."""
        if not self.verify:
            return False
        return merged_ca_bundle(self.ca_bundle) if self.ca_bundle else True

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


DEFAULT_HF_ENDPOINT = "https://huggingface.co"


@dataclass(frozen=True)
class HFSettings:
    """Hugging Face Hub: ``HF_TOKEN`` (KServe's initializer) and ``HF_ENDPOINT`` (a mirror or test Hub)."""

    token: str | None = field(default=None, repr=False)
    endpoint: str = DEFAULT_HF_ENDPOINT


#: Set by the agent in a download's environment: where its credentials come from (one line).
CREDENTIALS_FROM = "MODELCACHE_CREDENTIALS_FROM"


@dataclass(frozen=True)
class Settings:
    """The environment snapshot of one pull, and each backend's settings built from it on first
    use, by the factory its line in ``modelcache.sources.backends`` names: an S3 pull parses no HDFS
    secret dir and writes no HDFS spec folder, and one backend's bad settings (a storage spec's
    undecodable GCS key) fail only pulls from that backend. HTTP settings (timeouts, CA bundle,
    per-host headers) are every backend's transport and are built at once."""

    http: HTTPSettings = field(default_factory=HTTPSettings)
    allow_patterns: tuple[str, ...] = ()
    ignore_patterns: tuple[str, ...] = ()
    #: List a checksum no one can forge (md5 or better) where the source has one beside a CRC: set
    #: by a pull with peer transfer, where the file checksum settles what other nodes sent (a CRC
    #: would not: whoever knows the file can make other bytes with its CRC). Costs ~1.2 CPU-s/GiB.
    forgery_proof: bool = False
    #: The environment snapshot these settings were built from, for backends that read more.
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: Where this download's credentials come from, when not from the process's environment (the
    #: agent's Secret of a ServiceAccount, its storage-config key): what an auth error names.
    credentials_from: str = ""
    #: Backend settings built so far, by kind (a pull's threads share one Settings: built once).
    _built: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __repr__(self) -> str:
        return f"Settings(http={self.http!r}, built={sorted(self._built)})"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        apply_storage_spec(env)  # a broken STORAGE_CONFIG is every pull's error, said at once
        return cls(
            http=_http_settings(env),
            allow_patterns=parse_patterns(env.get("STORAGE_ALLOW_PATTERNS")),
            ignore_patterns=parse_patterns(env.get("STORAGE_IGNORE_PATTERNS")),
            env=env,
            credentials_from=env.get(CREDENTIALS_FROM, ""),
        )

    def for_kind(self, kind: str) -> object:
        """The settings of backend ``kind``, built from ``env`` by its registry line's factory."""
        with self._lock:
            if kind not in self._built:
                from modelcache.sources import backends

                factory = backends.BACKENDS[kind].settings
                if not factory:
                    raise ModelcacheError(f"the {kind} backend has no settings of its own (its line names none)")
                self._built[kind] = backends.load(factory)(self.env)
            return self._built[kind]

    @property
    def s3(self) -> S3Settings:
        return cast(S3Settings, self.for_kind("s3"))

    @property
    def gcs(self) -> GCSSettings:
        return cast(GCSSettings, self.for_kind("gcs"))

    @property
    def azure(self) -> AzureSettings:
        return cast(AzureSettings, self.for_kind("azure"))

    @property
    def hdfs(self) -> HDFSSettings:
        return cast(HDFSSettings, self.for_kind("hdfs"))

    @property
    def hf(self) -> HFSettings:
        return cast(HFSettings, self.for_kind("hf"))

    @property
    def oci(self) -> OCISettings:
        return cast(OCISettings, self.for_kind("oci"))

    @property
    def local(self) -> LocalSettings:
        return cast(LocalSettings, self.for_kind("local"))

    def credentials_hint(self, variables: str) -> str:
        """What an auth error tells the user to check: where the credentials came from, or the
        environment ``variables`` (and the storage-spec secret) where they come from the process."""
        return f"check {self.credentials_from}" if self.credentials_from else f"check {variables}"


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


_HDFS_SPEC_DIRS: dict[str, str] = {}


def hdfs_spec_dir(env: Mapping[str, str]) -> str | None:
    """KServe's storage spec of ``type`` hdfs/webhdfs: each key written to a file of a private
    secret dir, used instead of HDFS_SECRET_DIR (``_update_with_storage_spec``). One dir per
    distinct spec, so repeated calls do not pile up temp dirs."""
    spec = storage_spec(env)
    if str(spec.get("type", "")).lower() not in ("hdfs", "webhdfs"):
        return None
    import atexit
    import hashlib
    import shutil
    import tempfile

    fingerprint = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    folder = _HDFS_SPEC_DIRS.get(fingerprint)
    if folder and os.path.isdir(folder):
        return folder
    import base64
    import binascii

    files: dict[str, bytes] = {}
    for key, value in spec.items():
        if key == "type" or "/" in key or key.startswith("."):
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        if key in _HDFS_FILE_SECRETS:
            # As KServe: keys that are files (certificates, the keytab) are base64 in the JSON.
            try:
                files[key] = base64.b64decode(text, validate=True)
            except binascii.Error as exc:
                raise ModelcacheError(
                    f"storage-spec secret (STORAGE_CONFIG, type {spec.get('type')}): {key} is not base64; "
                    f"encode the file (base64 -w0 FILE) as KServe expects"
                ) from exc
        else:
            files[key] = text.encode("utf-8")
    folder = tempfile.mkdtemp(prefix="modelcache-hdfs-spec-")
    # It may hold a keytab: gone when the process ends (the agent keeps it while it runs).
    atexit.register(shutil.rmtree, folder, True)
    for key, data in files.items():
        fd = os.open(os.path.join(folder, key), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    _HDFS_SPEC_DIRS[fingerprint] = folder
    return folder


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


# --- Each backend's settings from the environment: the factories the registry lines name -------


def local_from_env(env: Mapping[str, str]) -> LocalSettings:
    return LocalSettings(pvc_root=env.get("MODELCACHE_PVC_ROOT", DEFAULT_PVC_ROOT))


def oci_from_env(env: Mapping[str, str]) -> OCISettings:
    return OCISettings(
        docker_config=env.get("KSERVE_OCI_DOCKER_CONFIG") or DEFAULT_OCI_DOCKER_CONFIG,
        insecure=(env.get("KSERVE_OCI_INSECURE_REGISTRY") or "").strip().lower() in ("1", "true", "yes"),
    )


def hdfs_from_env(env: Mapping[str, str]) -> HDFSSettings:
    return hdfs_settings(hdfs_spec_dir(env) or env.get("HDFS_SECRET_DIR") or DEFAULT_HDFS_SECRET_DIR)


def hf_from_env(env: Mapping[str, str]) -> HFSettings:
    return HFSettings(
        token=(env.get("HF_TOKEN") or "").strip() or None,
        endpoint=(env.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/"),
    )


def s3_from_env(env: Mapping[str, str]) -> S3Settings:
    return _s3_settings(apply_storage_spec(env))


def gcs_from_env(env: Mapping[str, str]) -> GCSSettings:
    return _gcs_settings(apply_storage_spec(env), storage_spec(env))


def azure_from_env(env: Mapping[str, str]) -> AzureSettings:
    return _azure_settings(apply_storage_spec(env))


# --- Object stores (S3, GCS, Azure Blob) -----------------------------------------------------
#
# KServe's initializer reads these variables; its controller sets some more from the secret's
# annotations (serving.kserve.io/s3-endpoint -> S3_ENDPOINT + AWS_ENDPOINT_URL, s3-usehttps ->
# S3_USE_HTTPS, s3-region -> AWS_DEFAULT_REGION, s3-verifyssl -> S3_VERIFY_SSL,
# s3-usevirtualbucket -> S3_USER_VIRTUAL_BUCKET, s3-useaccelerate -> S3_USE_ACCELERATE,
# s3-useanoncredential -> awsAnonymousCredential, s3-cabundle -> AWS_CA_BUNDLE). The storage
# spec secret (STORAGE_CONFIG, overridden key by key by STORAGE_OVERRIDE_CONFIG) is applied on
# top of the environment, as KServe's `_update_with_storage_spec` does.

# storage-spec key -> environment variable, per spec `type`.
_SPEC_ENV: dict[str, dict[str, str]] = {
    "s3": {
        "endpoint_url": "AWS_ENDPOINT_URL",
        "access_key_id": "AWS_ACCESS_KEY_ID",
        "secret_access_key": "AWS_SECRET_ACCESS_KEY",
        "session_token": "AWS_SESSION_TOKEN",
        "region": "AWS_DEFAULT_REGION",
        "ca_bundle": "AWS_CA_BUNDLE",
        "verify_ssl": "S3_VERIFY_SSL",
        "anonymous": "awsAnonymousCredential",
    },
    "gs": {"project": "GOOGLE_CLOUD_PROJECT", "endpoint_url": "STORAGE_EMULATOR_HOST"},
    "azure": {
        "account_key": "AZURE_STORAGE_ACCESS_KEY",
        "access_key": "AZURE_STORAGE_ACCESS_KEY",
        "client_id": "AZURE_CLIENT_ID",
        "client_secret": "AZURE_CLIENT_SECRET",
        "tenant_id": "AZURE_TENANT_ID",
        "subscription_id": "AZURE_SUBSCRIPTION_ID",
    },
}
_SPEC_TYPE_ALIASES = {"gcs": "gs", "azure_blob": "azure", "azureblob": "azure"}
#: Storage-spec keys that decide where credentials go and whom they trust: a tenant laying them over
#: credentials someone else owns (a LocalModelNamespaceCache's storage.parameters) could send those
#: to its own server (security review H3). Refused there by the cache webhook and the agent.
REDIRECTING_PARAMETERS = ("endpoint_url", "ca_bundle", "verify_ssl")


def redirecting(parameters: Mapping[str, object] | None) -> list[str]:
    """The keys of ``parameters`` (a storage spec's) among :data:`REDIRECTING_PARAMETERS`."""
    return sorted(k for k in parameters or {} if k.lower() in REDIRECTING_PARAMETERS)


def _load_json_object(env: Mapping[str, str], name: str) -> dict[str, object]:
    text = env.get(name, "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        # Never echo the value: it is a secret.
        raise ModelcacheError(
            f"environment variable '{name}' is not valid JSON (line {exc.lineno} column {exc.colno}); "
            "it must be the storage-spec secret as a JSON object"
        ) from None
    if not isinstance(value, dict):
        raise ModelcacheError(f"environment variable '{name}' must be a JSON object (the storage-spec secret)")
    return value


def storage_spec(env: Mapping[str, str]) -> dict[str, object]:
    """STORAGE_CONFIG with STORAGE_OVERRIDE_CONFIG's keys laid over it (KServe's precedence)."""
    spec = _load_json_object(env, "STORAGE_CONFIG")
    spec.update(_load_json_object(env, "STORAGE_OVERRIDE_CONFIG"))
    return spec


def _spec_str(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def apply_storage_spec(env: Mapping[str, str]) -> dict[str, str]:
    """The environment as the object-store settings see it: spec values win over plain env."""
    out = dict(env)
    spec = storage_spec(env)
    kind = str(spec.get("type", "")).strip().lower()
    kind = _SPEC_TYPE_ALIASES.get(kind, kind)
    for key, var in _SPEC_ENV.get(kind, {}).items():
        if key in spec and spec[key] is not None:
            out[var] = _spec_str(spec[key])
    return out


@dataclass(frozen=True)
class S3Settings:
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    endpoint_url: str | None = None
    region: str | None = None
    #: False turns TLS verification off (S3_VERIFY_SSL=0/false).
    verify: bool = True
    ca_bundle: str | None = None
    anonymous: bool = False
    virtual_addressing: bool = False
    use_accelerate: bool = False
    connect_timeout: float = 15.0
    read_timeout: float = 30.0
    max_attempts: int = 3

    @property
    def has_static_keys(self) -> bool:
        return bool(self.access_key_id and self.secret_access_key)

    @property
    def secrets(self) -> tuple[str, ...]:
        return tuple(s for s in (self.access_key_id, self.secret_access_key, self.session_token) if s)


def _s3_endpoint(env: Mapping[str, str]) -> str | None:
    """AWS_ENDPOINT_URL, else S3_ENDPOINT with the scheme S3_USE_HTTPS picks (default https).

    KServe's controller sets S3_ENDPOINT/S3_USE_HTTPS from the secret annotations but its Python
    ignores them; honouring them fixes a secret that only carries the annotations.
    """
    url = env.get("AWS_ENDPOINT_URL", "").strip()
    if url:
        return url
    host = env.get("S3_ENDPOINT", "").strip()
    if not host:
        return None
    if host.startswith(("http://", "https://")):
        return host
    scheme = "https" if _truthy(env.get("S3_USE_HTTPS"), default=True) else "http"
    return f"{scheme}://{host}"


def _s3_settings(env: Mapping[str, str]) -> S3Settings:
    verify_raw = env.get("S3_VERIFY_SSL", "").strip().lower()
    verify = verify_raw not in ("0", "false", "no", "off")
    ca_bundle = env.get("AWS_CA_BUNDLE") or None
    if verify and not ca_bundle:
        ca_bundle = configured_ca_bundle(env)  # KServe: a missing file fails S3 (only), at its first use
    return S3Settings(
        access_key_id=env.get("AWS_ACCESS_KEY_ID") or None,
        secret_access_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
        session_token=env.get("AWS_SESSION_TOKEN") or None,
        endpoint_url=_s3_endpoint(env),
        region=env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION") or None,
        verify=verify,
        ca_bundle=ca_bundle if verify else None,
        anonymous=_truthy(env.get("awsAnonymousCredential")),
        virtual_addressing=_truthy(env.get("S3_USER_VIRTUAL_BUCKET")),
        use_accelerate=_truthy(env.get("S3_USE_ACCELERATE")),
        connect_timeout=float(env.get("S3_CONNECT_TIMEOUT") or 15),
        read_timeout=float(env.get("S3_READ_TIMEOUT") or 30),
        max_attempts=int(env.get("S3_MAX_ATTEMPTS") or 3),
    )


@dataclass(frozen=True)
class GCSSettings:
    #: GOOGLE_APPLICATION_CREDENTIALS: a service-account (or other google-auth) JSON file.
    credentials_file: str | None = None
    #: A service-account key from the storage-spec secret (``base64_service_account``).
    service_account_info: Mapping[str, object] | None = field(default=None, repr=False)
    #: STORAGE_EMULATOR_HOST: talk to an emulator, anonymously.
    emulator_host: str | None = None
    #: MODELCACHE_GCS_ENDPOINT: another endpoint with real credentials (Private Service Connect,
    #: a proxy); None means storage.googleapis.com.
    endpoint: str | None = None
    project: str | None = None
    #: How long the SDK may retry a listing call on connection errors (seconds).
    retry_deadline: float = 60.0
    connect_timeout: float = 15.0
    read_timeout: float = 60.0

    @property
    def secrets(self) -> tuple[str, ...]:
        info = self.service_account_info or {}
        return tuple(str(info[k]) for k in ("private_key", "private_key_id") if info.get(k))


def _gcs_settings(env: Mapping[str, str], spec: Mapping[str, object]) -> GCSSettings:
    info: Mapping[str, object] | None = None
    kind = _SPEC_TYPE_ALIASES.get(str(spec.get("type", "")).lower(), str(spec.get("type", "")).lower())
    if kind == "gs":
        raw = spec.get("base64_service_account") or spec.get("service_account_json")
        if raw:
            import base64
            import binascii

            text = str(raw)
            try:
                if "base64_service_account" in spec:
                    text = base64.b64decode(text, validate=False).decode("utf-8")
                parsed = json.loads(text)
            except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError):
                raise ModelcacheError(
                    "storage-spec secret (STORAGE_CONFIG, type gs): base64_service_account is not a "
                    "base64-encoded service-account JSON key"
                ) from None
            if not isinstance(parsed, dict):
                raise ModelcacheError("storage-spec secret (type gs): the service account must be a JSON object")
            info = parsed
    emulator = env.get("STORAGE_EMULATOR_HOST", "").strip() or None
    if emulator and not emulator.startswith(("http://", "https://")):
        emulator = f"http://{emulator}"
    return GCSSettings(
        credentials_file=env.get("GOOGLE_APPLICATION_CREDENTIALS") or None,
        service_account_info=info,
        emulator_host=emulator,
        endpoint=(env.get("MODELCACHE_GCS_ENDPOINT") or "").strip().rstrip("/") or None,
        project=env.get("GOOGLE_CLOUD_PROJECT") or env.get("GCLOUD_PROJECT") or None,
        retry_deadline=float(env.get("MODELCACHE_GCS_RETRY_DEADLINE") or 60),
        connect_timeout=float(env.get("MODELCACHE_CONNECT_TIMEOUT") or 15),
        read_timeout=float(env.get("MODELCACHE_READ_TIMEOUT") or 60),
    )


@dataclass(frozen=True)
class AzureSettings:
    access_key: str | None = field(default=None, repr=False)
    client_id: str | None = None
    client_secret: str | None = field(default=None, repr=False)
    tenant_id: str | None = None
    #: AZURE_ACCESS_TOKEN: a bearer token KServe's controller may inject.
    access_token: str | None = field(default=None, repr=False)
    federated_token_file: str | None = None
    #: AZURE_AUTHORITY_HOST: the Azure AD endpoint (sovereign clouds); None means the public cloud.
    authority_host: str | None = None
    #: Account URL template, e.g. ``http://127.0.0.1:10000/{account}`` for Azurite or a private
    #: endpoint (MODELCACHE_AZURE_BLOB_ENDPOINT); None means the URI's own host.
    endpoint_template: str | None = None
    connect_timeout: float = 15.0
    read_timeout: float = 60.0
    retry_total: int = 3

    @property
    def use_default_credential(self) -> bool:
        """KServe: DefaultAzureCredential when AZURE_CLIENT_ID is set (after the AZ_* mapping)."""
        return bool(self.client_id)

    @property
    def secrets(self) -> tuple[str, ...]:
        return tuple(s for s in (self.access_key, self.client_secret, self.access_token) if s)


def _azure_settings(env: Mapping[str, str]) -> AzureSettings:
    def get(name: str) -> str | None:
        # Legacy AZ_* names (KServe copies them to AZURE_* before building the credential).
        return env.get(f"AZURE_{name}") or env.get(f"AZ_{name}") or None

    return AzureSettings(
        access_key=env.get("AZURE_STORAGE_ACCESS_KEY") or None,
        client_id=get("CLIENT_ID"),
        client_secret=get("CLIENT_SECRET"),
        tenant_id=get("TENANT_ID"),
        access_token=env.get("AZURE_ACCESS_TOKEN") or None,
        federated_token_file=env.get("AZURE_FEDERATED_TOKEN_FILE") or None,
        authority_host=env.get("AZURE_AUTHORITY_HOST") or None,
        endpoint_template=env.get("MODELCACHE_AZURE_BLOB_ENDPOINT") or None,
        connect_timeout=float(env.get("MODELCACHE_CONNECT_TIMEOUT") or 15),
        read_timeout=float(env.get("MODELCACHE_READ_TIMEOUT") or 60),
        retry_total=int(env.get("MODELCACHE_AZURE_RETRY_TOTAL") or 3),
    )
