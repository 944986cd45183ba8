"""Unit tests of the coordinator's pure functions: node selectors, membership, URI matching,
status aggregation, LocalModelNode entries, serving volumes, node labels and pod mutation."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator import aggregate, entries, membership, nodelabels, podmutate, urimatch, volumes
from coordinator.nodeselector import match_node_selector_terms, match_term, node_ready
from coordinator.reports import Report
from modelcache.kube.types import LOCALMODEL_LABEL, LOCALMODEL_NAMESPACE_LABEL, LOCALMODEL_PVC_ANNOTATION
from modelcache.sources.uri import storage_key


def node(name: str, ready: bool | None = True, **labels: str) -> dict[str, Any]:
    conds = [] if ready is None else [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": {"name": name, "labels": labels}, "status": {"conditions": conds}}


def expr(key: str, op: str, *values: str) -> dict[str, Any]:
    out: dict[str, Any] = {"key": key, "operator": op}
    if values:
        out["values"] = list(values)
    return out


@pytest.mark.parametrize(
    ("req", "labels", "want"),
    [
        (expr("gpu", "In", "a100", "h100"), {"gpu": "a100"}, True),
        (expr("gpu", "In", "a100"), {"gpu": "t4"}, False),
        (expr("gpu", "In", "a100"), {}, False),
        (expr("gpu", "NotIn", "a100"), {"gpu": "t4"}, True),
        (expr("gpu", "NotIn", "a100"), {}, True),  # absent label: NotIn holds
        (expr("gpu", "NotIn", "a100"), {"gpu": "a100"}, False),
        (expr("gpu", "Exists"), {"gpu": ""}, True),
        (expr("gpu", "Exists"), {}, False),
        (expr("gpu", "DoesNotExist"), {}, True),
        (expr("gpu", "DoesNotExist"), {"gpu": "x"}, False),
        (expr("mem", "Gt", "10"), {"mem": "11"}, True),
        (expr("mem", "Gt", "10"), {"mem": "10"}, False),
        (expr("mem", "Gt", "10"), {"mem": "abc"}, False),
        (expr("mem", "Gt", "10"), {}, False),
        (expr("mem", "Lt", "10"), {"mem": "9"}, True),
        (expr("mem", "Lt", "10"), {"mem": "10"}, False),
        (expr("mem", "Lt", "10", "20"), {"mem": "9"}, False),  # Gt/Lt need exactly one value
        (expr("gpu", "Bogus", "a"), {"gpu": "a"}, False),
    ],
)
def test_match_expression(req: dict[str, Any], labels: dict[str, str], want: bool) -> None:
    n = {"metadata": {"name": "n1", "labels": labels}}
    assert match_term({"matchExpressions": [req]}, n) is want


def test_terms_are_ored_and_expressions_anded() -> None:
    n = node("n1", gpu="a100", zone="b")
    both = {"matchExpressions": [expr("gpu", "In", "a100"), expr("zone", "In", "a")]}
    assert not match_node_selector_terms([both], n)
    assert match_node_selector_terms([both, {"matchExpressions": [expr("zone", "In", "b")]}], n)
    assert not match_node_selector_terms([], n)
    assert not match_node_selector_terms(None, n)
    assert not match_node_selector_terms([{}], n)  # an empty term selects nothing


def test_match_fields_metadata_name() -> None:
    term = {"matchFields": [expr("metadata.name", "In", "n1", "n2")]}
    assert match_term(term, node("n1"))
    assert not match_term(term, node("n3"))
    assert not match_term({"matchFields": [expr("spec.other", "In", "n1")]}, node("n1"))
    mixed = {"matchFields": [expr("metadata.name", "NotIn", "n2")], "matchExpressions": [expr("gpu", "Exists")]}
    assert match_term(mixed, node("n1", gpu="x"))
    assert not match_term(mixed, node("n1"))


def test_node_ready() -> None:
    assert node_ready(node("a"))
    assert not node_ready(node("a", ready=False))
    assert not node_ready(node("a", ready=None))
    unknown = {"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}
    assert not node_ready(unknown)


def group(name: str, terms: list[dict[str, Any]] | None) -> dict[str, Any]:
    pv: dict[str, Any] = {"local": {"path": "/models"}, "capacity": {"storage": "1Gi"}}
    if terms is not None:
        pv["nodeAffinity"] = {"required": {"nodeSelectorTerms": terms}}
    return {"metadata": {"name": name}, "spec": {"persistentVolumeSpec": pv,
                                                  "persistentVolumeClaimSpec": {"accessModes": ["ReadWriteOnce"]}}}


def test_membership_first_group_wins_and_readiness() -> None:
    groups = {
        "gpu": group("gpu", [{"matchExpressions": [expr("gpu", "Exists")]}]),
        "all": group("all", [{"matchExpressions": [expr("kubernetes.io/os", "In", "linux")]}]),
        "none": group("none", None),
    }
    nodes = [node("a", gpu="1", **{"kubernetes.io/os": "linux"}), node("b", ready=False, gpu="1"),
             node("c", **{"kubernetes.io/os": "linux"}), node("d")]
    placed = membership.place(["gpu", "all", "missing"], groups, nodes)
    assert placed == {
        "a": membership.Member("a", "gpu", True),
        "b": membership.Member("b", "gpu", False),
        "c": membership.Member("c", "all", True),
    }
    assert membership.place(["none"], groups, nodes) == {}  # no nodeAffinity.required: no members
    assert membership.place(["missing"], groups, nodes) == {}


@pytest.mark.parametrize(
    ("cache", "uri", "want", "sub"),
    [
        ("s3://b/m", "s3://b/m", True, ""),
        ("s3://b/m/", "s3://b/m", True, ""),
        ("s3://b/m", "s3://b/m/", True, ""),
        ("s3://b/m", "s3://b/m/sub/dir", True, "/sub/dir"),
        ("s3://b/m/", "s3://b/m/sub", True, "/sub"),
        ("s3://b/m", "s3://b/model2", False, None),
        ("s3://b/m", "s3://b", False, None),
        ("s3://b/m//", "s3://b/m", False, None),  # only one trailing '/' is stripped
        ("", "s3://b/m", False, None),
    ],
)
def test_uri_match(cache: str, uri: str, want: bool, sub: str | None) -> None:
    assert urimatch.match_storage_uri(cache, uri) is want
    if want:
        assert urimatch.sub_path(cache, uri) == sub


def test_select_cache_order_group_and_opt_out() -> None:
    c_cluster = urimatch.CacheRef("zcluster", "s3://b/m", ("g1", "g2"))
    c_cluster2 = urimatch.CacheRef("acluster", "s3://b/m/", ("g3",))
    c_ns = urimatch.CacheRef("nscache", "s3://b/m", ("g1",), "team")
    c_other_ns = urimatch.CacheRef("aaa", "s3://b/m", ("g1",), "other")
    ns_caches, cl = [c_ns, c_other_ns], [c_cluster, c_cluster2]
    m = urimatch.select_cache("s3://b/m/x", "team", {}, ns_caches, cl)
    assert m is not None and m.cache == c_ns and m.node_group == "g1" and m.sub_path == "/x"
    m = urimatch.select_cache("s3://b/m", "default", {}, ns_caches, cl)
    assert m is not None and m.cache == c_cluster2 and m.pvc_name == "acluster-g3"  # name order
    m = urimatch.select_cache("s3://b/m", "default", {"serving.kserve.io/nodegroup": "g2"}, ns_caches, cl)
    assert m is not None and m.cache == c_cluster and m.pvc_name == "zcluster-g2"
    assert urimatch.select_cache("s3://b/m", "default", {"serving.kserve.io/nodegroup": "g9"}, ns_caches, cl) is None
    assert urimatch.select_cache("s3://b/m", "team", {"serving.kserve.io/disable-localmodel": ""}, ns_caches, cl) \
        is None
    assert urimatch.select_cache("gs://x/y", "team", {}, ns_caches, cl) is None
    assert urimatch.select_cache(None, "team", {}, ns_caches, cl) is None


def test_defaulter_metadata_and_patch() -> None:
    m = urimatch.CacheMatch(urimatch.CacheRef("c", "s3://b/m", ("g",), "team"), "g", "")
    labels, ann = urimatch.defaulter_metadata(m)
    assert labels == {LOCALMODEL_LABEL: "c", LOCALMODEL_NAMESPACE_LABEL: "team"}
    assert ann[LOCALMODEL_PVC_ANNOTATION] == "c-g"
    isvc = {"metadata": {"labels": {"x": "y"}}}
    patch = urimatch.metadata_patch(isvc, labels, ann)
    assert patch["metadata"]["labels"] == {LOCALMODEL_LABEL: "c", LOCALMODEL_NAMESPACE_LABEL: "team"}
    isvc["metadata"]["labels"].update(patch["metadata"]["labels"])
    isvc["metadata"]["annotations"] = patch["metadata"]["annotations"]
    assert urimatch.metadata_patch(isvc, labels, ann) == {}
    labels, ann = urimatch.defaulter_metadata(None)
    removal = urimatch.metadata_patch(isvc, labels, ann)
    assert removal["metadata"]["labels"] == {LOCALMODEL_LABEL: None, LOCALMODEL_NAMESPACE_LABEL: None}
    assert urimatch.metadata_patch({"metadata": {}}, labels, ann) == {}


def test_storage_uri_of_services() -> None:
    assert urimatch.isvc_storage_uri({"spec": {"predictor": {"model": {"storageUri": "s3://a"}}}}) == "s3://a"
    assert urimatch.isvc_storage_uri({"spec": {"predictor": {"sklearn": {"storageUri": "gs://b"}}}}) == "gs://b"
    assert urimatch.isvc_storage_uri({"spec": {"predictor": {"minReplicas": 1}}}) is None
    assert urimatch.llmisvc_model_uri({"spec": {"model": {"uri": "hf://o/m"}}}) == "hf://o/m"


def _custom(*containers: dict[str, object], **predictor: object) -> dict[str, object]:
    return {"spec": {"predictor": {"containers": list(containers), **predictor}}}


def test_storage_uri_read_as_kserves_defaulter_reads_it() -> None:
    """GetImplementation().GetStorageUri() of KServe v0.20.0 (predictor.go, predictor_custom.go)."""
    uri = urimatch.isvc_storage_uri
    env = [{"name": "OTHER", "value": "x"}, {"name": "STORAGE_URI", "value": "hf://org/llm"}]
    # A custom predictor: the STORAGE_URI env of kserve-container (vLLM / TGI images).
    assert uri(_custom({"name": "kserve-container", "image": "vllm", "env": env})) == "hf://org/llm"
    # KServe's defaulter names a lone container, or an unnamed first one, kserve-container first.
    assert uri(_custom({"name": "vllm", "env": env})) == "hf://org/llm"
    assert uri(_custom({"env": env}, {"name": "sidecar"})) == "hf://org/llm"
    assert uri(_custom({"name": "sidecar", "env": env}, {"name": "kserve-container", "env": env[:1]})) is None
    assert uri(_custom({"name": "sidecar", "env": env}, {"name": "proxy"})) is None
    assert uri(_custom({"name": "sidecar"}, {"name": "kserve-container", "env": env})) == "hf://org/llm"
    # Nothing to read (no env; an env from a Secret): None, the labels are left as they are.
    assert uri(_custom({"name": "kserve-container", "image": "x"})) is None
    assert uri(_custom({"name": "kserve-container", "env": [
        {"name": "STORAGE_URI", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]})) is None
    # The first implementation set wins, in KServe's order; a framework spec before containers.
    assert uri({"spec": {"predictor": {"sklearn": {"storageUri": "gs://a"}, "model": {"storageUri": "gs://b"}}}}) \
        == "gs://a"
    assert uri({"spec": {"predictor": {"xgboost": {}, "model": {"storageUri": "gs://b"}}}}) is None
    assert uri(_custom({"name": "kserve-container", "env": env}, model={"storageUri": "s3://m"})) == "s3://m"
    assert uri({"spec": {"predictor": {"model": {"storage": {"key": "k", "path": "p"}}}}}) is None


def test_status_aggregation_counts_current_members_only() -> None:
    members = {
        "a": membership.Member("a", "g", True),
        "b": membership.Member("b", "g", True),
        "c": membership.Member("c", "g", False),
        "d": membership.Member("d", "g", True),
        "e": membership.Member("e", "g", True),
    }
    states = {"a": "ModelDownloaded", "b": "ModelDownloadError", "c": "ModelDownloaded", "d": None,
              "e": "ModelDownloading"}
    st = aggregate.node_status(members, states)
    assert st == {"a": "NodeDownloaded", "b": "NodeDownloadError", "c": "NodeNotReady",
                  "d": "NodeDownloadPending", "e": "NodeDownloading"}
    assert aggregate.copies(st) == aggregate.Copies(available=1, total=5, failed=1)
    del members["a"]  # node deleted: it leaves the status and the counts
    st2 = aggregate.node_status(members, states)
    assert "a" not in st2 and aggregate.copies(st2).total == 4 and aggregate.copies(st2).available == 0
    gained, lost = aggregate.copy_changes(st2, st)
    assert (gained, lost) == (["a"], [])
    assert aggregate.copy_changes(st, st2) == ([], ["a"])
    assert aggregate.node_state("") == "NodeDownloadPending"


def cache(name: str, uri: str, groups: list[str], ns: str | None = None, **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}"}
    if ns:
        meta["namespace"] = ns
    return {"kind": "LocalModelNamespaceCache" if ns else "LocalModelCache", "metadata": meta,
            "spec": {"sourceModelUri": uri, "modelSize": "1Gi", "nodeGroups": groups, **spec}}


def test_entries_kserve_fields() -> None:
    c = cache("m", "s3://b/m", ["g"], serviceAccountName="sa", storage={"key": "k"})
    e = entries.desired_entry(c, "g")
    assert e == {"modelName": "m", "sourceModelUri": "s3://b/m", "nodeGroup": "g", "serviceAccountName": "sa",
                 "storage": {"key": "k"}}
    ns_e = entries.desired_entry(cache("m", "s3://b/m", ["g"], ns="team"), "g")
    assert ns_e == {"modelName": "m", "sourceModelUri": "s3://b/m", "namespace": "team", "nodeGroup": "g"}
    assert entries.has([e, ns_e], "m", "team") and entries.has([e], "m", None) and not entries.has([ns_e], "m", None)


def test_desired_models_for_one_node() -> None:
    from coordinator.nodes import desired_models

    caches = {"a": cache("a", "s3://b/a", ["g1"]), "team/a": cache("a", "s3://b/a", ["g1"], ns="team"),
              "b": cache("b", "s3://b/b", ["g2"]), "gone-soon": cache("gone-soon", "s3://b/x", ["g1"])}
    caches["gone-soon"]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    groups = {"g1": {"n1": membership.Member("n1", "g1", True), "sick": membership.Member("sick", "g1", False)},
              "g2": {}}

    def members_of(names: list[str]) -> dict[str, membership.Member]:
        out: dict[str, membership.Member] = {}
        for g in names:
            out.update(groups.get(g, {}))
        return out

    fresh = desired_models("n1", [], caches, members_of)
    assert fresh == [entries.desired_entry(caches["a"], "g1"), entries.desired_entry(caches["team/a"], "g1")]
    # Existing order kept, extra fields kept when unchanged, stale entries dropped, changed ones replaced.
    current = [{**entries.desired_entry(caches["team/a"], "g1"), "note": "kept"},
               {"modelName": "b", "sourceModelUri": "s3://b/b", "nodeGroup": "g2"},  # node not in g2
               {"modelName": "deleted", "sourceModelUri": "s3://b/d"},  # cache gone
               {"modelName": "gone-soon", "sourceModelUri": "s3://b/x", "nodeGroup": "g1"},  # being deleted
               {"modelName": "a", "sourceModelUri": "s3://b/a", "nodeGroup": "old"}]  # group changed
    assert desired_models("n1", current, caches, members_of) == [current[0], entries.desired_entry(caches["a"], "g1")]
    # A NotReady member keeps what it has and gets nothing new.
    assert desired_models("sick", current[:1], caches, members_of) == current[:1]
    assert desired_models("sick", [], caches, members_of) == []
    assert desired_models("elsewhere", current, caches, members_of) == []


def test_serving_volumes() -> None:
    groups = {"g1": group("g1", [{"matchExpressions": [expr("gpu", "Exists")]}]), "g2": group("g2", [])}
    c = cache("m", "s3://b/m", ["g1", "g2", "gone"])
    uses = [volumes.Use("a", {}), volumes.Use("a", {}), volumes.Use("b", {"serving.kserve.io/nodegroup": "g2"}),
            volumes.Use("c", {"serving.kserve.io/nodegroup": "other"}),
            volumes.Use("d", {"serving.kserve.io/nodegroup": "gone"})]
    pairs = volumes.desired_pairs(c, groups, uses)
    assert sorted(pairs) == [("a", "g1"), ("b", "g2")]
    p = pairs[("a", "g1")]
    assert (p.pv_name, p.pvc_name) == ("m-g1-a", "m-g1")
    pv = volumes.pv_body(c, groups["g1"], p)
    # The group's PV spec, pre-bound to our claim.
    claim_ref = pv["spec"].pop("claimRef")
    assert claim_ref == {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": "a", "name": "m-g1"}
    assert pv["spec"] == groups["g1"]["spec"]["persistentVolumeSpec"]
    assert pv["metadata"]["ownerReferences"][0]["uid"] == "uid-m"
    pvc = volumes.pvc_body(c, groups["g1"], p)
    assert pvc["spec"]["volumeName"] == "m-g1-a" and pvc["metadata"]["namespace"] == "a"
    # The claim names the PV's class (none here: "", so no default class is given at admission).
    assert pvc["spec"]["storageClassName"] == (groups["g1"]["spec"]["persistentVolumeSpec"].get("storageClassName")
                                               or "")
    assert volumes.cache_of(pvc) == (None, "m")
    nc = cache("m", "s3://b/m", ["g1"], ns="a")
    assert sorted(volumes.desired_pairs(nc, groups, uses)) == [("a", "g1")]
    assert "ownerReferences" not in volumes.pv_body(nc, groups["g1"], pairs[("a", "g1")])["metadata"]
    assert volumes.cache_of(volumes.pv_body(nc, groups["g1"], pairs[("a", "g1")])) == ("a", "m")


def test_node_labels() -> None:
    lmn = {"spec": {"localModels": [
        {"modelName": "a", "sourceModelUri": "s3://b/a"},
        {"modelName": "b", "namespace": "team", "sourceModelUri": "s3://b/b"},
        {"modelName": "c", "sourceModelUri": "s3://b/c"},
    ]}, "status": {"modelStatus": {"a": "ModelDownloaded", "team/b": "ModelDownloaded", "c": "ModelDownloadError",
                                   "b": "ModelDownloaded"}}}
    want = nodelabels.downloaded_labels(lmn)
    assert want == {f"downloaded.modelcache.io/{storage_key('s3://b/a')}", f"downloaded.modelcache.io/{storage_key('s3://b/b')}"}
    n = {"metadata": {"labels": {"other": "x", "downloaded.modelcache.io/stale": "true"}}}
    patch = nodelabels.label_patch(n, want)
    assert patch["metadata"]["labels"]["downloaded.modelcache.io/stale"] is None
    assert all(patch["metadata"]["labels"][k] == "true" for k in want)
    assert "other" not in patch["metadata"]["labels"]
    n["metadata"]["labels"] = {"other": "x", **{k: "true" for k in want}}
    assert nodelabels.label_patch(n, want) == {}
    assert nodelabels.downloaded_labels(None) == set()


def test_pod_mutation_affinity_and_rewrite() -> None:
    pod = {"metadata": {"annotations": {}}, "spec": {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [expr("zone", "In", "a")]}, {"matchExpressions": [expr("zone", "In", "b")]}]}}},
        "initContainers": [{"name": "storage-initializer"}],
        "containers": [{"name": "kserve-container", "env": [{"name": "STORAGE_URI", "value": "s3://b/m/x"}]},
                       {"name": "sidecar"}]}}
    target = podmutate.PodTarget("s3://b/m", "m-g", "/x")
    out = podmutate.mutate(pod, target, rewrite=False)
    required = out["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    terms = required["nodeSelectorTerms"]
    label = f"downloaded.modelcache.io/{storage_key('s3://b/m')}"
    assert all({"key": label, "operator": "Exists"} in t["matchExpressions"] for t in terms) and len(terms) == 2
    assert out["spec"]["initContainers"] == pod["spec"]["initContainers"]  # no rewrite
    assert podmutate.mutate(out, target, rewrite=False) == out  # idempotent (webhook reinvocation)
    rw = podmutate.mutate(pod, target, rewrite=True)
    assert "initContainers" not in rw["spec"]
    assert rw["spec"]["volumes"] == [{"name": "kserve-pvc-source",
                                      "persistentVolumeClaim": {"claimName": "m-g", "readOnly": True}}]
    kc = rw["spec"]["containers"][0]
    assert kc["volumeMounts"] == [{"name": "kserve-pvc-source", "mountPath": "/mnt/models",
                                   "subPath": f"models/{storage_key('s3://b/m')}/x", "readOnly": True}]
    assert kc["env"] == [{"name": "STORAGE_URI", "value": "/mnt/models"}]
    assert "volumeMounts" not in rw["spec"]["containers"][1]
    assert podmutate.mutate(rw, target, rewrite=True) == rw
    ops = podmutate.json_patch(pod, rw)
    assert {"op": "remove", "path": "/spec/initContainers"} in ops
    assert {o["path"] for o in ops} == {"/spec/initContainers", "/spec/affinity", "/spec/containers", "/spec/volumes"}
    bare = podmutate.mutate({"spec": {"containers": [{"name": "kserve-container"}]}}, target, rewrite=False)
    assert bare["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": label, "operator": "Exists"}]}]}
    writable = podmutate.mutate({"metadata": {"annotations": {"storage.kserve.io/readonly": "false"}},
                                 "spec": {"containers": [{"name": "kserve-container"}]}}, target, rewrite=True)
    assert writable["spec"]["containers"][0]["volumeMounts"][0]["readOnly"] is False


def test_event_predicates_ignore_noise() -> None:
    from coordinator.controllers import entries_or_states_changed, node_membership_changed

    old = node("a", gpu="1")
    ours = node("a", gpu="1", **{"downloaded.modelcache.io/abc": "true"})
    assert not node_membership_changed("MODIFIED", ours, old)  # our own label: not a membership change
    assert node_membership_changed("MODIFIED", node("a", gpu="2"), old)
    assert node_membership_changed("MODIFIED", node("a", ready=False, gpu="1"), old)
    assert node_membership_changed("DELETED", old, None)
    heartbeat = node("a", gpu="1")
    heartbeat["status"]["conditions"][0]["lastHeartbeatTime"] = "now"
    assert not node_membership_changed("MODIFIED", heartbeat, old)

    lmn = {"spec": {"localModels": [{"modelName": "m"}]}, "status": {"modelStatus": {"m": "ModelDownloading"}}}
    progress = {**lmn, "status": {**lmn["status"], "modelDetails": {"m": {"bytesDone": 5}}}}
    assert not entries_or_states_changed("MODIFIED", progress, lmn)
    assert entries_or_states_changed("MODIFIED", {**lmn, "status": {"modelStatus": {"m": "ModelDownloaded"}}}, lmn)
    assert entries_or_states_changed("MODIFIED", {**lmn, "spec": {"localModels": []}}, lmn)
    # What decides whether a state is believed (coordinator.reports): the details' storageKey, the Node.
    keyed = {**lmn, "status": {**lmn["status"], "modelDetails": {"m": {"storageKey": "k1", "bytesDone": 5}}}}
    assert entries_or_states_changed("MODIFIED", keyed, progress)
    assert not entries_or_states_changed("MODIFIED", {**keyed, "status": {**keyed["status"], "modelDetails": {
        "m": {"storageKey": "k1", "bytesDone": 9}}}}, keyed)
    assert entries_or_states_changed("MODIFIED", {**keyed, "status": {**keyed["status"], "nodeUID": "u2"}}, keyed)
    # A copy counted on KServe's word, then verified: the caches' CopiesVerified follows.
    verifying = {**keyed, "status": {**keyed["status"], "modelDetails": {
        "m": {"storageKey": "k1", "verification": "Verifying"}}}}
    assert entries_or_states_changed("MODIFIED", verifying, keyed)
    assert entries_or_states_changed("MODIFIED", keyed, verifying)


def test_a_cache_says_which_copies_are_counted_on_kserves_word() -> None:
    from coordinator.caches import _verification_message, _verification_reason
    from coordinator.reports import report_of

    def reported_verification(lmn: dict[str, Any], uid: str | None, skey: str, uri: str) -> str | None:
        return report_of(lmn, uid, skey, storage_key(uri)).verification

    lmn = {"status": {"modelStatus": {"m": "ModelDownloaded"}, "modelDetails": {
        "m": {"storageKey": storage_key("s3://b/m"), "verification": "Unverified"}}}}
    assert reported_verification(lmn, None, "m", "s3://b/m") == "Unverified"
    from coordinator.view import lmn_essentials

    kept = lmn_essentials({"status": {**lmn["status"], "capacity": {"freeBytes": 1}, "modelDetails": {
        "m": {**lmn["status"]["modelDetails"]["m"], "bytesDone": 5}}}})  # what the coordinator's informer keeps
    assert reported_verification(kept, None, "m", "s3://b/m") == "Unverified" and "capacity" not in kept["status"]
    assert reported_verification(lmn, None, "m", "s3://b/other") is None  # about another URI
    assert reported_verification({"status": {"modelStatus": {"m": "ModelDownloaded"}}}, None, "m", "s3://b/m") is None
    assert _verification_reason({"n1": "Verifying", "n2": "Unverified"}) == "Unverified"
    assert _verification_reason({"n1": "Verifying"}) == "Verifying" and _verification_reason({}) == "Verified"
    assert "Unverified on n2; Verifying on n1" in _verification_message({"n1": "Verifying", "n2": "Unverified"})


@pytest.mark.parametrize("fail_closed", [False, True])
def test_pod_webhook_failure_policy(fail_closed: bool) -> None:
    from kubernetes import client

    from coordinator.admission import PodMutator
    from coordinator.lookup import ApiLookup
    from modelcache.kube.client import Kube
    from tests.helpers import free_port

    cfg = client.Configuration(host=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    cfg.retries = 0
    # rewrite: an unlabelled pod's cache is looked up by its URI (the lookup that fails here)
    mutator = PodMutator(ApiLookup(Kube(client.ApiClient(cfg))), rewrite=True, fail_closed=fail_closed)
    pod = {"metadata": {"annotations": {"internal.serving.kserve.io/storage-initializer-sourceuri": "s3://b/m"}},
           "spec": {"containers": [{"name": "kserve-container"}]}}
    out = mutator({"request": {"uid": "u", "namespace": "ns", "object": pod}})["response"]
    assert out["uid"] == "u" and "patch" not in out
    if fail_closed:
        assert out["allowed"] is False and out["status"]["code"] == 500
    else:
        assert out["allowed"] is True and out["warnings"]


def test_condition_keeps_its_time_while_unchanged() -> None:
    conds = aggregate.set_condition([], "NodeGroupsFound", True, "NodeGroupsFound", "ok", "t1")
    assert conds == [{"type": "NodeGroupsFound", "status": "True", "reason": "NodeGroupsFound", "message": "ok",
                      "lastTransitionTime": "t1"}]
    assert aggregate.set_condition(conds, "NodeGroupsFound", True, "NodeGroupsFound", "ok", "t2") == conds
    flipped = aggregate.set_condition([*conds, {"type": "Other"}], "NodeGroupsFound", False, "NodeGroupNotFound",
                                      "missing g", "t3")
    assert flipped == [{"type": "NodeGroupsFound", "status": "False", "reason": "NodeGroupNotFound",
                        "message": "missing g", "lastTransitionTime": "t3"}, {"type": "Other"}]


def test_cache_specs_the_webhook_refuses() -> None:
    """coordinator/cachepolicy.py (security review H3, M4, L2, L3)."""
    from coordinator.cachepolicy import refusal, share_refusal

    leaky = "https://alice:pw@h.example/m.bin?X-Amz-Signature=S&sv=1&sig=T&download=true"
    why = refusal("LocalModelCache", "leaky", {"sourceModelUri": leaky}, namespaced=False)
    assert why and "carries credentials (userinfo, query parameter X-Amz-Signature, query parameter sig)" in why
    assert "pw" not in why.replace("put the", "") and "=S" not in why
    for uri in ("s3://b/m", "hf://org/m", "https://h/m.bin?download=true", "oci://reg/repo@sha256:" + "a" * 64,
                "https://h/m.bin#sha256=" + "b" * 64):
        assert refusal("LocalModelCache", "ok", {"sourceModelUri": uri}, namespaced=False) is None, uri
    params = {"sourceModelUri": "s3://b/m", "storage": {"key": "k", "parameters": {"endpoint_url": "http://x"}}}
    assert refusal("LocalModelCache", "c", params, namespaced=False) is None  # a cluster admin's choice
    assert "may not set endpoint_url in a namespace cache" in (refusal("LocalModelNamespaceCache", "c", params,
                                                                       namespaced=True) or "")

    def group(name: str) -> dict[str, Any] | None:
        return {"metadata": {"annotations": {"modelcache.io/namespace-storage-limit": "1Gi"}}} if name == "g" else {}

    def cache(name: str, uri: str, size: str, groups: list[str]) -> dict[str, Any]:
        return {"metadata": {"name": name}, "spec": {"sourceModelUri": uri, "modelSize": size, "nodeGroups": groups}}

    others = [cache("a", "s3://b/a", "600Mi", ["g"]), cache("a2", "s3://b/a", "600Mi", ["g"]),  # one URI, once
              cache("x", "s3://b/x", "900Mi", ["other"])]
    assert share_refusal("new", "t", cache("new", "s3://b/n", "400Mi", ["g"])["spec"], others, group) is None
    why = share_refusal("new", "t", cache("new", "s3://b/n", "500Mi", ["g", "other"])["spec"], others, group)
    assert why and "would declare 1.1 GiB (modelSize) on node group g, over its share of 1.0 GiB" in why, why
    # The cache itself, edited, counts once (its old spec is among the others).
    assert share_refusal("a", "t", cache("a", "s3://b/a", "1Gi", ["g"])["spec"], others, group) is None
    # No annotation: half the group's storageLimit (M4 on a default install); "none": no share.
    groups = {"half": {"spec": {"storageLimit": "2Gi"}},
              "off": {"metadata": {"annotations": {"modelcache.io/namespace-storage-limit": "none"}},
                      "spec": {"storageLimit": "2Gi"}},
              "bad": {"metadata": {"annotations": {"modelcache.io/namespace-storage-limit": "lots"}},
                      "spec": {"storageLimit": "2Gi"}}}
    for name in ("half", "bad"):
        assert share_refusal("n", "t", cache("n", "s3://b/n", "1Gi", [name])["spec"], [], groups.get) is None
        why = share_refusal("n", "t", cache("n", "s3://b/n", "1025Mi", [name])["spec"], [], groups.get)
        assert why and ("namespace t's caches would declare 1.0 GiB (modelSize) on node group " + name +
                        ", over its share of 1.0 GiB per node (the default: half the group's storageLimit of "
                        "2.0 GiB); delete a LocalModelNamespaceCache of t, or ask a cluster admin to set the "
                        "annotation modelcache.io/namespace-storage-limit") in why, why
    assert share_refusal("n", "t", cache("n", "s3://b/n", "2Gi", ["off"])["spec"], [], groups.get) is None


def test_a_report_is_believed_for_the_current_node_and_uri_with_its_message_and_verification() -> None:
    """coordinator/reports.report_of: the one pass a cache's status makes per member."""
    from coordinator.reports import report_of

    key = storage_key("s3://b/m")
    lmn = {"status": {"nodeUID": "u1", "modelStatus": {"m": "ModelDownloadError"}, "modelDetails": {
        "m": {"storageKey": key, "message": "access  denied\n by the bucket (retry 3 in 40s)"}}}}
    assert report_of(lmn, "u1", "m", key) == Report("ModelDownloadError", "access denied by the bucket", None)
    assert report_of(lmn, "u2", "m", key).state is None  # written for a machine since replaced
    assert report_of(lmn, None, "m", storage_key("s3://b/other")).state is None  # about another URI
    assert report_of(lmn, "u2", "m", key).message == "access denied by the bucket"  # the reason is kept
    verifying = {"status": {"modelStatus": {"m": "ModelDownloaded"}, "modelDetails": {
        "m": {"storageKey": key, "verification": "Verifying"}}}}
    assert report_of(verifying, None, "m", key) == Report("ModelDownloaded", "", "Verifying")
    assert report_of(None, None, "m", key) == Report(None, "", None)
    plain = {"status": {"modelStatus": {"m": "ModelDownloaded"}}}  # KServe's agent: no details, no uid
    assert report_of(plain, "u1", "m", key) == Report("ModelDownloaded", "", None)
