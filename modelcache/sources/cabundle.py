"""The custom CA bundle: where the environment names it (KServe's ConfigMap mount or
``MODELCACHE_CA_BUNDLE``) and the merged file every backend trusts besides the public CAs.

Apart from ``credentials.py`` (which builds each backend's settings from it) because the
initializer merges the bundle before any settings exist, and the merge owns a private folder.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from modelcache.errors import ModelcacheError

DEFAULT_CA_BUNDLE_MOUNT = "/etc/ssl/custom-certs"

_SYSTEM_CA_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
_merged_bundles: dict[tuple[str, int], str] = {}


def _bundle_dir() -> str:
    """``<tmp>/modelcache-ca-<uid>``: ours alone (0700, owned by us), else a fresh private one."""
    import stat
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"modelcache-ca-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return tempfile.mkdtemp(prefix="modelcache-ca-")
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return tempfile.mkdtemp(prefix="modelcache-ca-")  # not ours to trust: never reuse it
    return folder


def merged_ca_bundle(custom: str) -> str:
    """KServe merges ``cabundle.crt`` with the system and certifi bundles, so the custom CA is
    trusted in addition to the public ones; we do the same, in a private file named after its
    content: every process (each initializer run, each agent start) that merges the same
    bundles reuses one file instead of leaving another in the temp folder."""
    import hashlib

    try:
        key = (custom, os.stat(custom).st_mtime_ns)
    except OSError as exc:
        raise ModelcacheError(f"cannot read the CA bundle '{custom}': {exc.strerror}") from exc
    if key in _merged_bundles and os.path.exists(_merged_bundles[key]):
        return _merged_bundles[key]
    sources = list(_SYSTEM_CA_FILES)
    try:
        import certifi

        sources.append(certifi.where())
    except ImportError:
        pass
    parts: list[bytes] = []
    for path in sources:
        if os.path.isfile(path):
            with open(path, "rb") as fh:
                parts.append(fh.read())
    with open(custom, "rb") as fh:
        parts.append(fh.read())
    content = b"\n".join(parts)
    digest = hashlib.sha256(content).hexdigest()
    folder = _bundle_dir()
    merged = os.path.join(folder, f"{digest[:32]}.crt")
    try:
        with open(merged, "rb") as fh:
            same = hashlib.sha256(fh.read()).hexdigest() == digest
    except OSError:
        same = False
    if not same:
        tmp = f"{merged}.{os.getpid()}.tmp"
        with open(tmp, "wb") as out:
            out.write(content)
        os.replace(tmp, merged)  # atomic: a concurrent reader sees a whole bundle
    _merged_bundles[key] = merged
    return merged


def configured_ca_bundle(env: Mapping[str, str]) -> str | None:
    """The custom CA bundle file the environment names, whether or not it is there.

    KServe mounts a ConfigMap with ``cabundle.crt`` and names it in ``CA_BUNDLE_CONFIGMAP_NAME``;
    ``MODELCACHE_CA_BUNDLE`` names a file directly.
    """
    if env.get("MODELCACHE_CA_BUNDLE"):
        return env["MODELCACHE_CA_BUNDLE"]
    if env.get("CA_BUNDLE_CONFIGMAP_NAME"):
        mount = env.get("CA_BUNDLE_VOLUME_MOUNT_POINT") or DEFAULT_CA_BUNDLE_MOUNT
        return os.path.join(mount, "cabundle.crt")
    return None


_warned_missing: set[str] = set()


def ca_bundle_from_env(env: Mapping[str, str]) -> str | None:
    """The custom CA bundle every backend but S3 trusts besides the public CAs, if it is there.

    KServe's rule: a named bundle that is not mounted is a warning for these backends, which keep
    the default trust store; only S3 fails on it (``_s3_settings`` takes the configured path and
    the S3 source refuses to start without the file).
    """
    path = configured_ca_bundle(env)
    if path and not os.path.isfile(path):
        if path not in _warned_missing:
            _warned_missing.add(path)
            logging.getLogger(__name__).warning(
                "CA bundle file %s not found (CA_BUNDLE_CONFIGMAP_NAME is set but its ConfigMap has no "
                "cabundle.crt, or is not mounted at CA_BUNDLE_VOLUME_MOUNT_POINT): using the default trust "
                "store; S3 pulls fail without it", path)
        return None
    return path
