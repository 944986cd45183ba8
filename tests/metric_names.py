"""The metric names the code exports (the agent's and the coordinator's registries, with the
sample suffixes Prometheus sees), and the metric names a PromQL expression reads: what the alert
rules and the dashboard are checked against."""

from __future__ import annotations

import re

#: PromQL words that look like metric names: functions, aggregations, keywords, label matchers.
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "predict_linear", "absent", "absent_over_time",
    "time", "timestamp", "vector", "scalar", "histogram_quantile", "clamp_min", "clamp_max", "clamp", "abs",
    "ceil", "floor", "round", "sort", "sort_desc", "label_replace", "label_join", "changes", "resets",
    "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time", "last_over_time",
    "present_over_time", "inf", "nan", "le",
}
#: Series Prometheus makes itself (and Grafana's built-in variables).
BUILTIN = {"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped"}


def exported() -> set[str]:
    """Every sample name /metrics can show, from the registries themselves."""
    from agent.metrics import AgentMetrics
    from coordinator import metrics as coordinator_metrics

    names: set[str] = set()
    for registry in (AgentMetrics().registry, coordinator_metrics.REGISTRY):
        for family in registry.collect():
            base = family.name
            if family.type == "counter":
                names |= {f"{base}_total", f"{base}_created"}
            elif family.type == "histogram":
                names |= {f"{base}_bucket", f"{base}_count", f"{base}_sum", f"{base}_created"}
            else:
                names.add(base)
    return names


def read_by(expr: str) -> set[str]:
    """The metric names an expression reads (label names, values and durations taken out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # dashboard variables
    words = set(re.findall(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)", expr))
    return {w for w in words if w not in PROMQL_WORDS and not re.fullmatch(r"\d+[smhdwy]?|e\d*", w)}
