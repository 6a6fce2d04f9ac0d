"""The deployment files (ops/deploy/): Prometheus config and rules pass promtool and their unit
tests, every Kubernetes manifest validates against the API schemas and runs `tessera serve`
with flags it accepts, and the rules and the dashboard name only metrics the gateway defines."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

import gateway.metrics
from tests.doc_examples import github_anchor

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "ops" / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "tessera.json"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
# Every document of every manifest file, named `file:Kind/name` for test ids and messages.
DOCUMENTS = {f"{path.name}:{doc['kind']}/{doc['metadata']['name']}": doc
             for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc}

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not on PATH (Debian package `prometheus`; "
                             "`bash ops/install.sh --test` installs it when run as root)")

PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                   "unless", "offset", "bool", "inf", "nan"}


def promtool(*args: str, cwd: Path = PROMETHEUS) -> str:
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{done.stdout}{done.stderr}"
    return done.stdout


def gateway_metric_names() -> set[str]:
    """The sample names gateway/metrics.py exposes, read from its prometheus_client objects."""
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    names = set()
    for obj in vars(gateway.metrics).values():
        if isinstance(obj, MetricWrapperBase):
            for family in obj.describe():
                names.update(family.name + suffix for suffix in suffixes[family.type])
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label
    matchers, ranges, grouping clauses, functions, keywords and numbers are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)\b(\s*\()?", expr):
        if m.group(2) is None and m.group(1).lower() not in PROMQL_KEYWORDS:
            names.add(m.group(1))
    return names


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel, and the template variables'."""
    board = json.loads(DASHBOARD.read_text())
    queries = [(panel["title"], target["expr"]) for panel in board["panels"]
               for target in panel.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["definition"])
            assert inner, var["definition"]
            queries.append((f"${var['name']}", inner.group(1)))
    return queries


# -- Prometheus -------------------------------------------------------------------------------

@needs_promtool
def test_alert_rules_pass_promtool_check():
    promtool("check", "rules", "alerts.yml")


@needs_promtool
def test_prometheus_config_passes_promtool_check():
    promtool("check", "config", "prometheus.yml")


@needs_promtool
def test_alert_unit_tests_pass():
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


def test_every_alert_fires_in_a_unit_test_and_none_fires_on_healthy_series():
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    fired = {c["alertname"] for c in cases if c.get("exp_alerts")}
    alerts = {rule["alert"] for rule in alert_rules()}
    assert fired == alerts
    healthy = {c["alertname"] for c in tests[0]["alert_rule_test"] if c["exp_alerts"] == []}
    assert healthy == alerts, "the first (healthy) case must expect silence from every alert"


def test_every_alert_has_summary_description_and_a_runbook_section_in_the_operations_doc():
    doc = (REPO / "docs" / "operations.md").read_text()
    runbook = doc[doc.index("\n## Runbook\n"):]
    anchors = {github_anchor(h) for h in re.findall(r"^#{3,4} (.+)$", runbook, re.M)}
    for rule in alert_rules():
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], rule["alert"]
        page, _, anchor = notes["runbook"].partition("#")
        assert page == "docs/operations.md" and anchor in anchors, (rule["alert"], notes["runbook"])


def test_alert_rules_name_only_metrics_the_gateway_defines():
    known = gateway_metric_names() | {"up"}  # up: Prometheus' own, per scrape target
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= known, (rule["alert"], names - known)


def test_error_ratio_rule_names_only_reasons_that_exist():
    from gateway.errors import REASONS

    expr = next(r["expr"] for r in alert_rules() if r["alert"] == "TesseraHighErrorRatio")
    excluded = re.search(r'reason!~"([^"]+)"', expr).group(1).split("|")
    assert set(excluded) - {"OK"} <= set(REASONS)


# -- Grafana ----------------------------------------------------------------------------------

def test_dashboard_queries_name_only_metrics_the_gateway_defines():
    known = gateway_metric_names()
    queries = dashboard_queries()
    assert len(queries) >= 10
    for title, expr in queries:
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= known, (title, names - known)


def test_dashboard_covers_every_gateway_metric():
    used = set().union(*(metric_names(expr) for _, expr in dashboard_queries()))
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in gateway_metric_names()}
    assert families <= {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path):
    rules = [{"record": f"dashboard:query_{i}",
              "expr": expr.replace("$__rate_interval", "5m").replace("$model", ".*")}
             for i, (_, expr) in enumerate(dashboard_queries())]
    (tmp_path / "dashboard.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    promtool("check", "rules", "dashboard.yml", cwd=tmp_path)


# -- Kubernetes -------------------------------------------------------------------------------

def containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(document name, pod spec, container) for every container of every Deployment."""
    return [(name, doc["spec"]["template"]["spec"], c) for name, doc in DOCUMENTS.items()
            if doc["kind"] == "Deployment" for c in doc["spec"]["template"]["spec"]["containers"]]


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_every_manifest_validates_against_the_kubernetes_schemas(name):
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(DOCUMENTS[name], version, strict=True)  # raises when invalid
    broken = {**DOCUMENTS[name], "noSuchField": 1}  # strict: unknown fields are errors
    with pytest.raises(kubernetes_validate.ValidationError):  # so it does reject
        kubernetes_validate.validate(broken, version, strict=True)


def test_every_gateway_pod_runs_tessera_serve_with_flags_it_accepts():
    from ops.cli import build_parser

    assert containers()
    for name, pod, c in containers():
        assert c["command"] == ["tessera", "serve"], name
        args = build_parser().parse_args([*c["command"][1:], *c["args"]])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert args.host == "0.0.0.0", name
        assert ports == {"grpc": args.grpc_port, "http": args.http_port,
                         "metrics": args.metrics_port}, name
        # NOTE: SIGTERM drains for --shutdown-grace-s, then ends the rest and stops workers.
        assert pod["terminationGracePeriodSeconds"] >= args.shutdown_grace_s + 15, name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == args.grpc_port, (name, probe)
        secrets = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"]
                   if "valueFrom" in e}
        assert secrets.keys() >= {"TESSERA_API_KEYS", "TESSERA_OPERATOR_KEY"}, name
        assert c["resources"]["requests"] and c["resources"]["limits"], name


def test_gpu_pools_request_one_gpu_on_gpu_nodes_and_serve_one_worker():
    from ops.cli import build_parser

    gpu = [(n, pod, c) for n, pod, c in containers()
           if "nvidia.com/gpu" in c["resources"]["limits"]]
    assert gpu
    for name, pod, c in gpu:
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1, name
        assert pod["nodeSelector"], name
        assert build_parser().parse_args(["serve", *c["args"]]).max_workers == 1, name


def test_every_pod_has_a_disruption_budget_and_prometheus_finds_it():
    budgets = [d for d in DOCUMENTS.values() if d["kind"] == "PodDisruptionBudget"]
    metrics = DOCUMENTS["30-metrics-service.yaml:Service/tessera-metrics"]
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    [sd] = job["dns_sd_configs"]
    ns = metrics["metadata"]["namespace"]
    assert sd["names"] == [f"{metrics['metadata']['name']}.{ns}.svc.cluster.local"]
    assert sd["port"] == metrics["spec"]["ports"][0]["port"]
    for name, doc in DOCUMENTS.items():
        if doc["kind"] != "Deployment":
            continue
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert doc["metadata"]["namespace"] == ns, name
        assert metrics["spec"]["selector"].items() <= labels.items(), name
        assert any(b["spec"]["selector"]["matchLabels"].items() <= labels.items()
                   for b in budgets), name
