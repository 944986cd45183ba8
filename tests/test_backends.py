"""The backend registry (modelcache.sources.backends) and the promises of the Source interface that
the engine keeps: one line per backend, loaded lazily; ``max_streams`` caps the requests the
engine keeps open against one source; a missing SDK is one line naming the package."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from modelcache.engine.transfer import TransferOptions
from modelcache.errors import UnsupportedError
from modelcache.pull import pull
from modelcache.sources.backends import BACKENDS, Backend, load
from modelcache.sources.base import Source, open_source, source_class
from modelcache.sources.credentials import Settings
from modelcache.sources.local import LocalSource
from modelcache.sources.remote import RemoteFile
from modelcache.sources.uri import Location, parse_uri
from tests.fixtures.http import random_bytes

EXAMPLES = {
    "s3": "s3://bucket/model",
    "gcs": "gs://bucket/model",
    "azure": "https://account.blob.core.windows.net/container/model",
    "hf": "hf://owner/model",
    "oci": "oci://registry.example/repo:tag",
    "hdfs": "hdfs://user/me/model",
    "pvc": "pvc://claim/model",
    "local": "/models/m",
    "http": "https://example.com/model.bin",
}


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_every_line_names_a_source_and_the_location_that_selects_it(kind: str) -> None:
    backend = BACKENDS[kind]
    assert issubclass(load(backend.source), Source)
    location_class = load(backend.location)
    assert issubclass(location_class, Location)
    example = EXAMPLES.get(kind)
    if example is None:  # a backend added since: its own tests show its URIs
        return
    assert parse_uri(example).kind == kind
    assert source_class(kind) is load(backend.source)


def test_no_uri_loads_another_backends_sdk() -> None:
    """Parsing and opening an S3 source imports botocore (not even boto3: the S3 source signs with botocore
    alone), never the Azure, Google or HDFS SDKs."""
    code = (
        "import sys\n"
        "from modelcache.sources.credentials import Settings\n"
        "from modelcache.sources.base import open_source\n"
        "open_source('s3://bucket/model', Settings.from_env({}))\n"
        "print(' '.join(m for m in ('boto3', 'botocore', 'azure.storage.blob', 'google.cloud.storage', 'hdfs', 'oras')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["botocore"]


def test_a_backend_whose_package_is_missing_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mc_missing_sdk.py").write_text("import no_such_sdk_package  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS, "s3", Backend("mc_missing_sdk:Nothing", BACKENDS["s3"].location))
    with pytest.raises(UnsupportedError) as err:
        open_source("s3://bucket/model", Settings.from_env({}))
    assert str(err.value) == (
        "s3://bucket/model: storage backend 's3' needs the Python package 'no_such_sdk_package', "
        "which is not installed"
    )


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedError, match="storage backend 'nope' is not supported yet"):
        source_class("nope")


def test_a_backend_outside_uri_py_parses_its_own_scheme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line with prefixes: parse_uri imports the module only for such a URI, and its kind is
    the line's key (the one place it is spelled)."""
    (tmp_path / "mc_demo_backend.py").write_text(
        "from dataclasses import dataclass\n"
        "from modelcache.sources.uri import Location\n"
        "@dataclass(frozen=True)\n"
        "class DemoLocation(Location):\n"
        "    name: str = ''\n"
        "    @classmethod\n"
        "    def parse(cls, uri: str) -> 'DemoLocation':\n"
        "        return cls(uri=uri, name=uri.split('://', 1)[1])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS, "demo", Backend("mc_demo_backend:Nope", "mc_demo_backend:DemoLocation",
                                                  ("demo://",), "demo://name"))
    loc = parse_uri("demo://thing")
    assert loc.kind == "demo" and loc.name == "thing"  # type: ignore[attr-defined]
    with pytest.raises(Exception, match=r"demo://name"):  # the form is listed in the error
        parse_uri("nodemo://thing")


class _Counting:
    """Wraps a stream: counts how many are open at once, each held open for its first read."""

    lock = threading.Lock()
    open_now = 0
    peak = 0

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.first = True
        with _Counting.lock:
            _Counting.open_now += 1
            _Counting.peak = max(_Counting.peak, _Counting.open_now)

    def readinto(self, buf: memoryview) -> int:
        if self.first:
            self.first = False
            threading.Event().wait(0.05)  # lets other workers open theirs meanwhile
        return int(self.inner.readinto(buf))

    def abort(self) -> None:
        self.close()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None
            with _Counting.lock:
                _Counting.open_now -= 1


@pytest.mark.parametrize("cap", [2, 8])
def test_the_engine_keeps_at_most_max_streams_requests_open_per_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: int
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"shard-{i}.bin").write_bytes(random_bytes(2 << 20, seed=i))
    real = LocalSource.open_range

    def open_range(self: LocalSource, file: RemoteFile, start: int, end: int | None) -> Any:
        return _Counting(real(self, file, start, end))

    monkeypatch.setattr(LocalSource, "open_range", open_range)
    monkeypatch.setattr(LocalSource, "max_streams", cap)
    _Counting.open_now = _Counting.peak = 0
    pull(str(src), root=tmp_path / "root", settings=Settings.from_env({}),
         options=TransferOptions(workers=8, chunk_size=1 << 20))
    assert _Counting.open_now == 0
    assert _Counting.peak <= cap
    if cap == 8:  # the cap, not the test, is what held the count down
        assert _Counting.peak > 2
