"""The Grafana dashboard (deploy/grafana) queries only metrics a live stack exports, with labels they have,
and its provisioning loads it from where the README mounts it."""

from __future__ import annotations

import json
import re
import shlex
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from _stack_helpers import TIMEOUT, chain, config, fill

from kvtier.stack import TierStack

parser = pytest.importorskip("prometheus_client.parser")

GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "kvtier.json"
# Labels Prometheus adds at scrape time, not kvtier.
SCRAPE_LABELS = {"job", "instance"}
# PromQL words that are not metric names (functions and aggregations are told apart by the "(" after them).
KEYWORDS = {"bool", "and", "or", "unless", "offset", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan"}
_NAME = r"[A-Za-z_:][A-Za-z0-9_:]*"


def _strip_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers left once strings, label matchers, ranges and
    label lists are removed, other than functions / aggregations (followed by "(") and keywords."""
    s = _strip_strings(expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\boffset\s+\S+", " ", s)
    out = set()
    for m in re.finditer(rf"(?<![\w.$]){_NAME}", s):
        if not s[m.end():].lstrip().startswith("(") and m.group().lower() not in KEYWORDS:
            out.add(m.group())
    return out


def selector_labels(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, label names its matchers use) for every ``metric{...}`` in ``expr``."""
    s = _strip_strings(expr)
    return [(m.group(1), set(re.findall(rf"({_NAME})\s*(?:=~|!~|!=|=)", m.group(2))))
            for m in re.finditer(rf"({_NAME})\s*\{{([^}}]*)\}}", s)]


def grouping_labels(expr: str) -> set[str]:
    """Labels named in ``by (...)`` / ``without (...)`` / ``on (...)`` / ``ignoring (...)``."""
    s = _strip_strings(expr)
    return {lab.strip() for g in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", s)
            for lab in g.split(",") if lab.strip()}


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target (rows' nested panels too) and every query variable."""
    out = []
    stack = list(dashboard["panels"])
    while stack:
        p = stack.pop()
        stack.extend(p.get("panels", []))
        for t in p.get("targets", []):
            if t.get("expr"):
                out.append((f"panel {p['title']!r} target {t['refId']}", t["expr"]))
    for v in dashboard.get("templating", {}).get("list", []):
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"\s*label_values\((.*),\s*(" + _NAME + r")\s*\)\s*", q)
            assert m, f"variable {v['name']}: expected label_values(<selector>, <label>), got {q!r}"
            out.append((f"variable {v['name']!r}", f"sum by ({m.group(2)}) ({m.group(1)})"))
    return out


def problems(dashboard: dict[str, Any], samples: dict[str, set[str]]) -> list[str]:
    """Every query of ``dashboard`` naming a metric that is not among ``samples`` (sample name -> its label
    names), or a label that metric does not have."""
    out = []
    for where, expr in queries(dashboard):
        names = metric_names(expr)
        if not names:
            out.append(f"{where}: no metric in {expr!r}")
        for name in sorted(names - samples.keys()):
            out.append(f"{where}: {name} is not exported")
        for name, labels in selector_labels(expr):
            if name not in samples:
                continue  # reported above
            for lab in sorted(labels - SCRAPE_LABELS - samples[name]):
                out.append(f"{where}: {name} has no label {lab!r}")
        for lab in sorted(grouping_labels(expr) - SCRAPE_LABELS):
            for name in sorted(n for n in names if lab not in samples.get(n, {lab})):
                out.append(f"{where}: grouped by {lab!r}, which {name} does not have")
    return out


@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.99, sum by (le, tier) (rate(kvtier_tier_op_seconds_bucket{tier=~"$tier"}[5m])))',
     {"kvtier_tier_op_seconds_bucket"}),
    ("sum(rate(a_total[$__rate_interval])) / sum(rate(b_total[1m] offset 5m)) * 1e3 > bool 0",
     {"a_total", "b_total"}),
    ('max by (tier) (kvtier_backend_up{job=~"$job"}) == on (tier) group_left kvtier_x', {"kvtier_backend_up",
                                                                                         "kvtier_x"}),
])
def test_metric_names_of_promql(expr, names):
    assert metric_names(expr) == names


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> dict[str, set[str]]:
    """Sample name -> label names, from a live stack's /metrics over HTTP after stores and loads that touched
    the host tier and the disk (so every counter a panel reads has moved)."""
    tmp = tmp_path_factory.mktemp("grafana")
    port = _free_port()
    st = TierStack(config(tmp, host_slots=4, metrics={"prometheus_port": port, "bind_address": "127.0.0.1"}))
    try:
        hs = chain(st, 8)
        fill(st, list(range(8)), seed=5)
        for part in (slice(0, 4), slice(4, 8)):  # the second half evicts the first from host memory
            st.store(hs[part], list(range(8))[part]).wait(TIMEOUT)
            assert st.flush(TIMEOUT)
        st.on_device_freed(range(8))
        assert st.lookup(hs).num_blocks == 8
        assert st.load(hs, list(range(10, 18))).wait(TIMEOUT).num_loaded == 8
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT).read().decode()
    finally:
        st.close()
    samples: dict[str, set[str]] = {}
    values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in parser.text_string_to_metric_families(body):
        for s in fam.samples:
            samples.setdefault(s.name, set()).update(s.labels)
            values[s.name, frozenset(s.labels.items())] = s.value
    # The stack really did what the panels are meant to show.
    assert values["kvtier_tier_hits_total", frozenset({("tier", "disk"), ("kind", "storage")})] > 0
    assert values["kvtier_tier_hits_total", frozenset({("tier", "host"), ("kind", "host")})] > 0
    assert values["kvtier_tier_bytes_in_total", frozenset({("tier", "disk"), ("kind", "storage")})] > 0
    assert values["kvtier_backend_up", frozenset({("tier", "disk")})] == 1.0
    assert values["kvtier_backend_capacity_bytes", frozenset({("tier", "disk")})] == 10 * 2**30
    assert values["kvtier_backend_used_bytes", frozenset({("tier", "disk")})] > 0
    return samples


def test_every_panel_queries_exported_metrics(scraped):
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] == "kvtier"
    found = queries(dashboard)
    assert len(found) >= 20
    assert problems(dashboard, scraped) == []
    queried = set().union(*(metric_names(e) for _, e in found))
    # The panels the dashboard promises: hit rate, tokens, traffic, latency, faults, health, capacity.
    for must in ("kvtier_tier_hits_total", "kvtier_tier_misses_total", "kvtier_tier_hit_tokens_total",
                 "kvtier_tier_bytes_in_total", "kvtier_tier_bytes_out_total", "kvtier_tier_op_seconds_bucket",
                 "kvtier_tier_failures_total", "kvtier_tier_unavailable_total",
                 "kvtier_tier_stores_skipped_total", "kvtier_tier_dropped_total", "kvtier_backend_up",
                 "kvtier_host_slots_used", "kvtier_backend_used_bytes", "kvtier_backend_capacity_bytes"):
        assert must in queried, must


@pytest.mark.parametrize("panel, old, new, problem", [
    ("Hit rate per tier", "kvtier_tier_misses_total", "kvtier_tier_miss_total",
     "kvtier_tier_miss_total is not exported"),
    # A histogram is queried by its samples' names (_bucket, _sum, _count), never the family's.
    ("Latency p99 per tier and op", "_bucket", "", "kvtier_tier_op_seconds is not exported"),
    ("Bytes in per tier", "by (tier)", "by (backend)",
     "grouped by 'backend', which kvtier_tier_bytes_in_total does not have"),
    ("Backend up", 'tier=~"$tier"', 'backend=~"$tier"', "kvtier_backend_up has no label 'backend'"),
])
def test_a_misspelled_metric_or_label_is_caught(scraped, panel, old, new, problem):
    bad = json.loads(DASHBOARD.read_text())
    target = next(p for p in bad["panels"] if p["title"] == panel)["targets"][0]
    assert old in target["expr"]
    target["expr"] = target["expr"].replace(old, new)
    assert problems(bad, scraped) == [f"panel {panel!r} target A: {problem}"]


def test_provisioning_loads_the_dashboard_folder():
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvtier.yaml").read_text())
    (prov,) = providers["providers"]
    assert providers["apiVersion"] == 1 and prov["type"] == "file"
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert [d["type"] for d in datasources["datasources"]] == ["prometheus"]
    # The README's docker run mounts: container path -> repository folder.
    readme = (GRAFANA / "README.md").read_text()
    (cmd,) = [b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "docker run" in b]
    words = shlex.split(cmd.replace("\\\n", " "))
    mounts = {}
    for i, w in enumerate(words):
        if w == "-v":
            src, dst = words[i + 1].split(":")[:2]
            mounts[dst] = GRAFANA.parents[1] / src.replace("$PWD/", "")
    assert mounts[prov["options"]["path"]] == DASHBOARD.parent
    assert mounts["/etc/grafana/provisioning/dashboards"] == GRAFANA / "provisioning" / "dashboards"
    assert mounts["/etc/grafana/provisioning/datasources"] == GRAFANA / "provisioning" / "datasources"
    # Panels take their data source from the variable, so any Prometheus data source (the example's or
    # one already there) serves them.
    dashboard = json.loads(DASHBOARD.read_text())
    (ds,) = [v for v in dashboard["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for p in dashboard["panels"]:
        for t in [p, *p.get("targets", [])]:
            if "datasource" in t:
                assert t["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
