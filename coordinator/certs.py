"""Webhook TLS: a CA and the serving pair it signs, a self-signed pair for development, and a
reloading server context.

In a cluster the coordinator keeps its own CA and serving pair in a Secret
(coordinator/webhookcerts.py); with the cert-manager component the pair is a mounted secret. For
development: ``python -m coordinator.certs DIR HOST...`` writes a self-signed pair whose
certificate is also the webhook configurations' ``caBundle``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelcache.runtime.loop import Loop

log = logging.getLogger(__name__)

CERT_FILE, KEY_FILE = "tls.crt", "tls.key"
#: Certificates are valid from a little before they are made (clocks of other machines lag).
BACKDATE = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class Pair:
    """A PEM certificate and its PEM (PKCS#8) private key."""

    cert: bytes
    key: bytes


def _san(hosts: list[str]) -> Any:
    from cryptography import x509

    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_ca(common_name: str, validity: dt.timedelta, now: dt.datetime | None = None) -> Pair:
    """A CA (EC P-256) that signs serving certificates only (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = now or dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE).not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Pair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_serving(ca: Pair, hosts: list[str], validity: dt.timedelta, now: dt.datetime | None = None) -> Pair:
    """A serving certificate for ``hosts`` (DNS names or IPs) signed by ``ca``, never outliving it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = now or dt.datetime.now(dt.UTC)
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    not_after = min(now + validity, ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE).not_valid_after(not_after)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
                       critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return Pair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


@dataclass(frozen=True)
class CertInfo:
    not_before: dt.datetime
    not_after: dt.datetime
    hosts: frozenset[str]
    issuer: bytes
    subject: bytes

    @property
    def issued(self) -> dt.datetime:
        return self.not_before + BACKDATE

    def due(self, now: dt.datetime, renew_fraction: float) -> bool:
        """True once less than ``renew_fraction`` of the lifetime (from issue to expiry) is left,
        or when it is not valid yet."""
        return now < self.not_before or self.not_after - now < (self.not_after - self.issued) * renew_fraction


def parse_certs(pem: bytes) -> list[CertInfo]:
    """Every certificate in a PEM bundle (an unparsable one raises ValueError)."""
    from cryptography import x509

    out = []
    for cert in x509.load_pem_x509_certificates(pem):
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            hosts = {str(n) for n in san.get_values_for_type(x509.DNSName)} | \
                {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
        except x509.ExtensionNotFound:
            hosts = set()
        out.append(CertInfo(cert.not_valid_before_utc, cert.not_valid_after_utc, frozenset(hosts),
                            cert.issuer.public_bytes(), cert.subject.public_bytes()))
    return out


def signed_by(cert_pem: bytes, ca_pem: bytes) -> bool:
    """Whether the (first) certificate in ``cert_pem`` verifies under the CA certificate ``ca_pem``."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert.verify_directly_issued_by(ca)
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


def keys_match(pair: Pair) -> bool:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(pair.cert)
        key = serialization.load_pem_private_key(pair.key, password=None)
    except (ValueError, TypeError):
        return False
    return bool(cert.public_key() == key.public_key())


def write_pair(directory: Path, pair: Pair) -> None:
    """Replace ``tls.crt``/``tls.key`` in ``directory`` (key mode 0600), each by an atomic rename,
    the key first: a reader that sees the new certificate also finds its key."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name, data, mode in ((KEY_FILE, pair.key, 0o600), (CERT_FILE, pair.cert, 0o644)):
        tmp = directory / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, directory / name)


def generate_self_signed(directory: Path, hosts: list[str], days: int = 365) -> tuple[Path, Path]:
    """Write ``tls.crt`` and ``tls.key`` (EC P-256) valid for ``hosts`` (DNS names or IPs)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "modelcache-webhook")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    write_pair(directory, Pair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)))
    return directory / CERT_FILE, directory / KEY_FILE


class ReloadingContext:
    """A server SSLContext that picks up a rotated pair (secret volumes update in place)."""

    def __init__(self, directory: Path, interval: float = 30.0, client_ca: Path | None = None) -> None:
        self.cert, self.key = directory / CERT_FILE, directory / KEY_FILE
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if client_ca is not None:
            # Mutual TLS: a caller without a certificate signed by this CA fails the handshake.
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(cafile=str(client_ca))
        self._stamp = self._mtimes()
        self.context.load_cert_chain(self.cert, self.key)
        self._observe()
        self._loop = Loop("webhook-cert-reload", self._reload_logged, interval, at_start=False, logger=log)

    def _observe(self) -> None:
        """The served certificate's expiry, for the "webhook certificate near expiry" alert (also a
        cert-manager pair that stopped being renewed)."""
        from coordinator import metrics

        try:
            leaf = parse_certs(self.cert.read_bytes())[0]
        except (OSError, ValueError, IndexError) as exc:
            log.warning("webhook certificate: cannot read its expiry: %s", exc)
            return
        metrics.WEBHOOK_CERT_EXPIRY.set(leaf.not_after.timestamp())

    def _mtimes(self) -> tuple[int, int, int, int]:
        # The inode too: a pair replaced by rename within one mtime tick still counts as changed.
        c, k = self.cert.stat(), self.key.stat()
        return c.st_ino, c.st_mtime_ns, k.st_ino, k.st_mtime_ns

    def start(self) -> ReloadingContext:
        self._loop.start()
        return self

    def stop(self) -> None:
        self._loop.stop()

    def reload(self) -> bool:
        """Load the pair again if a file changed; True when it did."""
        stamp = self._mtimes()
        if stamp == self._stamp:
            return False
        self.context.load_cert_chain(self.cert, self.key)  # new handshakes use the new pair
        self._stamp = stamp
        self._observe()
        log.info("webhook certificate reloaded")
        return True

    def _reload_logged(self) -> None:
        try:
            self.reload()
        except (OSError, ssl.SSLError) as exc:  # a pair caught half-written: the next round reads it whole
            log.warning("webhook certificate reload failed: %s", exc)


def load_tls(directory: Path, client_ca: Path | None = None) -> ReloadingContext:
    """The webhook's TLS context from ``directory`` (requiring client certificates signed by
    ``client_ca``, if given); a missing or bad file is one line naming the file and the flag."""
    from modelcache.runtime.startup import StartupError

    flag = f"--webhook-cert-dir {directory}"
    for name in (CERT_FILE, KEY_FILE):
        if not (directory / name).is_file():
            raise StartupError(f"{flag}: {name} not found; mount the webhook certificate secret there "
                               "(tls.crt and tls.key), or pass --self-signed for development")
    if client_ca is not None:
        try:
            ssl.create_default_context(cafile=str(client_ca))
        except (OSError, ssl.SSLError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise StartupError(f"--webhook-client-ca {client_ca}: cannot load it ({why}); it must be the PEM CA "
                               "that signs the API server's webhook client certificate") from None
    try:
        return ReloadingContext(directory, client_ca=client_ca)
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
