"""Kerberos for HDFS/WebHDFS, as KServe configures it (KERBEROS_PRINCIPAL + KERBEROS_KEYTAB files
in the HDFS secret dir, or base64 in a storage spec), against a real MIT KDC (tests/fixtures/kdc.py)
and Hadoop's mini cluster with Kerberos on (SPNEGO on WebHDFS, block tokens, the DataNode reached
with the NameNode's delegation token; tests/fixtures/hdfs.py).

Each way a login goes wrong ends in one line naming the principal and the fix: a foreign or stale
keytab, a missing or unknown principal, an expired ticket or account, an unknown service
principal, an unreachable KDC."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from modelcache.errors import AuthError, ModelcacheError, TransientError
from modelcache.sources.kerberos import Kerberos, KerberosLogin, keytab_principals
from modelcache.sources.uri import storage_key
from tests.fixtures.hdfs import NN_HOST, SecureHDFS
from tests.fixtures.kdc import KDC
from tests.helpers import REPO, free_port
from tests.pull_helpers import error_line, manifest_of, model_files, pull_cmd

MiB = 1 << 20
URI = "hdfs://models/m"


def _name() -> str:
    return f"svc-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def krb_env(kdc: KDC, monkeypatch: pytest.MonkeyPatch) -> KDC:
    """This process's GSSAPI talks to the test KDC; the service principal a login asks for exists."""
    for key, value in kdc.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("KRB5CCNAME", raising=False)
    kdc.principal(f"HTTP/{NN_HOST}")  # no keytab export: that would change a running cluster's keys
    return kdc


def _login(principal: str | None, keytab: Path | None, secret_dir: Path, host: str = NN_HOST) -> None:
    Kerberos(KerberosLogin(principal, str(keytab) if keytab else None, str(secret_dir), URI)).check(host)


def _fails(exc: type[ModelcacheError], principal: str | None, keytab: Path | None, tmp_path: Path, *needles: str,
           host: str = NN_HOST) -> str:
    with pytest.raises(exc) as err:
        _login(principal, keytab, tmp_path, host)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(URI), msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


def test_keytab_login_and_the_principals_it_holds(
    krb_env: KDC, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keytab = tmp_path / "svc.keytab"
    principal = krb_env.principal(_name(), keytab)
    assert keytab_principals(str(keytab)) == [principal]
    default_cache = tmp_path / "default-ccache"
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{default_cache}")
    _login(principal, keytab, tmp_path)
    # The keytab's ticket went to a cache of our own: the environment's cache was not written.
    assert not default_cache.exists()


def test_logins_of_different_principals_one_after_another_in_one_process(krb_env: KDC, tmp_path: Path) -> None:
    """An agent logs in per pull, as whichever principal each model's secret names. The private
    ccache was named after id(self), and a MEMORY ccache outlives its object: a login whose object
    got a freed one's id found that principal's tickets and failed ("Principal in credential cache
    does not match desired name"). CPython hands a freed object's memory to the next of its size,
    so logging in as two principals in turn reuses ids."""
    logins = []
    for i in range(2):
        keytab = tmp_path / f"svc{i}.keytab"
        logins.append(KerberosLogin(krb_env.principal(_name(), keytab), str(keytab), str(tmp_path), URI))
    ids = set()
    for n in range(40):
        kerberos = Kerberos(logins[n % 2])  # logs in (acquires from the keytab)
        kerberos.check(NN_HOST)
        ids.add(id(kerberos))
        del kerberos
    assert len(ids) < 40, "no id was reused: this test no longer shows what it was written for"


def test_wrong_keytab(krb_env: KDC, tmp_path: Path) -> None:
    mine, other_keytab = tmp_path / "mine.keytab", tmp_path / "other.keytab"
    principal = krb_env.principal(_name(), mine)
    other = krb_env.principal(_name(), other_keytab)
    # a keytab of another principal
    _fails(AuthError, principal, other_keytab, tmp_path, f"'{principal}'", f"holds {other}", "KERBEROS_KEYTAB")
    # a stale keytab: the key was changed (ktadd again) after this copy was made
    stale = tmp_path / "stale.keytab"
    shutil.copy(mine, stale)
    krb_env.ktadd(principal, mine)
    _fails(AuthError, principal, stale, tmp_path, f"'{principal}'", "no longer accepts", f"ktadd -k FILE {principal}",
           f"KERBEROS_KEYTAB in {tmp_path}")
    _login(principal, mine, tmp_path)  # the fresh one works
    # not a keytab at all (a storage spec's value left base64-encoded, say)
    text = tmp_path / "text.keytab"
    text.write_text(base64.b64encode(mine.read_bytes()).decode())
    _fails(AuthError, principal, text, tmp_path, "not a Kerberos keytab", f"'{principal}'", "ktadd")


def test_missing_principal(krb_env: KDC, tmp_path: Path) -> None:
    keytab = tmp_path / "svc.keytab"
    principal = krb_env.principal(_name(), keytab)
    # KERBEROS_PRINCIPAL not given at all: the message names the principal the keytab holds
    _fails(AuthError, None, keytab, tmp_path, "KERBEROS_PRINCIPAL is missing", f"(the keytab holds {principal})")
    # a principal the KDC does not know (removed after its keytab was exported)
    krb_env.kadmin(f"delprinc -force {principal}")
    _fails(AuthError, principal, keytab, tmp_path, f"'{principal}' is not known to its KDC", "KERBEROS_PRINCIPAL")


def test_expired_ticket_and_expired_account(krb_env: KDC, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keytab = tmp_path / "svc.keytab"
    principal = krb_env.principal(_name(), keytab)
    # Principal without keytab: the environment's ticket cache (a kinit sidecar's) is used...
    cache = tmp_path / "ccache"
    krb_env.kinit(principal, keytab, cache, lifetime="2s")
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{cache}")
    # ...and once its ticket has run out (no timing is asserted: we only wait past its end)
    time.sleep(4)
    _fails(AuthError, principal, None, tmp_path, f"ticket of '{principal}'", "has expired", f"kinit {principal}",
           "KERBEROS_KEYTAB")
    # no ticket of that principal at all
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")
    _fails(AuthError, principal, None, tmp_path, f"no Kerberos ticket for '{principal}'", "KERBEROS_KEYTAB")
    # With the keytab, a fresh ticket comes from it whatever the cache holds.
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{cache}")
    _login(principal, keytab, tmp_path)
    # An account the KDC has expired cannot log in even with a current keytab.
    krb_env.kadmin(f"modprinc -expire yesterday {principal}")
    _fails(AuthError, principal, keytab, tmp_path, f"refuses '{principal}'", "account has expired", "modprinc")


def test_unknown_service_principal_and_unreachable_kdc(
    krb_env: KDC, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keytab = tmp_path / "svc.keytab"
    principal = krb_env.principal(_name(), keytab)
    _fails(AuthError, principal, keytab, tmp_path, "no service principal HTTP/elsewhere.test", "HDFS_NAMENODE",
           f"'{principal}'", host="elsewhere.test")
    conf = tmp_path / "krb5-nokdc.conf"
    conf.write_text(krb_env.krb5_conf.read_text().replace(f":{krb_env.port}", f":{free_port()}"))
    monkeypatch.setenv("KRB5_CONFIG", str(conf))
    _fails(TransientError, principal, keytab, tmp_path, "cannot reach a Kerberos KDC", f"'{principal}'", str(conf))


# --- against the Kerberized mini cluster ---------------------------------------------------------


def _secret(tmp_path: Path, cluster: SecureHDFS, **files: str | bytes) -> Path:
    folder = tmp_path / "hdfscreds"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, value in {"HDFS_NAMENODE": cluster.url, **files}.items():
        (folder / name).write_bytes(value if isinstance(value, bytes) else value.encode())
    return folder


def _pull(cluster: SecureHDFS, tmp_path: Path, uri: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    assert cluster.kdc is not None
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HDFS_", "STORAGE_", "KRB5"))}
    return subprocess.run(
        pull_cmd(uri, tmp_path / "root", "--chunk-size", "256K"),
        env=base | cluster.kdc.env | env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture
def secure_model(mini_hdfs_kerberos: SecureHDFS) -> tuple[str, dict[str, bytes]]:
    top = mini_hdfs_kerberos.folder()
    files = {"config.json": b'{"a": 1}', "weights/model.bin": os.urandom(2 * MiB + 4321)}
    for rel, data in files.items():
        mini_hdfs_kerberos.put(f"{top}/m/{rel}", data)
    return f"{top}/m", files


@pytest.mark.parametrize("scheme", ["hdfs", "webhdfs"])
def test_kerberos_pull_from_the_secret_dir(
    mini_hdfs_kerberos: SecureHDFS, secure_model: tuple[str, dict[str, bytes]], tmp_path: Path, scheme: str
) -> None:
    cluster = mini_hdfs_kerberos
    assert cluster.user_keytab is not None
    path, files = secure_model
    uri = f"{scheme}:/{path}"
    secret = _secret(
        tmp_path, cluster, KERBEROS_PRINCIPAL=cluster.user, KERBEROS_KEYTAB=cluster.user_keytab.read_bytes()
    )
    proc = _pull(cluster, tmp_path, uri, {"HDFS_SECRET_DIR": str(secret), "MODELCACHE_LOG_LEVEL": "DEBUG"})
    assert proc.returncode == 0, proc.stderr
    assert model_files(tmp_path / "root", uri) == files
    # Even at DEBUG no token reaches the log: not the SPNEGO header, not the delegation token the
    # NameNode puts in the DataNode redirect.
    assert "delegation=" not in proc.stderr and "Negotiate " not in proc.stderr, proc.stderr[-3000:]
    assert "OPEN" in proc.stderr or "webhdfs" in proc.stderr  # the DEBUG request lines are there
    checks = {f["path"]: f.get("checksums", {}) for f in manifest_of(tmp_path / "root", uri)["files"]}  # type: ignore[union-attr]
    assert all("hdfs-md5md5crc" in checks[p] for p in files), checks


def test_kerberos_pull_from_a_storage_spec(
    mini_hdfs_kerberos: SecureHDFS, secure_model: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    """KServe's storage spec (type hdfs): the keytab is base64 in the JSON."""
    cluster = mini_hdfs_kerberos
    assert cluster.user_keytab is not None
    path, files = secure_model
    uri = f"hdfs:/{path}"
    spec = {
        "type": "hdfs",
        "HDFS_NAMENODE": cluster.url,
        "KERBEROS_PRINCIPAL": cluster.user,
        "KERBEROS_KEYTAB": base64.b64encode(cluster.user_keytab.read_bytes()).decode(),
    }
    proc = _pull(cluster, tmp_path, uri, {"STORAGE_CONFIG": json.dumps(spec)})
    assert proc.returncode == 0, proc.stderr
    assert model_files(tmp_path / "root", uri) == files


def test_kerberos_pull_errors(
    mini_hdfs_kerberos: SecureHDFS, secure_model: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    cluster = mini_hdfs_kerberos
    assert cluster.kdc is not None
    path, _ = secure_model
    uri = f"hdfs:/{path}"
    # No Kerberos settings for a Kerberized cluster: says which files to add.
    proc = _pull(cluster, tmp_path, uri, {"HDFS_SECRET_DIR": str(_secret(tmp_path, cluster))})
    error_line(proc, uri, "KERBEROS_PRINCIPAL and KERBEROS_KEYTAB")
    # A stale keytab of a user (its key changed since): names the principal and the fix.
    keytab = tmp_path / "u.keytab"
    user = cluster.kdc.principal(_name(), keytab)
    stale = keytab.read_bytes()
    cluster.kdc.ktadd(user, keytab)
    secret = _secret(tmp_path, cluster, KERBEROS_PRINCIPAL=user, KERBEROS_KEYTAB=stale)
    line = error_line(_pull(cluster, tmp_path, uri, {"HDFS_SECRET_DIR": str(secret)}), uri, f"'{user}'", "ktadd")
    assert "no longer accepts" in line
    # A principal HDFS knows but that may not read the folder: HDFS's own denial.
    cluster.chmod(path, "700")
    try:
        secret = _secret(tmp_path, cluster, KERBEROS_PRINCIPAL=user, KERBEROS_KEYTAB=keytab.read_bytes())
        error_line(_pull(cluster, tmp_path, uri, {"HDFS_SECRET_DIR": str(secret)}), uri, "denied")
    finally:
        cluster.chmod(path, "755")
    assert not (tmp_path / "root/models" / storage_key(uri)).exists()


def test_principal_without_realm_uses_the_default_realm(krb_env: KDC, tmp_path: Path) -> None:
    keytab = tmp_path / "svc.keytab"
    name = _name()
    krb_env.principal(name, keytab)
    _login(name, keytab, tmp_path)  # krb5.conf's default_realm completes it, as kinit does


def test_kerberos_with_user_proxy(
    mini_hdfs_kerberos: SecureHDFS, secure_model: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    """USER_PROXY with Kerberos: the keytab's principal logs in and acts for another user (doas),
    which the cluster allows it (hadoop.proxyuser.loader.*): a folder only its owner may read."""
    cluster = mini_hdfs_kerberos
    assert cluster.user_keytab is not None
    path, files = secure_model
    uri = f"webhdfs:/{path}"
    cluster.chmod(path, "700")  # the superuser's (hdfs) folder
    try:
        keytab = cluster.user_keytab.read_bytes()
        alone = _secret(tmp_path, cluster, KERBEROS_PRINCIPAL=cluster.user, KERBEROS_KEYTAB=keytab)
        error_line(_pull(cluster, tmp_path, uri, {"HDFS_SECRET_DIR": str(alone)}), uri, "denied")
        doas = _secret(
            tmp_path, cluster, KERBEROS_PRINCIPAL=cluster.user, KERBEROS_KEYTAB=keytab, USER_PROXY=cluster.superuser
        )
        proc = _pull(cluster, tmp_path, uri, {"HDFS_SECRET_DIR": str(doas)})
        assert proc.returncode == 0, proc.stderr
        assert model_files(tmp_path / "root", uri) == files
    finally:
        cluster.chmod(path, "755")
