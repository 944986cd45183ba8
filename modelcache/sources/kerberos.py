"""Kerberos (SPNEGO) for WebHDFS, from KServe's KERBEROS_PRINCIPAL + KERBEROS_KEYTAB.

KServe runs ``kinit``-like logins through krbcontext into a process-wide ticket cache; we ask
GSSAPI (MIT krb5 through the ``gssapi`` package) for credentials of that principal straight
from the keytab, kept in a ccache private to this process (``MEMORY:``), so nothing of the
machine's ticket cache is read or overwritten and GSSAPI gets a new ticket from the keytab
when the old one runs out during a long pull. With a principal and no keytab, the ticket
cache of the environment (``KRB5CCNAME``, e.g. filled by a kinit sidecar) is used.

Every Kerberos failure a user can fix (no such principal, a stale or foreign keytab, an
expired ticket, an unknown service principal, an unreachable KDC) is one line naming the
principal and the fix; GSSAPI's own text is only a hint at the end.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any

from modelcache.errors import AuthError, ModelcacheError, SourceError, TransientError, UnsupportedError

# requests-gssapi logs every failed GSS step with log.exception (a traceback); we raise one line.
logging.getLogger("requests_gssapi").setLevel(logging.CRITICAL)

_CCACHES = itertools.count(1)  # one private MEMORY ccache per login of this process

# krb5 error codes (krb5/krb5_err.h) as GSSAPI's minor status carries them.
_CLIENT_UNKNOWN = -1765328378  # KDC_ERR_C_PRINCIPAL_UNKNOWN
_SERVER_UNKNOWN = -1765328377  # KDC_ERR_S_PRINCIPAL_UNKNOWN
_CLIENT_EXPIRED = -1765328383  # KDC_ERR_NAME_EXP
_KEY_EXPIRED = -1765328361  # KDC_ERR_KEY_EXP (password expired)
_PREAUTH_FAILED = -1765328360  # KDC_ERR_PREAUTH_FAILED
_BAD_INTEGRITY = -1765328353  # KRB_AP_ERR_BAD_INTEGRITY (key does not decrypt)
_TKT_EXPIRED = -1765328352  # KRB_AP_ERR_TKT_EXPIRED
_KT_NOTFOUND = -1765328203  # KRB5_KT_NOTFOUND: no keytab entry for the principal
_KDC_UNREACH = -1765328228  # KRB5_KDC_UNREACH
_REALM_UNKNOWN = -1765328230  # KRB5_REALM_UNKNOWN
_CC_NOTFOUND = -1765328243  # KRB5_CC_NOTFOUND: no ticket of that principal in the cache
_FCC_NOFILE = -1765328189  # KRB5_FCC_NOFILE: no ticket cache at all
_WRONG_KEY = {_PREAUTH_FAILED, _BAD_INTEGRITY, _KT_NOTFOUND}


@dataclass(frozen=True)
class KerberosLogin:
    """Who logs in: KERBEROS_PRINCIPAL and the path of the KERBEROS_KEYTAB file (or None)."""

    principal: str | None
    keytab: str | None
    secret_dir: str
    where: str  # the URI, for messages

    def _fail(self, cls: type[ModelcacheError], text: str) -> ModelcacheError:
        return cls(f"{self.where}: {text}")


def keytab_principals(path: str) -> list[str]:
    """The principals a keytab file holds (MIT keytab format 0x0501/0x0502), for messages:
    what ``klist -k`` prints. Empty if the file is not a keytab."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        return []
    if len(data) < 2 or data[0] != 5 or data[1] not in (1, 2):
        return []
    v2, pos, found = data[1] == 2, 2, []

    def counted(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(">H", data, at)
        return data[at + 2 : at + 2 + n].decode("utf-8", "replace"), at + 2 + n

    try:
        while pos + 4 <= len(data):
            (size,) = struct.unpack_from(">i", data, pos)
            pos += 4
            if size <= 0:  # a hole left by a removed entry
                pos += -size
                continue
            entry_end, at = pos + size, pos
            (ncomp,) = struct.unpack_from(">H", data, at)
            at += 2
            if not v2:
                ncomp -= 1  # version 1 counted the realm too
            realm, at = counted(at)
            parts = []
            for _ in range(ncomp):
                part, at = counted(at)
                parts.append(part)
            name = "/".join(parts) + "@" + realm
            if name not in found:
                found.append(name)
            pos = entry_end
    except struct.error:
        pass
    return found


class _SerialSPNEGOAuth:
    """requests-gssapi's SPNEGO handler made safe for our worker threads: it keeps one security
    context per host in a dict, so two 401 handshakes at once could step each other's context.
    After the first handshake the NameNode's ``hadoop.auth`` cookie authenticates the session,
    so serialising the (rare) handshakes costs nothing."""

    def __init__(self, creds: Any) -> None:
        from requests_gssapi import OPTIONAL, HTTPSPNEGOAuth

        # Mutual authentication when the server offers it (the NameNode does, on the handshake);
        # OPTIONAL because the DataNode's answers (a delegation token in the redirect
        # authenticates us there) carry no Negotiate header.
        self._auth = HTTPSPNEGOAuth(creds=creds, mutual_authentication=OPTIONAL)
        self._lock = threading.RLock()
        inner = self._auth.handle_response

        def handle_response(response: Any, **kwargs: Any) -> Any:
            with self._lock:
                return inner(response, **kwargs)

        self._auth.handle_response = handle_response

    def __call__(self, request: Any) -> Any:
        return self._auth(request)


class Kerberos:
    """Credentials for one login, checked once against the KDC, and the requests auth for them."""

    def __init__(self, login: KerberosLogin) -> None:
        self.login = login
        if not login.principal:
            held = keytab_principals(login.keytab or "")
            hint = f" (the keytab holds {', '.join(held)})" if held else ""
            raise login._fail(
                AuthError,
                f"KERBEROS_KEYTAB is set in {login.secret_dir} but KERBEROS_PRINCIPAL is missing; put the "
                f"keytab's principal{hint} in the file KERBEROS_PRINCIPAL there",
            )
        if login.keytab:
            held = keytab_principals(login.keytab)
            if not held:
                raise login._fail(
                    AuthError,
                    f"KERBEROS_KEYTAB in {login.secret_dir} is not a Kerberos keytab (principal "
                    f"'{login.principal}'); export one (kadmin: ktadd -k FILE {login.principal}) and put it there "
                    "as a file (base64 in a storage spec)",
                )
            if not any(_same_principal(login.principal, h) for h in held):
                # GSSAPI would only say "No credentials cache found".
                raise login._fail(
                    AuthError,
                    f"Kerberos login as '{login.principal}' failed: KERBEROS_KEYTAB in {login.secret_dir} has no "
                    f"key for it (it holds {', '.join(held)}); put that principal's keytab there, or the keytab's "
                    "principal in KERBEROS_PRINCIPAL",
                )
        try:
            import gssapi
            import requests_gssapi  # noqa: F401 - checked here so a missing one fails before any request
        except ImportError as exc:
            raise login._fail(
                UnsupportedError,
                f"Kerberos login as '{login.principal}' needs the Python packages gssapi and requests-gssapi "
                f"(pip install 'modelcache[kerberos]', with MIT Kerberos' libkrb5) ({exc.name} is missing)",
            ) from exc
        self._gssapi = gssapi
        name = gssapi.Name(login.principal, gssapi.NameType.kerberos_principal)
        store: dict[bytes | str, bytes | str] | None = None
        if login.keytab:
            # A ccache of our own: the keytab's tickets never land in (or come from) the machine's.
            # Named by a counter, not id(self): a MEMORY ccache outlives its object, and a reused
            # id handed a later login the tickets of another principal ("Principal in credential
            # cache does not match desired name").
            store = {"client_keytab": login.keytab, "ccache": f"MEMORY:modelcache-{os.getpid()}-{next(_CCACHES)}"}
        try:
            self.creds = gssapi.Credentials(name=name, usage="initiate", store=store)
        except gssapi.exceptions.GSSError as exc:
            raise self.explain(exc, None) from exc
        self._checked: set[str] = set()

    def auth(self) -> Any:
        """The requests auth: SPNEGO on a 401 with ``WWW-Authenticate: Negotiate``."""
        return _SerialSPNEGOAuth(self.creds)

    def check(self, host: str) -> None:
        """Log in and get a ticket for ``HTTP/host`` now, so a bad keytab or principal fails with
        its own message instead of as a bare 401 from the NameNode."""
        if host in self._checked:
            return
        gssapi = self._gssapi
        target = gssapi.Name(f"HTTP@{host}", gssapi.NameType.hostbased_service)
        try:
            gssapi.SecurityContext(name=target, creds=self.creds, usage="initiate").step()
        except gssapi.exceptions.GSSError as exc:
            raise self.explain(exc, host) from exc
        self._checked.add(host)

    def explain(self, exc: Exception, host: str | None) -> ModelcacheError:
        login, principal = self.login, self.login.principal
        where_keytab = f"KERBEROS_KEYTAB in {login.secret_dir}"
        cache = os.environ.get("KRB5CCNAME", "the default ticket cache")
        minor = int(getattr(exc, "min_code", 0) or 0)
        if minor >= 1 << 31:  # GSSAPI hands the krb5 code over as an unsigned 32-bit number
            minor -= 1 << 32
        text = _gss_text(exc)
        if minor == _CLIENT_UNKNOWN:
            return login._fail(
                AuthError,
                f"Kerberos principal '{principal}' is not known to its KDC; check KERBEROS_PRINCIPAL in "
                f"{login.secret_dir}, or ask the Kerberos admin whether it was removed",
            )
        if minor in _WRONG_KEY and login.keytab:
            return login._fail(
                AuthError,
                f"Kerberos login as '{principal}' failed: the keytab holds keys for '{principal}' that the KDC "
                f"no longer accepts (the key was changed since); export a current keytab for '{principal}' "
                f"(kadmin: ktadd -k FILE {principal}) into {where_keytab}",
            )
        if minor == _TKT_EXPIRED:
            if login.keytab:
                return login._fail(
                    AuthError,
                    f"the Kerberos ticket of '{principal}' has expired and could not be renewed from "
                    f"{where_keytab}; check that the keytab is current ({text})",
                )
            return login._fail(
                AuthError,
                f"the Kerberos ticket of '{principal}' in {cache} has expired; renew it (kinit {principal}) "
                f"or give the principal's keytab as {where_keytab}",
            )
        if minor in (_CLIENT_EXPIRED, _KEY_EXPIRED):
            what = "account" if minor == _CLIENT_EXPIRED else "password"
            return login._fail(
                AuthError,
                f"the KDC refuses '{principal}': its {what} has expired; ask the Kerberos admin to renew it "
                f"(kadmin: modprinc), then export a new keytab into {where_keytab}",
            )
        if minor == _SERVER_UNKNOWN and host:
            return login._fail(
                AuthError,
                f"the KDC has no service principal HTTP/{host} for the WebHDFS namenode (logging in as "
                f"'{principal}'); write the namenode's host name as in its Kerberos principal (not an IP "
                f"address or alias) in HDFS_NAMENODE of {login.secret_dir}",
            )
        if minor in (_KDC_UNREACH, _REALM_UNKNOWN):
            conf = os.environ.get("KRB5_CONFIG", "/etc/krb5.conf")
            return login._fail(
                TransientError if minor == _KDC_UNREACH else SourceError,
                f"cannot reach a Kerberos KDC to log in as '{principal}'; check the realm's kdc in {conf} "
                "(KRB5_CONFIG)",
            )
        if not login.keytab and minor in (_CC_NOTFOUND, _FCC_NOFILE):
            return login._fail(
                AuthError,
                f"no Kerberos ticket for '{principal}' in {cache}; give the principal's keytab as {where_keytab} "
                f"or run kinit {principal}",
            )
        return login._fail(AuthError, f"Kerberos login as '{principal}' failed: {text}")


def _gss_text(exc: Exception) -> str:
    gen = getattr(exc, "gen_message", None)
    text = gen() if callable(gen) else str(exc)
    return " ".join(str(text).split())[:300]


def _same_principal(given: str, held: str) -> bool:
    """``svc`` (no realm: the default realm applies) matches ``svc@REALM`` in a keytab."""
    return given == held or ("@" not in given and held.rsplit("@", 1)[0] == given)
