"""The monitoring files as the tests read them: Prometheus's configuration and alerting rules, the
PrometheusRule, the Grafana dashboard's queries, and the metric names in a PromQL expression. Shared by the
static checks (tests/deploy/test_monitoring.py) and the live ones (tests/deploy/test_alerts.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import yaml

from tests.deploy.helpers import DEPLOY, K8S

PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERT_RULES = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_RULE = K8S / "prometheus-operator" / "prometheusrule.yaml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "facerec.json"


def load_yaml(path: Any) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), path
    return data


def alert_rules(groups: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every alerting rule of a rules file (alerts.yml by default), in order."""
    groups = groups or load_yaml(ALERT_RULES)
    return [rule for group in groups["groups"] for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    legend: str
    expr: str


def panel_queries(board: dict[str, Any] | None = None) -> list[PanelQuery]:
    """Every panel target's PromQL query (rows have none)."""
    board = board or dashboard()
    return [PanelQuery(panel["title"], target.get("legendFormat", ""), target["expr"])
            for panel in board["panels"] for target in panel.get("targets", [])]


def variable_queries(board: dict[str, Any] | None = None) -> list[str]:
    """The template variables' queries (``label_values(...)``; the datasource variable has none)."""
    board = board or dashboard()
    queries = []
    for variable in board.get("templating", {}).get("list", []):
        if variable["type"] == "datasource":  # its query is a datasource type, not PromQL
            continue
        query = variable.get("query")
        queries.append(query["query"] if isinstance(query, dict) else str(query))
    return queries


_FUNCTIONS_AND_KEYWORDS = {"sum", "avg", "max", "min", "count", "rate", "irate", "increase",
                           "histogram_quantile", "clamp_min", "clamp_max", "by", "without", "on", "ignoring",
                           "group_left", "group_right", "and", "or", "unless", "offset", "bool",
                           "label_values", "topk", "bottomk"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers, ranges, grouping and functions removed)."""
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(by|without|on|ignoring)\s*\([^)]*\)|\"[^\"]*\"", " ", expr)
    tokens = re.findall(r"(?<![\w:$])[A-Za-z_:][\w:]*+(?!\s*\()", stripped)
    return {t for t in tokens if t not in _FUNCTIONS_AND_KEYWORDS and not re.fullmatch(r"e\d*|\d.*", t)}


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
            for label in group.split(",") if label.strip()}
