"""A small WebHDFS server for tests, faithful to what the ``hdfs`` client and our source call.

Two real HTTP listeners on 127.0.0.1: the namenode (``/webhdfs/v1<path>?op=...``) and one
datanode. Files live in a local folder (``root``) that stands for the HDFS namespace.

Namenode operations: GETFILESTATUS, LISTSTATUS (a file lists itself with an empty
``pathSuffix``), GETHOMEDIRECTORY, GETFILECHECKSUM, MKDIRS, DELETE, OPEN and CREATE.
GETFILECHECKSUM, OPEN and CREATE answer **307** with ``Location`` on the datanode, which
computes the real MD5-of-MD5-of-CRC32C, serves ``offset``/``length`` (WebHDFS has no HTTP
Range) or stores the PUT body. Identity is ``doas`` if given, else
``user.name``; ``required_headers`` missing -> 401; a user outside ``allowed_users`` or a path
in ``denied_paths`` -> 403 AccessControlException; missing paths -> 404 FileNotFoundException,
all as ``{"RemoteException": {...}}`` JSON. With ``tls_cert`` both nodes speak HTTPS (and
with ``client_ca`` demand a client certificate). Tests can slow the datanode (``datanode_delay``,
``throttle_bps``),
flip a byte of what OPEN sends (``corrupt_reads``), inject 429/5xx answers with Retry-After
(``fail``), and read the request log and byte count.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import google_crc32c

PREFIX = "/webhdfs/v1"
_JAVA = {
    "FileNotFoundException": "java.io.FileNotFoundException",
    "AccessControlException": "org.apache.hadoop.security.AccessControlException",
    "SecurityException": "java.lang.SecurityException",
    "IllegalArgumentException": "java.lang.IllegalArgumentException",
    "IOException": "java.io.IOException",
}


@dataclass(frozen=True)
class Request:
    node: str  # "namenode" or "datanode"
    method: str
    path: str
    op: str
    params: dict[str, str]
    headers: dict[str, str]


@dataclass
class _Failure:
    when: Callable[[Request], bool]
    status: int
    retry_after: float | None
    remaining: int


class _Error(Exception):
    def __init__(self, status: int, exception: str, message: str) -> None:
        super().__init__(message)
        self.status, self.exception, self.message = status, exception, message


@dataclass
class WebHDFSServer:
    root: Path
    home_user: str = "hdfs"
    required_headers: dict[str, str] = field(default_factory=dict)
    allowed_users: set[str] | None = None
    denied_paths: set[str] = field(default_factory=set)
    datanode_delay: float = 0.0
    #: Cap on each OPEN stream's bytes per second (None: as fast as it goes).
    throttle_bps: float | None = None
    #: Whether ``/.reserved/.inodes/<fileId>`` paths are served (a NameNode does; some gateways may not).
    reserved_paths: bool = True
    #: Small blocks so test files span several (real clusters: 128 MiB).
    block_size: int = 1 << 20
    #: hdfs path -> file offset whose byte OPEN flips in transit (the stored file stays good).
    corrupt_reads: dict[str, int] = field(default_factory=dict)
    #: Paths of ``corrupt_reads`` flipped in one read only; ``flipped`` counts flipped reads.
    corrupt_once: set[str] = field(default_factory=set)
    flipped: int = 0
    bytes_sent: int = 0
    requests: list[Request] = field(default_factory=list)
    #: HTTPS on both nodes with this certificate chain and key (PEM paths); None: plain HTTP.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: With TLS: require a client certificate signed by this CA (mutual TLS, as gateways do).
    client_ca: Path | None = None

    def start(self) -> WebHDFSServer:
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._failures: list[_Failure] = []
        self._namenode = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, "namenode"))
        self._datanode = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, "datanode"))
        if self.tls_cert is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
            if self.client_ca is not None:
                ctx.verify_mode = ssl.CERT_REQUIRED
                ctx.load_verify_locations(self.client_ca)
            for srv in (self._namenode, self._datanode):
                srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        for srv in (self._namenode, self._datanode):
            srv.daemon_threads = True
            threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        for srv in (self._namenode, self._datanode):
            srv.shutdown()
            srv.server_close()

    @property
    def scheme(self) -> str:
        return "http" if self.tls_cert is None else "https"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._namenode.server_address[1]}"

    @property
    def datanode_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._datanode.server_address[1]}"

    def put(self, hdfs_path: str, data: bytes) -> None:
        """Test setup: create a file directly in the namespace."""
        local = self.local(hdfs_path)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(data)

    def resolve(self, hdfs_path: str) -> str:
        """``/.reserved/.inodes/<fileId>`` (HDFS's name for one inode) -> the path holding it now."""
        m = re.fullmatch(r"/\.reserved/\.inodes/(\d+)", hdfs_path)
        if not m:
            return hdfs_path
        if not self.reserved_paths:  # a gateway that passes only plain paths on
            raise _Error(404, "FileNotFoundException", f"File does not exist: {hdfs_path}")
        for p in self.root.rglob("*"):
            if p.stat().st_ino == int(m.group(1)):
                return "/" + p.relative_to(self.root).as_posix()
        raise _Error(404, "FileNotFoundException", f"File does not exist: {hdfs_path}")

    def local(self, hdfs_path: str) -> Path:
        parts = [p for p in hdfs_path.split("/") if p]
        if ".." in parts:
            raise _Error(400, "IllegalArgumentException", f"Invalid path name {hdfs_path}")
        return self.root.joinpath(*parts)

    def log(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def fail(
        self,
        status: int = 429,
        *,
        count: int = 1,
        retry_after: float | None = None,
        when: Callable[[Request], bool] = lambda r: True,
    ) -> None:
        """Answer the next ``count`` matching requests with ``status`` (as a rate-limiting or
        overloaded gateway in front of WebHDFS does), with ``Retry-After`` if given."""
        with self._lock:
            self._failures.append(_Failure(when, status, retry_after, count))

    def _injected(self, req: Request) -> _Failure | None:
        with self._lock:
            for f in self._failures:
                if f.remaining > 0 and f.when(req):
                    f.remaining -= 1
                    return f
        return None

    def ops(self, node: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if node is None or r.node == node]

    # -- namespace --------------------------------------------------------------------------

    def status(self, hdfs_path: str, suffix: str = "") -> dict:
        local = self.local(hdfs_path)
        st = local.stat()
        is_dir = local.is_dir()
        return {
            "accessTime": int(st.st_atime * 1000),
            "blockSize": self.block_size,
            "childrenNum": len(os.listdir(local)) if is_dir else 0,
            "fileId": st.st_ino,
            "group": "supergroup",
            "length": 0 if is_dir else st.st_size,
            "modificationTime": int(st.st_mtime * 1000),
            "owner": self.home_user,
            "pathSuffix": suffix,
            "permission": "755" if is_dir else "644",
            "replication": 0 if is_dir else 3,
            "storagePolicy": 0,
            "type": "DIRECTORY" if is_dir else "FILE",
        }


def file_checksum(data: bytes, block_size: int, bytes_per_crc: int = 512) -> dict:
    """HDFS's MD5-of-MD5-of-CRC32C, written out plainly (whole file in memory) so it checks
    the source's incremental version independently. As a real DataNode answers it (checked
    against Hadoop 3.5's MiniDFSCluster): the file MD5 is taken over the block MD5s padded with
    zeros to the capacity of the buffer Hadoop collected them in (32 bytes, doubling), and
    ``bytes`` is that 32-byte-or-more buffer in hex with ``length`` 28."""
    block_md5s = []
    for b in range(0, len(data), block_size):
        block = data[b : b + block_size]
        crcs = b"".join(
            google_crc32c.value(block[i : i + bytes_per_crc]).to_bytes(4, "big")
            for i in range(0, len(block), bytes_per_crc)
        )
        block_md5s.append(hashlib.md5(crcs).digest())
    crc_per_block = block_size // bytes_per_crc if len(block_md5s) > 1 else 0
    joined = b"".join(block_md5s)
    capacity = 32
    while capacity < len(joined):
        capacity *= 2
    md5 = hashlib.md5(joined.ljust(capacity, b"\0")).digest()
    raw = struct.pack(">iq", bytes_per_crc, crc_per_block) + md5 + bytes(4)
    return {"algorithm": f"MD5-of-{crc_per_block}MD5-of-{bytes_per_crc}CRC32C", "bytes": raw.hex(), "length": 28}


def _handler(server: WebHDFSServer, node: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._dispatch()

        def do_PUT(self) -> None:
            self._dispatch()

        def do_DELETE(self) -> None:
            self._dispatch()

        def do_POST(self) -> None:
            self._dispatch()

        # -- plumbing -----------------------------------------------------------------------

        def _dispatch(self) -> None:
            parts = urlsplit(self.path)
            params = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
            op = params.get("op", "").upper()
            path = unquote(parts.path)
            req = Request(node, self.command, path, op, params, {k.lower(): v for k, v in self.headers.items()})
            server.log(req)
            injected = server._injected(req)
            if injected is not None:
                self._drain()
                # A gateway's own answer: plain text, not a RemoteException.
                data = b"injected failure\n"
                self.send_response(injected.status)
                if injected.retry_after is not None:
                    self.send_header("Retry-After", f"{injected.retry_after:g}")
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            try:
                if not path.startswith(PREFIX):
                    raise _Error(404, "FileNotFoundException", f"Path {path} is not under {PREFIX}")
                hdfs_path = server.resolve(path[len(PREFIX) :] or "/")
                self._authorize(req, hdfs_path)
                if node == "datanode":
                    self._datanode(req, hdfs_path)
                else:
                    self._namenode(req, hdfs_path)
            except _Error as err:
                self._drain()
                body = {
                    "RemoteException": {
                        "exception": err.exception,
                        "javaClassName": _JAVA[err.exception],
                        "message": err.message,
                    }
                }
                self._json(err.status, body)

        def _drain(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _user(self, req: Request) -> str:
            return req.params.get("doas") or req.params.get("user.name") or "dr.who"

        def _authorize(self, req: Request, hdfs_path: str) -> None:
            for name, value in server.required_headers.items():
                if req.headers.get(name.lower()) != value:
                    # Real clusters answer 401 with a Negotiate challenge when SPNEGO fails.
                    raise _Error(
                        401,
                        "SecurityException",
                        "Failed to obtain user group information: "
                        "org.apache.hadoop.security.authentication.client.AuthenticationException",
                    )
            user = self._user(req)
            if server.allowed_users is not None and user not in server.allowed_users:
                raise _Error(403, "AccessControlException", f"User: {user} is not allowed to impersonate {user}")
            norm = "/" + "/".join(p for p in hdfs_path.split("/") if p)
            for denied in server.denied_paths:
                if norm == denied or norm.startswith(denied.rstrip("/") + "/"):
                    raise _Error(
                        403,
                        "AccessControlException",
                        f'Permission denied: user={user}, access=READ_EXECUTE, inode="{denied}"',
                    )

        def _exists(self, hdfs_path: str) -> Path:
            local = server.local(hdfs_path)
            if not local.exists():
                raise _Error(404, "FileNotFoundException", f"File does not exist: {hdfs_path}")
            return local

        def _redirect(self, req: Request, hdfs_path: str) -> None:
            self._drain()
            query = "&".join(f"{quote(k)}={quote(v)}" for k, v in req.params.items())
            location = f"{server.datanode_url}{PREFIX}{quote(hdfs_path)}?{query}&namenoderpcaddress=test:8020"
            self.send_response(307)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        # -- namenode -----------------------------------------------------------------------

        def _namenode(self, req: Request, hdfs_path: str) -> None:
            op = req.op
            if self.command == "GET" and op == "GETFILESTATUS":
                self._exists(hdfs_path)
                self._json(200, {"FileStatus": server.status(hdfs_path)})
            elif self.command == "GET" and op == "LISTSTATUS":
                local = self._exists(hdfs_path)
                if local.is_dir():
                    items = [server.status(f"{hdfs_path}/{n}", n) for n in sorted(os.listdir(local))]
                else:
                    items = [server.status(hdfs_path)]
                self._json(200, {"FileStatuses": {"FileStatus": items}})
            elif self.command == "GET" and op == "GETHOMEDIRECTORY":
                self._json(200, {"Path": f"/user/{self._user(req)}"})
            elif self.command == "GET" and op in ("GETFILECHECKSUM", "OPEN"):
                # Both are served by a datanode, as in a real cluster: 307 there.
                local = self._exists(hdfs_path)
                if local.is_dir():
                    raise _Error(404, "FileNotFoundException", f"Path is not a file: {hdfs_path}")
                self._redirect(req, hdfs_path)
            elif self.command == "PUT" and op == "CREATE":
                local = server.local(hdfs_path)
                if local.exists() and req.params.get("overwrite", "false").lower() != "true":
                    raise _Error(403, "IOException", f"File already exists: {hdfs_path}")
                self._redirect(req, hdfs_path)
            elif self.command == "PUT" and op == "MKDIRS":
                self._drain()
                server.local(hdfs_path).mkdir(parents=True, exist_ok=True)
                self._json(200, {"boolean": True})
            elif self.command == "DELETE" and op == "DELETE":
                local = server.local(hdfs_path)
                existed = local.exists()
                if local.is_dir():
                    shutil.rmtree(local)
                elif existed:
                    local.unlink()
                self._json(200, {"boolean": existed})
            else:
                raise _Error(400, "IllegalArgumentException", f'Invalid value for webhdfs parameter "op": {op}')

        # -- datanode -----------------------------------------------------------------------

        def _datanode(self, req: Request, hdfs_path: str) -> None:
            if self.command == "GET" and req.op == "GETFILECHECKSUM":
                data = self._exists(hdfs_path).read_bytes()
                self._json(200, {"FileChecksum": file_checksum(data, server.block_size)})
            elif self.command == "GET" and req.op == "OPEN":
                local = self._exists(hdfs_path)
                size = local.stat().st_size
                offset = int(req.params.get("offset") or 0)
                if offset > size:
                    raise _Error(403, "IOException", f"Offset={offset} out of the range [0, {size})")
                length = req.params.get("length")
                end = size if not length else min(size, offset + int(length))
                if server.datanode_delay:
                    time.sleep(server.datanode_delay)
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(end - offset))
                self.end_headers()
                with server._lock:
                    flip = server.corrupt_reads.get(hdfs_path)
                    if flip is not None and offset <= flip < end:
                        server.flipped += 1
                        if hdfs_path in server.corrupt_once:
                            del server.corrupt_reads[hdfs_path]
                with open(local, "rb") as f:
                    f.seek(offset)
                    pos = offset
                    while pos < end:
                        chunk = f.read(min(end - pos, 64 << 10))
                        if not chunk:
                            break
                        if flip is not None and pos <= flip < pos + len(chunk):
                            damaged = bytearray(chunk)
                            damaged[flip - pos] ^= 0xFF
                            chunk = bytes(damaged)
                        self.wfile.write(chunk)
                        pos += len(chunk)
                        if server.throttle_bps:
                            time.sleep(len(chunk) / server.throttle_bps)
                        with server._lock:
                            server.bytes_sent += len(chunk)
            elif self.command == "PUT" and req.op == "CREATE":
                local = server.local(hdfs_path)
                local.parent.mkdir(parents=True, exist_ok=True)
                with open(local, "wb") as out:
                    for chunk in self._body():
                        out.write(chunk)
                self.send_response(201)
                self.send_header("Location", f"hdfs://test:8020{hdfs_path}")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                raise _Error(400, "IllegalArgumentException", f"datanode cannot serve op={req.op}")

        def _body(self):  # type: ignore[no-untyped-def]
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return
                    yield self.rfile.read(size)
                    self.rfile.readline()
            left = int(self.headers.get("Content-Length") or 0)
            while left:
                chunk = self.rfile.read(min(left, 1 << 20))
                if not chunk:
                    return
                left -= len(chunk)
                yield chunk

    return Handler
