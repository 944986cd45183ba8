"""A Docker registry token server for tests (the Bearer flow real registries use).

``GET /token?service=&scope=repository:<name>:pull[,push]`` with Basic credentials answers
``{"token": <JWT>}``: an RS256 JWT whose ``x5c`` header carries a self-signed certificate that
the registry trusts (a trustme CA) (``auth.token.rootcertbundle``) and whose ``access`` claim grants the asked
actions to a known user, nothing to anyone else (the registry then answers 401).
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

SERVICE = "modelcache-test-registry"
ISSUER = "modelcache-test-issuer"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenServer:
    users: dict[str, str]
    tokens_issued: int = 0
    requests: list[dict[str, str]] = field(default_factory=list)

    def start(self, folder: Path) -> TokenServer:
        # The signer is a trustme CA (RSA: the JWT is RS256); its own certificate is both the
        # registry's trusted bundle and the token's x5c chain.
        ca = trustme.CA(organization_name="token-signer", key_type=trustme.KeyType.RSA)
        key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
        assert isinstance(key, rsa.RSAPrivateKey)
        self._key = key
        self._cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
        self.cert_path = folder / "token-cert.pem"
        ca.cert_pem.write_to_path(str(self.cert_path))
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/token"

    def issue(self, user: str | None, scopes: list[str]) -> str:
        access = []
        if user is not None:
            for scope in scopes:
                kind, _, rest = scope.partition(":")
                repo, _, actions = rest.rpartition(":")
                access.append({"type": kind, "name": repo, "actions": actions.split(",")})
        der = self._cert.public_bytes(serialization.Encoding.DER)
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(der).decode()]}
        now = int(time.time())
        claims = {
            "iss": ISSUER,
            "sub": user or "",
            "aud": SERVICE,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = self._key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        self.tokens_issued += 1
        return f"{signing_input}.{_b64url(sig)}"

    def registry_config(self) -> str:
        return (
            "auth:\n  token:\n"
            f"    realm: {self.realm}\n    service: {SERVICE}\n    issuer: {ISSUER}\n"
            f"    rootcertbundle: {self.cert_path}\n"
        )


def _handler(server: TokenServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            query = parse_qs(parts.query)
            user = None
            auth = self.headers.get("Authorization", "")
            if auth.startswith("Basic "):
                name, _, password = base64.b64decode(auth[6:]).decode().partition(":")
                if server.users.get(name) != password:
                    return self._send(401, {"details": "invalid credentials"})
                user = name
            server.requests.append({"user": user or "", "scope": " ".join(query.get("scope", []))})
            token = server.issue(user, [s for v in query.get("scope", []) for s in v.split(" ") if s])
            self._send(200, {"token": token, "access_token": token, "expires_in": 300})

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
