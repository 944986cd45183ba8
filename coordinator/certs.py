"""Webhook TLS: a self-signed certificate pair for development, and a reloading server context.

In a cluster the pair comes from a mounted secret (cert-manager, or made with this helper:
``python -m coordinator.certs DIR modelcache-coordinator-webhook.modelcache-system.svc``), and
the same certificate is the ``caBundle`` of the webhook configurations.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
import ssl
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)

CERT_FILE, KEY_FILE = "tls.crt", "tls.key"


def generate_self_signed(directory: Path, hosts: list[str], days: int = 365) -> tuple[Path, Path]:
    """Write ``tls.crt`` and ``tls.key`` (EC P-256) valid for ``hosts`` (DNS names or IPs)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "modelcache-webhook")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / CERT_FILE, directory / KEY_FILE
    key_bytes = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_bytes)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


class ReloadingContext:
    """A server SSLContext that picks up a rotated pair (secret volumes update in place)."""

    def __init__(self, directory: Path, interval: float = 30.0) -> None:
        self.cert, self.key = directory / CERT_FILE, directory / KEY_FILE
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._stamp = self._mtimes()
        self.context.load_cert_chain(self.cert, self.key)
        self._stop = threading.Event()
        self._interval = interval
        self._thread: threading.Thread | None = None

    def _mtimes(self) -> tuple[float, float]:
        return self.cert.stat().st_mtime, self.key.stat().st_mtime

    def start(self) -> ReloadingContext:
        self._thread = threading.Thread(target=self._watch, name="webhook-cert-reload", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                stamp = self._mtimes()
                if stamp != self._stamp:
                    self.context.load_cert_chain(self.cert, self.key)  # new handshakes use the new pair
                    self._stamp = stamp
                    log.info("webhook certificate reloaded")
            except (OSError, ssl.SSLError) as exc:
                log.warning("webhook certificate reload failed: %s", exc)


def load_tls(directory: Path) -> ReloadingContext:
    """The webhook's TLS context from ``directory``; a missing or bad pair is one line naming
    the file and the flag."""
    from modelcache.startup import StartupError

    flag = f"--webhook-cert-dir {directory}"
    for name in (CERT_FILE, KEY_FILE):
        if not (directory / name).is_file():
            raise StartupError(f"{flag}: {name} not found; mount the webhook certificate secret there "
                               "(tls.crt and tls.key), or pass --self-signed for development")
    try:
        return ReloadingContext(directory)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"{flag}: cannot load {CERT_FILE} and {KEY_FILE} ({exc.strerror or exc}); they must be "
                           "a PEM certificate and its private key") from None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m coordinator.certs DIR [HOST ...]", file=sys.stderr)
        return 2
    cert, key = generate_self_signed(Path(args[0]), args[1:] or ["localhost", "127.0.0.1"])
    print(f"wrote {cert} and {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
