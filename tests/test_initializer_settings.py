"""The CA bundle envs reach every backend's settings, merged with the public roots as KServe does."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from initializer.__main__ import _settings, transfer_options
from modelcache.errors import ModelcacheError

PEM = "-----BEGIN CERTIFICATE-----\nMIIBmodelcachetestcert\n-----END CERTIFICATE-----\n"


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """``_settings`` exports variables into the process environment, as the init container needs."""
    saved = dict(os.environ)
    for name in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "MODELCACHE_CA_BUNDLE", "AWS_CA_BUNDLE"):
        os.environ.pop(name, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_ca_bundle_reaches_every_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cabundle.crt").write_text(PEM)
    monkeypatch.setenv("CA_BUNDLE_CONFIGMAP_NAME", "custom-ca")
    monkeypatch.setenv("CA_BUNDLE_VOLUME_MOUNT_POINT", str(tmp_path))
    settings = _settings()
    merged = settings.http.ca_bundle
    assert merged is not None and merged != str(tmp_path / "cabundle.crt")
    text = Path(merged).read_text()
    assert PEM in text and text.count("BEGIN CERTIFICATE") > 1  # custom + public roots
    assert settings.s3.ca_bundle == merged
    # SDKs that only read the standard variables (google-auth, azure-core, httpx) get it too.
    assert os.environ["REQUESTS_CA_BUNDLE"] == merged and os.environ["SSL_CERT_FILE"] == merged
    os.unlink(merged)


def test_explicit_requests_ca_bundle_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cabundle.crt").write_text(PEM)
    monkeypatch.setenv("CA_BUNDLE_CONFIGMAP_NAME", "custom-ca")
    monkeypatch.setenv("CA_BUNDLE_VOLUME_MOUNT_POINT", str(tmp_path))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/mine.pem")
    settings = _settings()
    assert os.environ["REQUESTS_CA_BUNDLE"] == "/etc/mine.pem"
    assert settings.http.ca_bundle and PEM in Path(settings.http.ca_bundle).read_text()


def test_transfer_options_from_env() -> None:
    opts = transfer_options({})
    assert opts.chunk_size == 8 << 20 and opts.workers == 8
    opts = transfer_options({"MODELCACHE_WORKERS": "2", "MODELCACHE_CHUNK_SIZE": "4MiB"})
    assert (opts.workers, opts.chunk_size) == (2, 4 << 20)
    with pytest.raises(ModelcacheError, match="MODELCACHE_CHUNK_SIZE"):
        transfer_options({"MODELCACHE_CHUNK_SIZE": "big"})
