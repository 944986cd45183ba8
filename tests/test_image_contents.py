"""What is in the image `make image` builds: its size over the base, what was cut, bytecode on
purpose, the user and entrypoint, and nothing of the build machine (CA bundle, token, key)."""

from __future__ import annotations

import base64
import io
import json
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import pytest

from tests.fixtures.image import Image
from tests.helpers import load_script, self_trusting_pair

#: Over the base, measured 178 MB (README.md, "Image"); each cut in image/prune-venv.sh is >= 27 MB,
#: so losing any of them fails here.
BUDGET = 200_000_000

PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----\s+[A-Za-z0-9+/=\s]{64,}-----END")
#: Where a build machine's secrets live; nothing of ours belongs there.
SECRET_DIRS = ("root/", "home/", "etc/ssl/", "usr/local/share/ca-certificates/", "var/run/secrets/",
               "run/secrets/", "tmp/", "src/")
SECRET_NAMES = {"token", "kubeconfig", ".netrc", ".git-credentials", ".pypirc", "pip.conf", "credentials",
                "config.json", "id_rsa", "id_ed25519", "ca-certificates.crt"}

# The first test to use `image` also builds it (minutes when the layer cache is cold).
pytestmark = pytest.mark.timeout(900)


def size_tool() -> ModuleType:
    return load_script("image/size.py", "image_size")


@pytest.fixture(scope="module")
def layers(image: Image, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return size_tool().own_layers("podman", image.ref, image.base, tmp_path_factory.mktemp("layers"))


def cert_samples(pem: bytes) -> list[bytes]:
    """Byte strings found in any file holding the certificate: a line of its PEM body (64-column
    PEM, as every bundle writes it) and a slice of its DER."""
    lines = [line.strip() for line in pem.splitlines() if line.strip() and not line.startswith(b"-----")]
    return [lines[1], base64.b64decode(b"".join(lines))[40:100]]


PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def host_only_cas(image: Image) -> list[bytes]:
    """The CAs this machine trusts and the base image does not (here: the TLS re-signing CA the
    build mounts /etc/ssl/certs for)."""
    host = set(PEM_CERT.findall(Path("/etc/ssl/certs/ca-certificates.crt").read_bytes()))
    base = image.podman("run", "--rm", "--network", "host", image.base, "cat", "/etc/ssl/certs/ca-certificates.crt")
    return sorted(host - set(PEM_CERT.findall(base.stdout.encode())))


def findings(layer_tars: Iterable[Path], ca_samples: list[bytes]) -> list[str]:
    found = []
    for layer in layer_tars:
        with tarfile.open(layer) as tf:
            for m in tf:
                name = m.name.removeprefix("./")
                base = name.rsplit("/", 1)[-1]
                if name.startswith(SECRET_DIRS) and not (m.isdir() and name.rstrip("/") in ("tmp", "root")):
                    found.append(f"{name}: a build machine's path")
                if m.isfile() and base in SECRET_NAMES:
                    found.append(f"{name}: a credential's file name")
                if not m.isfile():
                    continue
                data = tf.extractfile(m).read()  # type: ignore[union-attr]
                if PRIVATE_KEY.search(data):
                    found.append(f"{name}: a private key")
                if any(s in data for s in ca_samples):
                    found.append(f"{name}: this machine's CA certificate")
    return found


def test_the_secret_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The scan below on a layer with one of each planted: it must report all of them."""
    crt, key = self_trusting_pair(tmp_path / "pair", "planted")
    files = {"opt/venv/lib/site/keys.py": b"X = '''" + key.read_bytes() + b"'''",
             "opt/venv/share/bundle.pem": crt.read_bytes(),
             "etc/ssl/certs/ca-certificates.crt": b"x",
             "opt/app/.kube/kubeconfig": b"apiVersion: v1",
             "var/run/secrets/kubernetes.io/serviceaccount/token": b"t"}
    layer = tmp_path / "layer.tar"
    with tarfile.open(layer, "w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    got = findings([layer], cert_samples(crt.read_bytes()))
    assert sorted(got) == sorted([
        "opt/venv/lib/site/keys.py: a private key",
        "opt/venv/share/bundle.pem: this machine's CA certificate",
        "etc/ssl/certs/ca-certificates.crt: a build machine's path",
        "etc/ssl/certs/ca-certificates.crt: a credential's file name",
        "opt/app/.kube/kubeconfig: a credential's file name",
        "var/run/secrets/kubernetes.io/serviceaccount/token: a build machine's path",
        "var/run/secrets/kubernetes.io/serviceaccount/token: a credential's file name",
    ])


def test_nothing_of_the_build_machine_in_any_layer(image: Image, layers: list[Path]) -> None:
    # This machine's TLS is re-signed by a CA that only its /etc/ssl/certs trusts, mounted into the
    # build: no layer of ours may hold it, a private key, a token or a credentials file.
    own_cas = host_only_cas(image)
    assert findings(layers, [s for pem in own_cas for s in cert_samples(pem)]) == []
    # The image's trust store is the base's own, untouched by the build.
    script = "import hashlib; print(hashlib.sha256(open('/etc/ssl/certs/ca-certificates.crt','rb').read()).hexdigest())"
    ours = image.run("-c", script, entrypoint="python").stdout
    theirs = image.podman("run", "--rm", "--network", "host", image.base, "python3", "-c", script).stdout
    assert ours == theirs and len(ours.strip()) == 64
    # No build-time environment (proxies, PIP_CERT, tokens) was baked into the config.
    cfg = json.loads(image.podman("image", "inspect", image.ref).stdout)[0]["Config"]
    names = {e.split("=", 1)[0] for e in cfg["Env"]}
    assert names <= {"PATH", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED"}, names


def test_size_over_the_base_and_what_was_cut(layers: list[Path]) -> None:
    total, pyc, per = size_tool().measure(layers)
    assert total < BUDGET, (total, per.most_common(5))
    assert pyc > 0  # bytecode is shipped on purpose (next test)
    names = [m.name for layer in layers for m in size_tool().members(layer)]
    site = "opt/venv/lib/python3.11/site-packages/"
    cut = [n for n in names if n.startswith((site + "kubernetes/aio/", site + "botocore/data/ec2/", site + "pip/",
                                             site + "setuptools/", "opt/build/", "usr/bin/strip"))
           or "/tests/" in n]
    assert cut == []
    kept = {n.removeprefix(site + "botocore/data/").split("/")[0] for n in names
            if n.startswith(site + "botocore/data/") and n.count("/") > len(site.split("/")) + 1}
    assert kept == {"s3", "sts", "sso", "sso-oidc", "signin"}


def test_the_roles_load_shipped_bytecode(image: Image) -> None:
    """Root is read-only in deploy/: a module without a .pyc would be compiled again at every start
    (measured: ~3 s -> ~8.5 s of imports). `python -v` says where each module's code came from."""
    imports = "import initializer.__main__, agent.__main__, coordinator.__main__, modelcache.kube.client, boto3"
    r = image.run("-v", "-c", imports, entrypoint="python")
    assert r.returncode == 0, r.stderr[-2000:]
    from_pyc = re.findall(r"^# code object from '/opt/venv/.*\.pyc'$", r.stderr, re.M)
    from_source = re.findall(r"^# code object from /opt/venv/.*\.py$", r.stderr, re.M)
    assert from_source == []
    assert len(from_pyc) > 500


def test_user_entrypoint_and_kserve_path(image: Image) -> None:
    cfg = json.loads(image.podman("image", "inspect", image.ref).stdout)[0]["Config"]
    assert cfg["User"] == "1000:1000"
    assert cfg["Entrypoint"] == ["storage-initializer"]
    r = image.run("-c", "import os; print(os.getuid(), os.getgid(), os.path.realpath("
                  "'/storage-initializer/scripts/initializer-entrypoint'))", entrypoint="python")
    assert r.stdout.split() == ["1000", "1000", "/opt/venv/bin/storage-initializer"]
