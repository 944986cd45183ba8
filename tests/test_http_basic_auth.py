"""``http(s)://user:password@host/file``: KServe's initializer (requests) sends the userinfo as HTTP
basic auth; so do the CLI, the initializer and the agent, against nginx's ``auth_basic``. The
password never shows: not in output, logs, status, manifests or plan files."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

from modelcache.sources.uri import storage_key
from tests.agent_util import run_agent, status_of, write_node
from tests.fixtures.http import BASIC_AUTH, NginxServer
from tests.initializer_util import run_initializer
from tests.pull_helpers import run_cli


def _uri(nginx: NginxServer, rel: str, listener: str = "http", password: str = BASIC_AUTH[1]) -> str:
    user = BASIC_AUTH[0]
    base = nginx.url(rel, listener)
    scheme, rest = base.split("://", 1)
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{rest}"


def _everything_written(root: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file() and p.suffix == ".json")


def test_cli_pull_with_userinfo_is_basic_auth_and_never_shown(nginx: NginxServer, tmp_path: Path) -> None:
    data = nginx.write("m/model.bin", 2 << 20).read_bytes()
    uri = _uri(nginx, "basic/m/model.bin")
    proc = run_cli("pull", uri, "--root", str(tmp_path / "root"), "--progress", "none")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "root" / "models" / storage_key(uri) / "model.bin").read_bytes() == data
    assert BASIC_AUTH[1] not in proc.stdout + proc.stderr and quote(BASIC_AUTH[1], safe="") not in proc.stdout
    manifests = _everything_written(tmp_path / "root")
    assert "<redacted>@" in manifests and "sesame" not in manifests
    # Over plain http:// the password is readable on the way (security review L5): said once.
    assert proc.stderr.count("as HTTP basic auth over plain http://") == 1, proc.stderr

    # The wrong password: one line naming the (redacted) URI, the 401, no secret.
    bad = run_cli("pull", _uri(nginx, "basic/m/model.bin", password="nope-XYZ"), "--root", str(tmp_path / "r2"),
                  "--progress", "none")
    assert bad.returncode != 0 and "401" in bad.stderr and "nope-XYZ" not in bad.stderr
    assert "<redacted>@" in bad.stderr
    # Without userinfo the location refuses (the server really checks).
    assert run_cli("pull", nginx.url("basic/m/model.bin"), "--root", str(tmp_path / "r3"),
                   "--progress", "none").returncode != 0


def test_initializer_and_agent_send_userinfo_as_basic_auth(nginx: NginxServer, tmp_path: Path) -> None:
    data = nginx.write("w/weights.bin", 1 << 20).read_bytes()
    uri = _uri(nginx, "basic/w/weights.bin", "https")
    ca = tmp_path / "ca"
    ca.mkdir()
    (ca / "cabundle.crt").write_bytes(nginx.ca_path.read_bytes())
    r = run_initializer(uri, tmp_path / "dest", env={"CA_BUNDLE_CONFIGMAP_NAME": "ca",
                                                    "CA_BUNDLE_VOLUME_MOUNT_POINT": str(ca)})
    assert r.code == 0, r.output
    assert (tmp_path / "dest" / "weights.bin").read_bytes() == data
    assert "sesame" not in r.output and "<redacted>@" in r.output
    assert "plain http://" not in r.output  # https: nothing to warn about

    spec = write_node(tmp_path / "node.yaml", [{"modelName": "w", "sourceModelUri": uri}])
    proc = run_agent(spec, tmp_path / "root", "--download-env", f"MODELCACHE_CA_BUNDLE={nginx.ca_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert status_of(spec)["modelStatus"] == {"w": "ModelDownloaded"}
    assert (tmp_path / "root" / "models" / storage_key(uri) / "weights.bin").read_bytes() == data
    # (The status file repeats the input spec, the user's own file; its status part is ours.)
    shown = proc.stderr + json.dumps(status_of(spec)) + _everything_written(tmp_path / "root")
    assert "sesame" not in shown and "<redacted>@" in shown
