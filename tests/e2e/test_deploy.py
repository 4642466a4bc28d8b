"""deploy/: the alert rules pass promtool, and every metric the dashboard and the rules name is one
the real server exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROM = os.path.join(ROOT, "deploy", "prometheus")
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "nanokv-dashboard.json")
RULES = os.path.join(PROM, "nanokv-rules.yml")
METRIC = re.compile(r"nanokv:[a-zA-Z_][a-zA-Z0-9_:]*")

# the metrics the issue asks a panel for (exposition names)
REQUIRED = ["nanokv:kv_cache_usage_perc", "nanokv:prefix_cache_queries_total",
            "nanokv:prefix_cache_hits_total", "nanokv:num_preemptions_total",
            "nanokv:num_requests_running", "nanokv:num_requests_waiting",
            "nanokv:prompt_tokens_total", "nanokv:generation_tokens_total",
            "nanokv:time_to_first_token_seconds_bucket",
            "nanokv:inter_token_latency_seconds_bucket",
            "nanokv:e2e_request_latency_seconds_bucket", "nanokv:kv_block_lifetime_seconds_bucket",
            "nanokv:prefix_cache_hit_rate", "nanokv:kv_cache_usage_stddev",
            "nanokv:request_kv_cache_kb_bucket", "nanokv:evicted_blocks_total",
            "nanokv:cache_config_info"]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.geteuid() == 0:  # CI runs as root: scripts/setup.sh must have installed it
            pytest.fail("promtool is missing although scripts/setup.sh installs it as root")
        pytest.skip("promtool not installed (Debian package 'prometheus'; scripts/setup.sh "
                    "installs it when run as root)")
    return path


def dashboard_exprs() -> list[str]:
    with open(DASHBOARD) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var.get("definition"):
            exprs.append(var["definition"])
    return exprs


def rule_exprs() -> list[str]:
    with open(RULES) as f:
        rules = yaml.safe_load(f)
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_promtool_checks_and_tests_the_rules():
    tool = promtool()
    for args in (["check", "rules", RULES],
                 ["test", "rules", os.path.join(PROM, "nanokv-rules.test.yml")],
                 ["check", "config", os.path.join(PROM, "prometheus.yml")]):
        r = subprocess.run([tool, *args], capture_output=True, text=True, cwd=PROM, timeout=60)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}\n{r.stderr}"


def test_alerts_the_issue_asks_for():
    with open(RULES) as f:
        rules = {r["alert"]: r for g in yaml.safe_load(f)["groups"] for r in g["rules"]}
    assert rules["NanokvPrefixCacheHitRateLow"]["expr"].endswith("< 0.4")
    assert rules["NanokvKVCacheUsageHigh"]["expr"].endswith("> 0.9")
    assert rules["NanokvPrefixCacheHitRateLow"]["for"] == "5m"
    assert rules["NanokvKVCacheUsageHigh"]["for"] == "5m"
    assert "nanokv:num_preemptions_total" in rules["NanokvPreemptionStorm"]["expr"]


def test_every_named_metric_is_exported(server):
    exported = {name for name, _ in server.metrics()}
    exprs = dashboard_exprs() + rule_exprs()
    named = {m for e in exprs for m in METRIC.findall(e)}
    assert named, "no metric found in the expressions"
    missing = sorted(named - exported)
    assert not missing, f"dashboard/rules name metrics the server does not export: {missing}"
    in_dashboard = {m for e in dashboard_exprs() for m in METRIC.findall(e)}
    assert not set(REQUIRED) - in_dashboard, sorted(set(REQUIRED) - in_dashboard)
    assert not set(REQUIRED) - exported


def test_dashboard_shows_hit_rate_by_request_class():
    by_class = [e for e in dashboard_exprs()
                if "prefix_cache_hits_total" in e and "request_class" in e]
    assert by_class, "no panel splits the prefix-cache hit rate by request class"
