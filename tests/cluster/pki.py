"""Certificates and keys of one test control plane, made with trustme.

One CA signs the API server's serving certificate and every client certificate; the client
certificates carry the identities a real cluster's components have (CN = user, O = group), so
RBAC's bootstrap bindings apply to them unchanged. The CA's key is kept (ca.key, 0600) to sign the
certificates of kubelets that join later (`issue_client`: CN system:node:<name>, O system:nodes, the
identity the Node authorizer and NodeRestriction know). The controller manager's CSR signer is not
used for them: it signs with the API server's leaf pair, which would not chain to ca.crt.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: name -> (common name, organization): the identities RBAC's bootstrap policy knows.
CLIENTS = {
    "admin": ("kubernetes-admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "scheduler": ("system:kube-scheduler", None),
    "kube-proxy": ("system:kube-proxy", None),
}
SERVER_NAMES = ("127.0.0.1", "::1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local", "10.96.0.1")


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class PKI:
    ca: Path
    server: Pair
    clients: dict[str, Pair]
    sa_public: Path
    sa_private: Path


def make_pki(folder: Path, extra_names: Sequence[str] = ()) -> PKI:
    """``extra_names``: more addresses the API server is reached at (a node network's gateway)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="modelcache test cluster")
    ca.cert_pem.write_to_path(str(folder / "ca.crt"))
    ca.private_key_pem.write_to_path(str(folder / "ca.key"))
    (folder / "ca.key").chmod(0o600)

    def write(name: str, leaf: trustme.LeafCert) -> Pair:
        pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
        leaf.cert_chain_pems[0].write_to_path(str(pair.cert))
        leaf.private_key_pem.write_to_path(str(pair.key))
        pair.key.chmod(0o600)
        return pair

    server = write("apiserver", ca.issue_cert(*SERVER_NAMES, *extra_names, common_name="kube-apiserver"))
    clients = {name: write(name, ca.issue_cert("localhost", common_name=cn, organization_name=org))
               for name, (cn, org) in CLIENTS.items()}
    # Service-account tokens are signed with RSA, as kubeadm does.
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sa_private, sa_public = folder / "sa.key", folder / "sa.pub"
    sa_private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    sa_private.chmod(0o600)
    sa_public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))
    return PKI(folder / "ca.crt", server, clients, sa_public, sa_private)


def issue_client(folder: Path, name: str, common_name: str, organization: str | None) -> Pair:
    """A client certificate signed by the CA in ``folder`` (make_pki's), as ``<name>.crt/.key``."""
    ca_cert = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey))
    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        subject.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name(subject)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pair.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    pair.key.chmod(0o600)
    return pair
