"""The Grafana dashboard (monitoring/grafana/modelcache.json, Grafana's documented JSON model; no
Grafana here): every panel's query and the node variable read only metrics the code exports, every
panel has a place and a query, and every metric of ours is on it somewhere."""

from __future__ import annotations

import json
import re
from typing import Any

from tests.helpers import REPO
from tests.metric_names import BUILTIN, exported, read_by

DASHBOARD = REPO / "monitoring" / "grafana" / "modelcache.json"


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def queries(d: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every panel target, and of the query variables."""
    out = [(p["title"], t["expr"]) for p in d["panels"] if p["type"] != "row" for t in p["targets"]]
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+), *\w+\)", var["definition"])
            assert m, var["definition"]
            out.append((f"variable {var['name']}", m.group(1)))
    return out


def test_every_query_reads_only_exported_metrics() -> None:
    names = exported() | BUILTIN
    for title, expr in queries(dashboard()):
        assert read_by(expr), f"{title}: {expr!r} reads no metric"
        missing = read_by(expr) - names
        assert missing == set(), f"panel {title!r} reads {sorted(missing)}, which nothing exports"


def test_every_metric_of_ours_is_on_the_dashboard() -> None:
    """A new metric gets a panel (or it is not worth exporting)."""
    used = set().union(*(read_by(e) for _t, e in queries(dashboard())))
    families = {re.sub(r"_(total|bucket|count|sum|created)$", "", n) for n in exported()}
    shown = {re.sub(r"_(total|bucket|count|sum|created)$", "", n) for n in used}
    assert families - shown == set()


def test_the_json_model_grafana_loads() -> None:
    d = dashboard()
    assert d["uid"] == "modelcache-fleet" and d["schemaVersion"] >= 36 and d["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "node"}
    for p in d["panels"]:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["type"] in {"stat", "table", "timeseries", "bargauge", "gauge"}, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"] and all(t["refId"] and t["datasource"] == p["datasource"] for t in p["targets"])
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Fleet", "Node $node"]
    # No two panels overlap on the 24-column grid.
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        pos = p["gridPos"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
