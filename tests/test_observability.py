"""Deployment files and metrics, checked with the real tools: docker-compose, promtool, Prometheus."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client import start_http_server

from cli.main import prometheus_config
from conftest import make_stack, stop_stack
from specdec.config import OrchestratorConfig
from specdec.server import free_ports
from specdec.v1 import model_server_pb2 as ms_pb

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "specdec.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
needs = lambda tool: pytest.mark.skipif(
    shutil.which(tool) is None, reason=f"{tool} is not installed (make system-deps)"
)


@needs("docker-compose")
@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_file_is_valid(profile):
    from tests.test_deploy import compose_config

    services = compose_config(profile)
    for name in ("draft", "target", "orchestrator", "prometheus", "grafana"):
        assert name in services
    gpu = services["target"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and services["draft"]["deploy"] == services["target"]["deploy"]
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"orchestrator", "orchestrator-cpu", "prometheus", "grafana"}
    for name in ("draft", "target", "orchestrator"):
        assert services[name]["healthcheck"]["test"][1:3] == ["specdec", "health"]
    assert services["orchestrator"]["depends_on"]["draft"]["condition"] == "service_healthy"
    # each pair runs its measured best K: 4 for the Llama pair on a GPU, where verify costs about one step; the
    # embedded pair on a CPU runs the same K as `specdec up`, so the two ways of starting it cannot drift apart
    k = {
        name: services[name]["environment"]["SPECDEC_ORCHESTRATOR_NUM_SPECULATIVE_TOKENS"]
        for name in ("orchestrator", "orchestrator-cpu")
    }
    assert k == {"orchestrator": "4", "orchestrator-cpu": str(OrchestratorConfig().num_speculative_tokens)}
    assert services["orchestrator-cpu"]["environment"]["SPECDEC_ORCHESTRATOR_DRAFT_ADDRESS"] == "draft:50052"


@needs("promtool")
def test_promtool_accepts_config_and_rules():
    for args in (["check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")], ["check", "rules", str(ALERTS)]):
        out = subprocess.run(["promtool", *args], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_has_fixed_uids_and_no_lifetime_averages():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "specdec-overview"
    for expr in dashboard_exprs():
        assert "_sum" not in expr or "rate(" in expr, f"lifetime average in {expr}"
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}.pop()


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def alert_value_exprs() -> list[str]:
    """Alert expressions without their threshold: what they compare must exist even when nothing fires."""
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    return [re.sub(r"\s*(<|>|==|!=|<=|>=)\s*[-\d.]+\s*$", "", r["expr"]) for r in rules]


def test_every_forward_width_series_exists_at_zero_before_the_first_pass():
    """A series created by its first observation starts at that value, so rate() over it misses those passes;
    the widths are few and fixed, so each is exported from the start."""
    from prometheus_client import CollectorRegistry

    from specdec.server_metrics import ModelServerMetrics, _tokens_bucket

    registry = CollectorRegistry()
    ModelServerMetrics(registry)
    widths = {_tokens_bucket(n) for n in (1, 2, 8, 9, 64, 65, 4096)}
    for width in widths:
        assert registry.get_sample_value("specdec_forward_seconds_count", {"tokens": width}) == 0.0
    assert len(widths) == 4


@needs("prometheus")
def test_every_dashboard_and_alert_expression_returns_data(
    event_loop_thread, tokenizer, tiny_draft, target_model, tmp_path
):
    stack = make_stack(event_loop_thread, tokenizer, tiny_draft, target_model)
    om, dm, tm, prom_port = free_ports(4)
    servers = [
        start_http_server(p, addr="127.0.0.1", registry=r)
        for p, r in ((om, stack.registry), (dm, stack.draft.registry), (tm, stack.target.registry))
    ]
    (tmp_path / "alerts.yml").write_text(ALERTS.read_text())
    (tmp_path / "prometheus.yml").write_text(
        prometheus_config(
            {"orchestrator": f"127.0.0.1:{om}", "draft": f"127.0.0.1:{dm}", "target": f"127.0.0.1:{tm}"},
            str(tmp_path / "alerts.yml"),
            interval="1s",
        )
    )
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        query = lambda e: _query(prom_port, e)
        _wait(lambda: len(query("up == 1")) == 3, "Prometheus scraping all three services")
        time.sleep(2)
        for i in range(3):  # a short load: greedy, sampled, and one bad request
            stack.generate(prompt="Tell me about the sea.", max_tokens=12, temperature=0.7 * (i % 2), seed=i)
        # a K asked for is kept: adaptive speculation could price drafting out on a slow CPU, and then nothing looks up
        _, _, stats = stack.generate(
            prompt="red green blue red green blue red green",
            max_tokens=12,
            temperature=0.0,
            prompt_lookup_min=2,
            num_speculative_tokens=4,
        )
        assert stats.lookup_rounds > 0  # the pattern repeats, so prompt lookup proposed
        stack.generate(prompt="A JSON object:", max_tokens=12, temperature=0.0, grammar=ms_pb.Grammar(json_object=True))
        with pytest.raises(grpc.RpcError):
            stack.generate(prompt="hi", top_p=3.0)
        time.sleep(4)
        missing = []
        for expr in dashboard_exprs() + alert_value_exprs():
            if "specdec_failover_recovery_seconds" in expr:
                # a quantile of events that did not happen has no value (NaN): its series must exist, at zero
                expr = "sum by (role) (specdec_failover_recovery_seconds_count)"
            values = [float(r["value"][1]) for r in query(expr)]
            if not any(math.isfinite(v) for v in values):
                missing.append(f"{expr} -> {values}")
        assert not missing, "expressions without data:\n" + "\n".join(missing)
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        for s in servers:
            s[0].shutdown()
        stop_stack(stack)


def _query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    except OSError:
        return []
    assert body["status"] == "success", body
    return body["data"]["result"]


def _wait(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")
