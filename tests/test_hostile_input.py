"""Hostile input through the real CLI: each bad input is one line, nothing leaks, nothing is read.

Invalid URIs are refused before the environment's credentials are read or a connection is made;
local sources that are not regular files or directories are refused by name.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pull_helpers import cli_cmd, error_line, run_cli


@contextlib.contextmanager
def listener() -> Iterator[tuple[int, socket.socket]]:
    """A TCP port that records whether anything connected to it (accept never blocks)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    try:
        yield sock.getsockname()[1], sock
    finally:
        sock.close()


def connections(sock: socket.socket) -> int:
    n = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


@pytest.mark.parametrize(
    ("uri", "needle"),
    [
        ("s3://models/a/../etc", "must not contain '..' segments"),
        ("gs://models/../m", "must not contain '..' segments"),
        ("https://acct.blob.core.windows.net/c/%2e%2e/m", "must not contain '..' segments"),
        ("hdfs://nn/models/../m", "must not contain '..' segments"),
        ("s3://AKIAX:Pw0rd/abc+def@models/m", "credentials must not be written into the URI"),
        ("hf://user:Pw0rdXYZ@org/model", "credentials must not be written into the URI"),
        ("http://[::1/m.bin", "malformed host or port"),
        ("https://h:99999/m.bin", "malformed host or port"),
    ],
)
def test_invalid_uri_is_refused_before_credentials_or_a_connection(tmp_path: Path, uri: str, needle: str) -> None:
    with listener() as (port, sock):
        endpoint = f"http://127.0.0.1:{port}"
        env = {
            # Every backend's endpoint is our listener: a connection attempt would show.
            "AWS_ENDPOINT_URL": endpoint, "S3_ENDPOINT": f"127.0.0.1:{port}", "S3_USE_HTTPS": "0",
            "STORAGE_EMULATOR_HOST": endpoint, "HF_ENDPOINT": endpoint, "AZURE_STORAGE_ENDPOINT": endpoint,
            # Unreadable credentials: reading them first would fail with a different error.
            "STORAGE_CONFIG": "{not json", "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing.json"),
        }
        proc = run_cli("pull", uri, "--root", str(tmp_path / "root"), "--progress", "none", env=env, timeout=30)
        line = error_line(proc, "invalid storage URI", needle, secrets=("Pw0rd", "abc+def"))
        assert proc.returncode == 1, proc.stderr
        assert connections(sock) == 0, line
    assert not (tmp_path / "root" / "models").exists() or not any((tmp_path / "root" / "models").iterdir())


def test_rm_and_verify_take_any_argument_without_a_traceback(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for cmd in ("rm", "verify"):
        # An argument that is not UTF-8 (a byte 0xff from the shell).
        proc = subprocess.run([*cli_cmd(), cmd, b"s3://b/\xff", "--root", str(root)], capture_output=True, timeout=30)
        assert b"Traceback" not in proc.stderr, proc.stderr


# -- local sources: only regular files and directories ------------------------------------------


def _socket_file(path: Path) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return path


SPECIALS = {
    "fifo": lambda p: (os.mkfifo(p), p)[1],
    "socket": _socket_file,
    "char-device": lambda _p: Path("/dev/zero"),
}


@pytest.mark.parametrize("kind", sorted(SPECIALS))
@pytest.mark.parametrize("form", ["path", "file-uri", "inside-a-folder"])
def test_local_source_that_is_not_a_file_or_folder_is_refused_by_name(tmp_path: Path, kind: str, form: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    special = SPECIALS[kind](src / "weights.bin")
    if form == "inside-a-folder":
        if kind == "char-device":
            os.mknod(src / "weights.bin", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
            special = src / "weights.bin"
        uri = str(src)
    else:
        uri = str(special) if form == "path" else f"file://{special}"
    root = tmp_path / "root"
    proc = run_cli("pull", uri, "--root", str(root), "--progress", "none", timeout=30)
    what = {"fifo": "a FIFO", "socket": "a socket", "char-device": "a character device"}[kind]
    error_line(proc, str(special), what, "only regular files and directories")
    assert not (root / "models").exists() or not any((root / "models").iterdir())


def test_initializer_refuses_a_fifo_source_instead_of_linking_it(tmp_path: Path) -> None:
    import sys

    fifo = tmp_path / "model.bin"
    os.mkfifo(fifo)
    dest = tmp_path / "dest"
    proc = subprocess.run([sys.executable, "-m", "initializer", str(fifo), str(dest)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "a FIFO" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (dest / "model.bin").exists() and not os.path.islink(dest / "model.bin")


# -- secrets in URIs: nowhere a URI is written ----------------------------------------------------


def _everything_under(root: Path) -> str:
    """Every file name and every small file's text under ``root`` (manifests, journals, plans)."""
    out = []
    for p in root.rglob("*"):
        out.append(str(p))
        if p.is_file() and p.stat().st_size < 1 << 20:
            out.append(p.read_bytes().decode("latin-1"))
    return "\n".join(out)


SECRET = "Secr3tZ9"


def _secret_uris(nginx: object) -> list[str]:
    signed = nginx.url("s/m.bin") + f"?X-Amz-Signature={SECRET}sig&X-Amz-Credential=AKIA"  # type: ignore[attr-defined]
    return [signed, f"s3://AKIAX:{SECRET}key@models/m", nginx.url("s/m.bin") + f"#token={SECRET}tok"]  # type: ignore[attr-defined]


def test_no_secret_in_cli_output_manifests_or_file_names(nginx, tmp_path: Path) -> None:
    import json

    nginx.write("s/m.bin", 300_000)
    root = tmp_path / "root"
    proc = run_cli("pull", *_secret_uris(nginx), "--root", str(root), "--progress", "plain",
                   "--progress-interval", "0.1", "--json")
    assert proc.returncode == 1  # the two invalid URIs fail, the signed one is pulled
    results = json.loads(proc.stdout)
    assert [r["ok"] for r in results] == [True, False, False]
    ls = run_cli("ls", "--root", str(root), "--json")
    for text in (proc.stdout, proc.stderr, ls.stdout, ls.stderr, _everything_under(root)):
        assert SECRET not in text, text[:2000]
    assert "?<redacted>" in proc.stdout and "s3://<redacted>@models/m" in proc.stderr


def test_no_secret_in_agent_status_logs_metrics_or_files(nginx, tmp_path: Path) -> None:
    import signal
    import urllib.request

    import yaml

    from tests.agent_util import agent_cmd, write_node
    from tests.helpers import REPO, free_port, wait_until

    nginx.write("s/m.bin", 300_000)
    root = tmp_path / "root"
    names = ["signed", "creds", "token"]
    spec = write_node(tmp_path / "node.yaml", [{"modelName": n, "sourceModelUri": u}
                                               for n, u in zip(names, _secret_uris(nginx), strict=True)])
    status = spec.with_name(spec.name + ".status.yaml")
    port = free_port()
    agent = subprocess.Popen(agent_cmd(spec, root, "--watch", "--port", str(port), "--host", "127.0.0.1"),
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def settled() -> bool:
            st = yaml.safe_load(status.read_text())["status"]["modelStatus"]
            return st == {"signed": "ModelDownloaded", "creds": "ModelDownloadError", "token": "ModelDownloadError"}

        wait_until(settled, timeout=60, what="all three models settled")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    finally:
        agent.send_signal(signal.SIGTERM)
        _, logs = agent.communicate(timeout=30)
    # The file repeats the input spec (the user's own URIs) beside the status we write.
    ours = yaml.safe_load(status.read_text())["status"]
    text = yaml.safe_dump(ours, width=1 << 20)
    for where, body in (("status", text), ("logs", logs), ("metrics", metrics), ("files", _everything_under(root))):
        assert SECRET not in body, f"{where}: {body[:3000]}"
    assert ours["modelDetails"]["creds"]["message"].startswith("InvalidURI: invalid storage URI 's3://<redacted>@models/m'")
    assert "modelcache_agent" in metrics
