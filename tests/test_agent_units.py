"""Agent pieces without servers: quantities, reservations, credential mapping, subPath parsing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agent.capacity import Capacity
from agent.credentials import CredentialConfig, Credentials, misnamed_s3_keys, service_account_env, storage_env
from agent.inuse import subpath_key
from modelcache.errors import AuthError, InsufficientSpaceError, RateLimitedError
from modelcache.kube.quantity import parse_quantity
from modelcache.kube.types import LocalModelInfo, StorageSpec


@pytest.mark.parametrize(("text", "value"), [
    ("3Mi", 3 << 20), ("1Gi", 1 << 30), ("1.5G", 1_500_000_000), ("5e3", 5000), (1024, 1024), ("", None),
    ("bogus", None), ("100", 100), ("2Ti", 2 << 40), ("64Ki", 64 << 10), ("2k", 2000), ("1ki", None),
])
def test_parse_quantity(text: Any, value: int | None) -> None:
    assert parse_quantity(text) == value


def test_reservations_count_against_disk_and_limit(tmp_path: Path) -> None:
    used = {"n": 0}
    cap = Capacity(tmp_path, margin=10, used_bytes=lambda: used["n"], disk_usage=lambda _p: (1000, 500))
    cap.reserve("a", 300, 300, None, "a")
    with pytest.raises(InsufficientSpaceError, match="insufficient space: need 200 B, free 190 B"):
        cap.reserve("b", 200, 200, None, "b")  # 500 free - 10 margin - 300 reserved
    cap.reserve("a", 100, 100, None, "a")  # a re-reservation replaces the first
    cap.reserve("b", 200, 200, None, "b")
    assert cap.reserved_bytes == 300
    cap.release("a")
    cap.release("b")
    used["n"] = 700
    with pytest.raises(InsufficientSpaceError, match="storageLimit"):
        cap.reserve("c", 10, 400, 1000, "c")  # the limit holds 700 already
    cap.reserve("c", 10, 300, 1000, "c")
    assert cap.reserved_bytes == 10


class Reader:
    def __init__(self, secrets: dict[str, dict[str, Any]], sas: dict[str, dict[str, Any]]) -> None:
        self.secrets, self.sas = secrets, sas

    def secret(self, name: str) -> dict[str, Any] | None:
        return self.secrets.get(name)

    def service_account(self, name: str) -> dict[str, Any] | None:
        return self.sas.get(name)

    def credential_config(self) -> CredentialConfig:
        return CredentialConfig()


def test_service_account_secrets_map_like_kserve(tmp_path: Path) -> None:
    reader = Reader(
        secrets={
            "s3": {"metadata": {"annotations": {"serving.kserve.io/s3-endpoint": "minio:9000",
                                                "serving.kserve.io/s3-usehttps": "0"}},
                   "stringData": {"awsAccessKeyID": "AK", "awsSecretAccessKey": "SK"}},
            "gcs": {"stringData": {"gcloud-application-credentials.json": '{"type": "service_account"}'}},
            "hdfs": {"stringData": {"HDFS_NAMENODE": "http://nn:9870", "USER_PROXY": "alice"}},
            "web": {"stringData": {"https-host": "models.example.com", "headers": '{"X-Token": "t"}',
                                   "HF_TOKEN": "hf_x", "AZ_CLIENT_ID": "cid"}},
        },
        sas={"sa": {"metadata": {"annotations": {"serving.kserve.io/s3-region": "eu-west-1"}},
                    "secrets": [{"name": "s3"}, {"name": "gcs"}, {"name": "web"}, {"name": "hdfs"}, {"name": "gone"}]}},
    )
    env = service_account_env(LocalModelInfo(model_name="m", service_account_name="sa"), reader, str(tmp_path))
    assert env["AWS_ACCESS_KEY_ID"] == "AK" and env["AWS_SECRET_ACCESS_KEY"] == "SK"
    assert env["S3_ENDPOINT"] == "minio:9000" and env["S3_USE_HTTPS"] == "0"
    # The service account's s3-* annotations count only with IRSA's, as KServe reads them (L5).
    assert "AWS_DEFAULT_REGION" not in env
    reader.sas["sa"]["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] = "arn:aws:iam::1:role/r"
    env = service_account_env(LocalModelInfo(model_name="m", service_account_name="sa"), reader, str(tmp_path))
    assert env["AWS_DEFAULT_REGION"] == "eu-west-1"  # an IRSA service account's annotation
    key_file = Path(env["GOOGLE_APPLICATION_CREDENTIALS"])
    assert json.loads(key_file.read_text()) == {"type": "service_account"}
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert env["models.example.com-headers"] == '{"X-Token": "t"}'
    assert env["HF_TOKEN"] == "hf_x" and env["AZ_CLIENT_ID"] == "cid"
    hdfs = Path(env["HDFS_SECRET_DIR"])
    assert (hdfs / "HDFS_NAMENODE").read_text() == "http://nn:9870" and (hdfs / "USER_PROXY").read_text() == "alice"
    with pytest.raises(AuthError, match="service account 'nope' not found"):
        service_account_env(LocalModelInfo(model_name="m", service_account_name="nope"), reader, str(tmp_path))


def test_s3_keys_under_the_other_spelling_are_skipped_as_kserve_skips_them_and_named_when_it_fails(
        tmp_path: Path) -> None:
    """KServe's shipped ConfigMap names the keys AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, its code's
    default (no ConfigMap: no KServe installed) awsAccessKeyID/awsSecretAccessKey. A Secret of the
    other spelling is skipped, as KServe skips it (an instance role may be what the user relies on),
    but a download that then fails says why (on real nodes it failed with "no AWS credentials")."""
    shipped = {"stringData": {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK"}}
    reader = Reader(secrets={"s3": shipped}, sas={"sa": {"secrets": [{"name": "s3"}]},
                                                  "irsa": {"metadata": {"annotations": {
                                                      "eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/r"}},
                                                      "secrets": [{"name": "s3"}]}})
    info = LocalModelInfo(model_name="m", service_account_name="sa")
    assert "AWS_SECRET_ACCESS_KEY" not in service_account_env(info, reader, str(tmp_path))
    hint = misnamed_s3_keys(info, reader, CredentialConfig())
    assert hint is not None and hint.startswith(
        "Secret 's3' of service account 'sa' holds its S3 keys as AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, but the "
        "credentials config reads awsAccessKeyID/awsSecretAccessKey (KServe's default")
    credentials = Credentials(reader, {})
    with pytest.raises(AuthError) as caught, credentials.env_for(info):
        raise AuthError("no AWS credentials for s3://b/m: set AWS_ACCESS_KEY_ID")
    assert str(caught.value) == f"no AWS credentials for s3://b/m: set AWS_ACCESS_KEY_ID; {hint}"
    with pytest.raises(RateLimitedError) as limited, credentials.env_for(info):
        raise RateLimitedError("slow down", retry_after=3)
    assert limited.value.retry_after == 3  # the same error otherwise (retries behave the same)
    # Under KServe's shipped ConfigMap the same Secret is what it reads: nothing to say.
    config = CredentialConfig(s3={"s3AccessKeyIDName": "AWS_ACCESS_KEY_ID",
                                  "s3SecretAccessKeyName": "AWS_SECRET_ACCESS_KEY"})
    env = service_account_env(info, reader, str(tmp_path), config)
    assert env["AWS_ACCESS_KEY_ID"] == "AK" and env["AWS_SECRET_ACCESS_KEY"] == "SK"
    assert misnamed_s3_keys(info, reader, config) is None
    # ... and the other way round, named after the ConfigMap.
    reader.secrets["s3"] = {"stringData": {"awsAccessKeyID": "AK", "awsSecretAccessKey": "SK"}}
    assert "reads AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (ConfigMap " in str(misnamed_s3_keys(info, reader, config))
    # IRSA needs no keys: nothing to say; nor when the keys were read.
    reader.secrets["s3"] = shipped
    assert misnamed_s3_keys(LocalModelInfo(model_name="m", service_account_name="irsa"), reader,
                            CredentialConfig()) is None
    reader.secrets["s3"] = {"stringData": {"awsAccessKeyID": "AK", "awsSecretAccessKey": "SK"}}
    with pytest.raises(AuthError) as plain, credentials.env_for(info):
        raise AuthError("denied")
    assert str(plain.value) == "denied"


def test_storage_spec_key_defaults_and_overrides() -> None:
    reader = Reader(secrets={"storage-config": {"stringData": {
        "default": '{"type": "s3", "bucket": "d"}', "default_s3": '{"type": "s3", "bucket": "typed"}'}}}, sas={})
    explicit = storage_env(LocalModelInfo(model_name="m", storage=StorageSpec(key="default")), reader)
    assert json.loads(explicit["STORAGE_CONFIG"])["bucket"] == "d" and "STORAGE_OVERRIDE_CONFIG" not in explicit
    typed = storage_env(LocalModelInfo(model_name="m", storage=StorageSpec(parameters={"type": "s3"})), reader)
    assert json.loads(typed["STORAGE_CONFIG"])["bucket"] == "typed"
    assert json.loads(typed["STORAGE_OVERRIDE_CONFIG"]) == {"type": "s3"}
    with pytest.raises(AuthError, match="no key 'other'"):
        storage_env(LocalModelInfo(model_name="m", storage=StorageSpec(key="other")), reader)


def test_settings_are_built_per_download_without_touching_the_environment() -> None:
    before = dict(os.environ)
    reader = Reader(secrets={"storage-config": {"stringData": {"k": json.dumps({
        "type": "s3", "access_key_id": "A1", "secret_access_key": "S1", "endpoint_url": "http://s3.local"})}}}, sas={})
    creds = Credentials(reader, {"HF_ENDPOINT": "http://hub.local"})
    with creds.settings_for(LocalModelInfo(model_name="m", storage=StorageSpec(key="k"))) as settings:
        assert settings.s3.access_key_id == "A1" and settings.s3.endpoint_url == "http://s3.local"
        assert settings.hf.endpoint == "http://hub.local"
        assert "S1" not in repr(settings)
    with creds.settings_for(LocalModelInfo(model_name="plain")) as settings:
        assert settings.s3.access_key_id is None  # no storage, no SA: no credentials (KServe)
    assert dict(os.environ) == before


@pytest.mark.parametrize(("sub", "key"), [
    ("models/0123456789abcdef", "0123456789abcdef"), ("models/0123456789abcdef/sub/dir", "0123456789abcdef"),
    ("/models/abc/", "abc"), ("models", None), ("other/abc", None), ("", None),
])
def test_subpath_key(sub: str, key: str | None) -> None:
    assert subpath_key(sub) == key


def test_log_lines_are_structured() -> None:
    import logging

    from agent.logs import StructuredFormatter, fields

    record = logging.LogRecord("agent", logging.INFO, __file__, 1, "download finished", None, None)
    record.fields = fields(storage_key="0123456789abcdef", bytes=5, uri="http://h/a b")["fields"]
    line = StructuredFormatter("logfmt").format(record)
    assert 'level=info logger=agent msg="download finished" storage_key=0123456789abcdef bytes=5' in line
    assert 'uri="http://h/a b"' in line
    doc = json.loads(StructuredFormatter("json").format(record))
    assert doc["msg"] == "download finished" and doc["bytes"] == 5 and doc["level"] == "info" and doc["ts"]


def test_install_in_place_renames_only_differing_files_and_drops_stale_ones(tmp_path: Path) -> None:
    from modelcache.sources.integrity import hash_file
    from modelcache.store import Manifest, ManifestFile, NodeStore

    def mf(base: Path, rel: str) -> ManifestFile:
        p = base / rel
        return ManifestFile(rel, p.stat().st_size, hash_file(p).local_hexdigest())

    store = NodeStore.at(tmp_path / "root")
    key = "0123456789abcdef"
    folder = store.layout.model_dir(key)
    (folder / "d").mkdir(parents=True)
    (folder / "a.bin").write_bytes(b"same")
    (folder / "d" / "b.bin").write_bytes(b"old-b")
    (folder / "c.bin").write_bytes(b"stale")
    (folder / "foreign.txt").write_bytes(b"not ours")  # never listed in a manifest: left alone
    staged = tmp_path / "staged"
    (staged / "d").mkdir(parents=True)
    (staged / "a.bin").write_bytes(b"same")
    (staged / "d" / "b.bin").write_bytes(b"new-b")
    (staged / "e.bin").write_bytes(b"added")
    manifest = Manifest(key, "file:///m", "file:///m", None, [mf(staged, p) for p in ("a.bin", "d/b.bin", "e.bin")],
                        "2026-01-01T00:00:00Z")
    inodes = (folder.stat().st_ino, (folder / "d").stat().st_ino, (folder / "a.bin").stat().st_ino)
    replaced, removed = store.install_in_place(key, staged, manifest, ["a.bin", "d/b.bin", "c.bin"])
    assert replaced == ["d/b.bin", "e.bin"] and removed == ["c.bin"]
    assert (folder.stat().st_ino, (folder / "d").stat().st_ino, (folder / "a.bin").stat().st_ino) == inodes
    assert (folder / "d" / "b.bin").read_bytes() == b"new-b" and (folder / "e.bin").read_bytes() == b"added"
    assert not (folder / "c.bin").exists() and (folder / "foreign.txt").exists()
    assert store.manifest(key) == manifest and store.is_present(key) and store.verify(key) == []


def test_the_gauges_come_from_the_status_the_writer_derives_not_from_every_tick(tmp_path: Path) -> None:
    """The supervisor ticks every 0.5 s and derived the whole status at each tick for the gauges
    (half an idle agent's CPU); they now come from the status the writer derives anyway, at once
    after a change and every --status-interval."""
    from agent.config import AgentConfig
    from agent.core import Agent
    from agent.inuse import NoMounts
    from agent.publish import Publisher

    (tmp_path / "root").mkdir()
    agent = Agent(AgentConfig(node="n", root=tmp_path / "root", port=-1), Credentials(None, {}), NoMounts())
    try:
        agent.set_spec([], 1)  # a spec seen, no download to start
        real, derived = agent.report.status, []
        agent.report.status = lambda: derived.append(1) or real()  # type: ignore[method-assign]
        for _ in range(12):  # 6 s of ticks
            agent.tick()
        assert derived == [] and agent.metrics.size._value.get() == 0
        written: list[dict[str, Any]] = []
        Publisher(agent, written.append, 3.0).publish()
        assert len(derived) == 1 and len(written) == 1 and agent.metrics.size._value.get() > 0
    finally:
        agent.stop()


def test_the_same_spec_again_is_no_status_change(tmp_path: Path) -> None:
    """The resync re-applies the spec every --resync-period: only a spec that changes something
    wakes the status writer, else each resync is one more progress write between two
    --status-interval ticks."""
    from agent.config import AgentConfig
    from agent.core import Agent
    from agent.inuse import NoMounts

    agent = Agent(AgentConfig(node="n", root=tmp_path / "root", port=-1), Credentials(None, {}), NoMounts())
    try:
        spec = [LocalModelInfo(model_name="m", source_model_uri="http://h/m.bin")]
        agent.set_spec(spec, 1)
        assert agent.changed.is_set()  # the first spec
        for same in ([LocalModelInfo(model_name="m", source_model_uri="http://h/m.bin")], spec):
            agent.changed.clear()
            agent.set_spec(same, 1)
            assert not agent.changed.is_set()
        for different, generation in (
            (spec, 2),  # a new generation is reported (observedGeneration)
            ([LocalModelInfo(model_name="m", source_model_uri="http://h/m.bin", node_group="g")], 2),  # edited
            ([*spec, LocalModelInfo(model_name="o", source_model_uri="http://h/o.bin")], 2),  # added
            (spec, 2),  # removed
        ):
            agent.changed.clear()
            agent.set_spec(different, generation)
            assert agent.changed.is_set(), (different, generation)
        agent.refuse_spec(["spec.localModels[0]: bad"], 3)
        agent.changed.clear()
        agent.set_spec(spec, 3)
        assert agent.changed.is_set()  # the refusal is cleared from the status
    finally:
        agent.stop()


def test_a_status_write_pruned_by_the_previous_crd_schema_is_not_remembered() -> None:
    """Right after the LocalModelNode CRD changes, the API server may still prune a status write
    with the old schema (its CRD handler switches after the watch event reaches the agent): such a
    write must not become the agent's memory of "what the server keeps", or our fields, dropped
    once, are never written again at rest."""
    import yaml

    from agent.kubemode import pruned_by_another_schema, status_fields
    from tests.helpers import REPO

    crd = yaml.safe_load((REPO / "deploy" / "crds" / "serving.kserve.io_localmodelnodes.yaml").read_text())
    ours = status_fields(crd)
    assert ours is not None and {"modelStatus", "modelDetails", "capacity", "nodeUID"} <= ours
    kserve_like = {"modelStatus"}  # KServe's schema: every other field of ours is pruned
    status = {"modelStatus": {"m": "ModelDownloaded"}, "modelDetails": {"m": {}}, "capacity": {}, "nodeUID": "u"}
    only_model_status = {"modelStatus": {"m": "ModelDownloaded"}}
    assert not pruned_by_another_schema(status, status, ours)
    assert pruned_by_another_schema(status, only_model_status, ours)  # ours back, pruned with KServe's
    assert not pruned_by_another_schema(status, only_model_status, kserve_like)
    assert pruned_by_another_schema(status, status, kserve_like)  # KServe's applied, kept with ours
    assert not pruned_by_another_schema(status, only_model_status, None)  # schema unknown: as before
    assert status_fields(None) is None
    assert status_fields({"spec": {"versions": [{"name": "v1alpha1", "schema": {"openAPIV3Schema": {
        "properties": {"status": {"x-kubernetes-preserve-unknown-fields": True}}}}}]}}) is None


def test_retry_backoff_doubles_up_to_the_cap_and_counts_errors_by_reason(tmp_path: Path) -> None:
    import re
    import time

    from agent.config import AgentConfig
    from agent.core import Agent
    from agent.inuse import NoMounts
    from agent.state import ModelRecord
    from modelcache.errors import TransientError
    from modelcache.kube.types import MODEL_DOWNLOAD_ERROR

    cfg = AgentConfig(node="n", root=tmp_path / "root", backoff_initial=1.0, backoff_max=4.0, port=-1)
    agent = Agent(cfg, Credentials(None, {}), NoMounts())
    try:
        rec = ModelRecord(key="0123456789abcdef", uri="http://h/m.bin",
                          entries=[LocalModelInfo(model_name="m", source_model_uri="http://h/m.bin")])
        delays = []
        for _ in range(5):
            before = time.monotonic()
            agent._failed(rec, TransientError("http://h/m.bin: HTTP 503"), 0.1, "http")
            assert rec.failure is not None
            m = re.search(r"\(retry (\d+) in (\d+)s\)$", rec.failure.message)
            assert m, rec.failure.message
            delays.append(int(m.group(2)))
            assert before + delays[-1] - 0.5 <= rec.next_attempt <= time.monotonic() + delays[-1] + 0.5
        assert delays == [1, 2, 4, 4, 4]  # exponential, capped at --backoff-max
        assert rec.state(present=False) == MODEL_DOWNLOAD_ERROR and rec.failure.reason == "Transient"
        text = agent.metrics.render().decode()
        assert 'modelcache_agent_errors_total{reason="Transient"} 5.0' in text
        assert 'modelcache_agent_download_duration_seconds_count{outcome="error",scheme="http"} 5.0' in text
    finally:
        agent.stop()


def test_a_download_s_series_exist_at_zero_from_its_first_attempt(tmp_path: Path) -> None:
    """rate()/increase() need a sample before the counter moves: the first failed attempt must find
    its series already scraped at 0 (ModelcacheDownloadsFailing), and so must the first success."""
    from agent.config import AgentConfig
    from agent.core import Agent
    from agent.inuse import NoMounts
    from agent.state import ModelRecord, Task
    from modelcache.errors import TransientError

    cfg = AgentConfig(node="n", root=tmp_path / "root", port=-1)
    agent = Agent(cfg, Credentials(None, {}), NoMounts())
    rendered: list[str] = []

    def pull(*_args: object) -> None:  # what a scrape during the attempt sees, then the failure
        rendered.append(agent.metrics.render().decode())
        raise TransientError("http://h/m.bin: HTTP 503")

    agent._pull_model = pull  # type: ignore[method-assign]
    try:
        rec = ModelRecord(key="0123456789abcdef", uri="http://h/m.bin",
                          entries=[LocalModelInfo(model_name="m", source_model_uri="http://h/m.bin")])
        agent._download(rec, Task(), rec.entries[0])
        (during,) = rendered
        for outcome in ("error", "ok"):
            assert f'modelcache_agent_download_duration_seconds_count{{outcome="{outcome}",scheme="http"}} 0.0' \
                in during
        assert 'modelcache_agent_downloaded_bytes_total{scheme="http"} 0.0' in during
        after = agent.metrics.render().decode()
        assert 'modelcache_agent_download_duration_seconds_count{outcome="error",scheme="http"} 1.0' in after
        assert 'modelcache_agent_download_duration_seconds_count{outcome="ok",scheme="http"} 0.0' in after
    finally:
        agent.stop()


def test_every_setting_has_a_flag_and_an_environment_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from click.testing import CliRunner

    import agent.__main__ as main
    from agent.config import AgentConfig

    seen: list[AgentConfig] = []
    monkeypatch.setattr(main, "run", lambda cfg, _paths=(): seen.append(cfg) or 0)
    env = {"NODE_NAME": "gpu-7", "MODELCACHE_ROOT": str(tmp_path / "r"), "MODELCACHE_MAX_CONCURRENT_MODELS": "3",
           "MODELCACHE_WORKERS": "5", "MODELCACHE_RESYNC_PERIOD": "42", "MODELCACHE_AGENT_PORT": "9099",
           "POD_NAMESPACE": "models", "KUBECONFIG": str(tmp_path / "kc"), "MODELCACHE_BACKOFF_MAX": "60"}
    result = CliRunner().invoke(main.cli, [], env=env)
    assert result.exit_code == 0, result.output
    cfg = seen[-1]
    assert (cfg.node, cfg.root, cfg.max_concurrent_models, cfg.workers, cfg.resync_period, cfg.port,
            cfg.credentials_namespace, cfg.kubeconfig, cfg.backoff_max) == (
        "gpu-7", tmp_path / "r", 3, 5, 42.0, 9099, "models", str(tmp_path / "kc"), 60.0)
    # Flags win over the environment; the documented defaults hold without either.
    result = CliRunner().invoke(main.cli, ["--node", "n2", "--workers", "2"], env={**env, "MODELCACHE_ROOT": ""})
    assert result.exit_code == 0 and seen[-1].node == "n2" and seen[-1].workers == 2
    result = CliRunner().invoke(main.cli, ["--node", "n3"], env={"KUBECONFIG": ""})
    assert result.exit_code == 0, result.output
    assert seen[-1].root == Path("/mnt/models") and seen[-1].credentials_namespace == "kserve"
    no_node = CliRunner().invoke(main.cli, [], env={"NODE_NAME": ""})
    assert no_node.exit_code == 2 and "--node (or NODE_NAME) is required" in no_node.output


def test_s3_settings_follow_kserves_precedence_and_endpoint_rule() -> None:
    from agent.credentials import s3_env

    cfg = CredentialConfig(s3={"s3Endpoint": "cfg:1", "s3UseHttps": "0", "s3Region": "cfg-region",
                               "s3VerifySSL": "0"})
    ann = {"serving.kserve.io/s3-endpoint": "https://ann:2"}
    data = {"S3_ENDPOINT": "data:3", "AWS_DEFAULT_REGION": "data-region", "S3_USE_HTTPS": "1"}
    sa = {"serving.kserve.io/s3-region": "sa-region", "serving.kserve.io/s3-useanoncredential": "true"}
    env = s3_env(ann, data, cfg, sa)
    # The annotation beats the data key; its scheme decides S3_USE_HTTPS.
    assert (env["S3_ENDPOINT"], env["AWS_ENDPOINT_URL"], env["S3_USE_HTTPS"]) == ("ann:2", "https://ann:2", "1")
    assert env["AWS_DEFAULT_REGION"] == "data-region"  # data beats the service account and the config
    assert env["awsAnonymousCredential"] == "true"  # the service account fills what the secret leaves unset
    assert env["S3_VERIFY_SSL"] == "0"  # the config fills the rest
    # KServe lets the secret's settings, config defaults included, override the service account's.
    assert s3_env({}, {}, cfg, sa)["AWS_DEFAULT_REGION"] == "cfg-region"
    assert s3_env({}, {}, CredentialConfig(), sa)["AWS_DEFAULT_REGION"] == "sa-region"
    only_cfg = s3_env({}, {}, cfg)
    assert (only_cfg["S3_ENDPOINT"], only_cfg["AWS_ENDPOINT_URL"]) == ("cfg:1", "http://cfg:1")
    assert s3_env({}, {"S3_ENDPOINT": "h:9"}, CredentialConfig())["AWS_ENDPOINT_URL"] == "https://h:9"
    assert s3_env({}, {}, CredentialConfig()) == {}


def test_kserve_credential_config_parses_the_config_map() -> None:
    cm = {"data": {"credentials": json.dumps({"s3": {"s3AccessKeyIDName": "ak", "s3Endpoint": ""},
                                              "gcs": {"gcsCredentialFileName": "gcp.json"},
                                              "storageSpecSecretName": "st"})}}
    cfg = CredentialConfig.from_config_map(cm)
    assert (cfg.s3_access_key_name, cfg.s3_secret_key_name) == ("ak", "awsSecretAccessKey")
    assert cfg.gcs_credential_file_name == "gcp.json" and cfg.storage_spec_secret_name == "st"
    assert "s3Endpoint" not in cfg.s3  # empty: unset, as KServe
    assert CredentialConfig.from_config_map(None) == CredentialConfig()
    with pytest.raises(AuthError, match="'credentials' entry is not a JSON object"):
        CredentialConfig.from_config_map({"data": {"credentials": "{nope"}})


def test_a_binary_hdfs_keytab_in_a_service_account_secret_is_written_as_is(tmp_path: Path) -> None:
    import base64

    keytab = bytes(range(256))  # not UTF-8
    reader = Reader(secrets={"h": {"data": {"HDFS_NAMENODE": base64.b64encode(b"http://nn:9870").decode(),
                                            "KERBEROS_KEYTAB": base64.b64encode(keytab).decode()}}},
                    sas={"sa": {"secrets": [{"name": "h"}]}})
    env = service_account_env(LocalModelInfo(model_name="m", service_account_name="sa"), reader, str(tmp_path))
    assert (Path(env["HDFS_SECRET_DIR"]) / "KERBEROS_KEYTAB").read_bytes() == keytab


def test_the_peer_directory_keeps_only_what_it_reads_and_finds_holders_and_fetchers() -> None:
    from agent.peering import Directory, directory_essentials
    from modelcache.sources.uri import storage_key

    uri, other = "s3://b/llm", "s3://b/other"
    key = storage_key(uri)
    fp = "ab" * 32

    def lmn(name: str, uris: list[str], details: dict[str, dict[str, Any]], peer: bool = True) -> dict[str, Any]:
        status: dict[str, Any] = {"modelDetails": details, "capacity": {"freeBytes": 1}, "modelStatus": {}}
        if peer:
            status["peer"] = {"endpoint": f"10.0.0.{len(name)}:8443", "certSHA256": fp, "zone": "z1"}
        return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNode",
                "metadata": {"name": name, "resourceVersion": "7", "managedFields": [{"manager": "x"}]},
                "spec": {"localModels": [{"modelName": u.rsplit("/", 1)[1], "sourceModelUri": u} for u in uris]},
                "status": status}

    holder = lmn("holder", [uri], {"llm": {"storageKey": key, "state": "ModelDownloaded", "listingDigest": "d1",
                                           "bytesDone": 5, "rate": 3.0, "message": "x" * 1000}})
    kept = directory_essentials(holder)
    assert kept["spec"] == {"storageKeys": [key]} and kept["metadata"] == {"name": "holder", "resourceVersion": "7"}
    assert kept["status"]["modelDetails"] == {"llm": {"storageKey": key, "state": "ModelDownloaded",
                                                      "listingDigest": "d1"}}
    assert set(kept["status"]) == {"modelDetails", "peer"}

    directory = Directory(None, "me")  # type: ignore[arg-type]  # no server: the store is filled by hand
    for obj in (holder,
                lmn("listing", [uri], {}),  # wants it, no digest yet: a member of the swarm
                lmn("failed", [uri], {"llm": {"storageKey": key, "state": "ModelDownloadError"}}),
                lmn("elsewhere", [other], {}),
                lmn("no-endpoint", [uri], {}, peer=False),
                lmn("me", [uri], {})):
        directory.informer.store.put(directory_essentials(obj))
    found = {p.name: p for p in directory.peers(key)}
    assert set(found) == {"holder", "listing"}
    assert found["holder"].complete and found["holder"].digest == "d1" and found["holder"].port == 8443
    assert not found["listing"].complete and found["listing"].digest is None and found["listing"].zone == "z1"


def test_a_namespace_cache_uses_only_credentials_granted_to_its_namespace(tmp_path: Path) -> None:
    """agent/credentials.py's tenancy rule (security review H3), without a cluster."""
    reader = Reader(
        secrets={"storage-config": {"metadata": {"annotations": {"namespaces.modelcache.io/team-b": "team-b,other"}},
                                    "stringData": {"team-b": '{"type": "s3"}', "default": '{"type": "s3"}'}},
                 "b-s3": {"stringData": {"awsAccessKeyID": "AK", "awsSecretAccessKey": "SK"}}},
        sas={"team-b": {"metadata": {"annotations": {"modelcache.io/namespaces": "team-b"}},
                        "secrets": [{"name": "b-s3"}]},
             "everyone": {"metadata": {"annotations": {"modelcache.io/namespaces": "*"}},
                          "secrets": [{"name": "b-s3"}]},
             "admins": {"secrets": [{"name": "b-s3"}]}})

    def info(ns: str | None, **kw: Any) -> LocalModelInfo:
        return LocalModelInfo(model_name="m", namespace=ns, **kw)

    # Granted: the namespace is named (or "*"); a cluster cache may use everything.
    assert "STORAGE_CONFIG" in storage_env(info("team-b", storage=StorageSpec(key="team-b")), reader)
    assert "STORAGE_CONFIG" in storage_env(info(None, storage=StorageSpec(key="default")), reader)
    granted = service_account_env(info("team-b", service_account_name="team-b"), reader, str(tmp_path))
    assert granted["AWS_SECRET_ACCESS_KEY"] == "SK"
    assert service_account_env(info("team-a", service_account_name="everyone"), reader, str(tmp_path))
    assert service_account_env(info(None, service_account_name="admins"), reader, str(tmp_path))
    # Not granted: another namespace, the default key nobody granted, an unannotated account.
    with pytest.raises(AuthError, match=r"key 'team-b' of Secret 'storage-config' is not granted to namespace "
                                        r"team-a; a cluster admin grants it with the annotation "
                                        r"namespaces\.modelcache\.io/team-b"):
        storage_env(info("team-a", storage=StorageSpec(key="team-b")), reader)
    with pytest.raises(AuthError, match=r"key 'default' .* not granted to namespace team-b"):
        storage_env(info("team-b", storage=StorageSpec(parameters={"type": "s3"})), reader)
    with pytest.raises(AuthError, match="service account 'admins' is not granted to namespace team-b"):
        service_account_env(info("team-b", service_account_name="admins"), reader, str(tmp_path))
    # Parameters that would send granted credentials elsewhere: refused even when granted.
    for param in ("endpoint_url", "ca_bundle", "verify_ssl", "Endpoint_URL"):
        with pytest.raises(AuthError, match=r"may not set storage\.parameters"):
            storage_env(info("team-b", storage=StorageSpec(key="team-b", parameters={param: "x"})), reader)
    # A namespace cache's own keys in its parameters (no key of the Secret used): nothing to grant.
    own = storage_env(info("team-a", storage=StorageSpec(key="mine", parameters={"type": "s3", "bucket": "b"})), reader)
    assert "STORAGE_CONFIG" not in own and json.loads(own["STORAGE_OVERRIDE_CONFIG"])["bucket"] == "b"


def test_a_namespaces_share_of_a_group_counts_its_models_and_reservations(tmp_path: Path) -> None:
    """agent/capacity.py: the per-namespace share of a group (security review M4)."""
    from agent.capacity import GroupLimit

    used = {"team-a": 0}
    cap = Capacity(tmp_path, margin=0, used_bytes=lambda: sum(used.values()), disk_usage=lambda _p: (10_000, 10_000),
                   namespace_used=lambda ns: used.get(ns, 0))
    limit = GroupLimit(1000, "workers", namespace_limit=400)
    cap.reserve("a", 300, 300, limit, "a", owners=frozenset({"team-a"}))
    with pytest.raises(InsufficientSpaceError, match="does not fit namespace team-a's share of node group 'workers'"):
        cap.reserve("b", 200, 200, limit, "b", owners=frozenset({"team-a"}))  # 300 reserved + 200 > 400
    cap.reserve("c", 200, 200, limit, "c", owners=frozenset({"team-b"}))  # another namespace's share
    cap.reserve("d", 200, 200, limit, "d")  # a cluster cache's model: the group limit only
    cap.release("a")
    used["team-a"] = 350
    with pytest.raises(InsufficientSpaceError, match="hold 350 B here already"):
        cap.reserve("b", 100, 100, limit, "b", owners=frozenset({"team-a"}))
    cap.reserve("b", 50, 50, limit, "b", owners=frozenset({"team-a"}))


def test_namespace_caches_get_only_what_the_groups_cluster_caches_leave(tmp_path: Path) -> None:
    """agent/capacity.py: cluster caches first (security review M4 on a default install): a
    namespace cache's model may not take the room a cluster cache's model still needs on the node
    (not downloaded yet, or refused meanwhile); a cluster cache's own model is not held to it."""
    from agent.capacity import GroupLimit

    pending = [("k-admin", "admin-model", 600)]
    cap = Capacity(tmp_path, margin=0, used_bytes=lambda: 0, disk_usage=lambda _p: (10_000, 10_000),
                   cluster_pending=lambda: pending, namespaces_held=lambda: {"tenant-a": 0, "tenant-c": 300})
    limit = GroupLimit(1000, "workers", namespace_limit=None, share_source="none")
    with pytest.raises(InsufficientSpaceError) as refused:
        cap.reserve("filler", 500, 500, limit, "http://h/big.bin", owners=frozenset({"tenant-b"}))
    assert str(refused.value) == (
        "http://h/big.bin: namespace tenant-b: does not fit node group 'workers' next to its cluster caches: the "
        "model is 500 B, storageLimit 1000 B, this node holds 0 B (0 B more reserved by downloads in flight) and "
        "LocalModelCache admin-model still need 600 B here; namespace caches get only what cluster caches leave. "
        "Delete a LocalModelNamespaceCache of the namespace, or ask a cluster admin to raise spec.storageLimit of "
        "LocalModelNodeGroup 'workers'")
    cap.reserve("small", 400, 400, limit, "small", owners=frozenset({"tenant-b"}))  # fits next to it
    cap.release("small")
    cap.reserve("k-admin", 600, 600, limit, "admin")  # the cluster cache's download: a reservation now
    cap.reserve("small", 400, 400, limit, "small", owners=frozenset({"tenant-b"}))  # not counted twice
    with pytest.raises(InsufficientSpaceError, match="does not fit the node group's storageLimit"):
        cap.reserve("more", 1, 1, limit, "more", owners=frozenset({"tenant-a"}))
    # A cluster cache refused for room is told which namespaces hold it (nothing is deleted for it).
    with pytest.raises(InsufficientSpaceError, match=r"in flight; namespace caches hold: tenant-c 300 B\)\. "):
        cap.reserve("admin3", 1, 1, limit, "admin3")


def test_a_namespaces_default_share_is_half_the_groups_storage_limit() -> None:
    """modelcache/kube/share.py: the default share, the annotation, 'none', a bad value."""
    from modelcache.kube.share import namespace_share

    def group(annotation: str | None, limit: str | None = "1Mi") -> dict[str, Any]:
        meta = {"annotations": {"modelcache.io/namespace-storage-limit": annotation}} if annotation else {}
        return {"metadata": meta, "spec": {"storageLimit": limit} if limit else {}}

    assert namespace_share(group(None)).limit == 512 * 1024
    assert namespace_share(group(None)).source == "the default: half the group's storageLimit of 1.0 MiB"
    assert namespace_share(group("100Ki")).limit == 100 * 1024
    assert namespace_share(group("None")).limit is None
    bad = namespace_share(group("lots"))
    assert (bad.limit, bad.invalid) == (512 * 1024, "lots")
    assert namespace_share(group(None, limit=None)).limit is None


def test_a_copy_adopted_in_place_does_not_count_twice_against_its_share(tmp_path: Path) -> None:
    """agent/capacity.py: a copy KServe left (counted in the node's and its namespace's bytes
    already) is admitted against the default share without counting itself a second time."""
    from agent.capacity import GroupLimit

    cap = Capacity(tmp_path, margin=0, used_bytes=lambda: 700, disk_usage=lambda _p: (10_000, 10_000),
                   namespace_used=lambda ns: 300 if ns == "team-a" else 0,
                   counted=lambda key: 300 if key == "carried" else 0)
    limit = GroupLimit(1000, "workers", namespace_limit=500, share_source="the default")
    cap.reserve("carried", 0, 300, limit, "carried", owners=frozenset({"team-a"}))
    cap.release("carried")  # adopted: counted by used_bytes and namespace_used from here on
    with pytest.raises(InsufficientSpaceError, match=r"team-a's caches hold 300 B here already"):
        cap.reserve("new", 300, 300, limit, "new", owners=frozenset({"team-a"}))


def test_the_agents_ports_are_taken_at_construction_and_the_checker_reports_through_callbacks(
    tmp_path: Path,
) -> None:
    """The agent's optional parts are typed ports given to its constructor (agent/ports.py), not
    attributes set afterwards; the checker is handed callbacks, not the Agent (no import circle):
    a file truncated under a Downloaded model reaches Agent.damaged through them, the Event port
    says so, and the root check port refuses the group whose PV is elsewhere."""
    from agent.config import AgentConfig
    from agent.core import Agent
    from agent.inuse import NoMounts
    from agent.ports import Ports
    from modelcache.sources.uri import storage_key
    from tests.helpers import wait_until

    src = tmp_path / "src"
    src.mkdir()
    (src / "m.bin").write_bytes(os.urandom(1 << 20))
    uri = f"file://{src}"
    events: list[tuple[str, str, str]] = []
    cfg = AgentConfig(node="n", root=tmp_path / "root", port=-1, backoff_initial=0.1, backoff_max=0.2,
                      status_interval=0.2, size_check_interval=0.2, chunk_size=1 << 20, workers=2, space_margin=0)
    ports = Ports(root_check=lambda group: "its PV is elsewhere" if group == "far" else None,
                  events=lambda *event: events.append(event))
    agent = Agent(cfg, Credentials(None, {}), NoMounts(), ports=ports)
    assert agent.checker.on_damaged == agent.damaged and not hasattr(agent.checker, "agent")
    agent.start()
    try:
        agent.set_spec([LocalModelInfo(model_name="near", source_model_uri=uri, node_group="near"),
                        LocalModelInfo(model_name="far", source_model_uri=uri, node_group="far")])
        wait_until(lambda: agent.status()["modelStatus"].get("near") == "ModelDownloaded", timeout=30,
                   what="the model downloaded")
        status = agent.status()
        assert status["modelStatus"]["far"] == "ModelDownloadError"
        assert status["modelDetails"]["far"]["message"] == "its PV is elsewhere"
        assert [e[1] for e in events] == ["Downloaded"], events
        data = tmp_path / "root" / "models" / storage_key(uri) / "m.bin"
        with data.open("r+b") as f:
            f.truncate(1000)
        wait_until(lambda: any(e[1] == "ModelDamaged" for e in events), timeout=30, what="the damage reported")
        damaged = next(e for e in events if e[1] == "ModelDamaged")
        assert damaged[0] == "Warning" and "wrong size" in damaged[2], damaged
        wait_until(lambda: data.stat().st_size == 1 << 20 and agent.status()["modelStatus"]["near"]
                   == "ModelDownloaded", timeout=30, what="the model repaired")
    finally:
        agent.stop()


def test_the_self_signed_peer_pair_serves_its_published_fingerprint_and_leaves_no_key_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --peer-tls-cert/--peer-tls-key the agent makes a pair per start: its key is on disk
    only while OpenSSL loads it (stop 39 found 237 ``modelcache-peer-tls-*`` folders, each with a
    private key, left in /tmp by agents long stopped)."""
    import hashlib
    import socket
    import ssl
    import tempfile
    import threading

    from agent.peering import peer_tls

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    context, fingerprint = peer_tls(None, None, "node-a")
    assert list(tmp_path.iterdir()) == []

    # The context serves the very certificate whose SHA-256 is published for pinning.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def serve() -> None:
            conn, _ = listener.accept()
            with context.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
        with client.wrap_socket(socket.create_connection(listener.getsockname()[:2])) as tls:
            served = tls.getpeercert(binary_form=True)
            tls.sendall(b"x")
        server.join(5)
    assert served is not None and hashlib.sha256(served).hexdigest() == fingerprint

    # Given files are used as they are (and stay where they are).
    from coordinator.certs import generate_self_signed

    cert, key = generate_self_signed(tmp_path / "given", ["node-b"])
    _, given = peer_tls(cert, key, "node-b")
    assert given == hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert.read_text())).hexdigest() != fingerprint
    assert cert.exists() and key.exists()
