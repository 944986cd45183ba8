"""Certificates and keys of one test control plane, made with trustme.

One CA signs the API server's serving certificate and every client certificate; the client
certificates carry the identities a real cluster's components have (CN = user, O = group), so
RBAC's bootstrap bindings apply to them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

#: name -> (common name, organization): the identities RBAC's bootstrap policy knows.
CLIENTS = {
    "admin": ("kubernetes-admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "scheduler": ("system:kube-scheduler", None),
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


def make_pki(folder: Path) -> PKI:
    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="modelcache test cluster")
    ca.cert_pem.write_to_path(str(folder / "ca.crt"))

    def write(name: str, leaf: trustme.LeafCert) -> Pair:
        pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
        leaf.cert_chain_pems[0].write_to_path(str(pair.cert))
        leaf.private_key_pem.write_to_path(str(pair.key))
        pair.key.chmod(0o600)
        return pair

    server = write("apiserver", ca.issue_cert(*SERVER_NAMES, common_name="kube-apiserver"))
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
