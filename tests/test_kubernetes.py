"""deploy/kubernetes: every overlay renders with kustomize, validates against the Kubernetes schemas, and wires
the services together as the code expects (ports, probes, addresses, the network policy)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent.name for p in (KUBERNETES / "overlays").glob("*/kustomization.yaml"))
# The oldest Kubernetes the manifests promise (gRPC probes are GA from 1.27) and the newest schema at hand.
VERSIONS = ("1.27.0", "1.37.0")


def render(overlay: str) -> list[dict]:
    """The overlay's objects, as `kubectl apply -k` would send them (kubectl's built-in kustomize, or kustomize)."""
    if shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(KUBERNETES / "overlays" / overlay)]
    elif shutil.which("kustomize"):
        command = ["kustomize", "build", str(KUBERNETES / "overlays" / overlay)]
    else:
        pytest.skip("neither kubectl nor kustomize is installed to render the manifests")
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request):
    return request.param, render(request.param)


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(deployment):
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def env(c) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_there_is_a_cpu_and_a_gpu_overlay():
    assert {"cpu", "gpu"} <= set(OVERLAYS)


def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    import kubernetes_validate

    name, objects = rendered
    assert len(objects) >= 10
    for version in VERSIONS:
        for o in objects:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(
                    f"{name}: {o['kind']} {o['metadata']['name']} is not valid Kubernetes {version}: "
                    f"{e.message} at {'/'.join(map(str, e.path))}"
                )


def test_probes_are_grpc_on_the_plaintext_health_port_each_server_opens(rendered):
    _, objects = rendered
    for d in by_kind(objects, "Deployment").values():
        c = container(d)
        role = c["args"][0]
        health = int(env(c)[f"SPECDEC_{role.upper()}_HEALTH_PORT"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == health, (d["metadata"]["name"], probe)
        assert health in {p["containerPort"] for p in c["ports"]}


def test_the_orchestrators_find_every_model_server_replica_through_headless_services(rendered):
    _, objects = rendered
    services, deployments = by_kind(objects, "Service"), by_kind(objects, "Deployment")
    orchestrator = env(container(deployments["specdec-orchestrator"]))
    for role, port in (("draft", 50052), ("target", 50053)):
        address = orchestrator[f"SPECDEC_ORCHESTRATOR_{role.upper()}_ADDRESS"]
        assert address == f"dns:///specdec-{role}:{port}"
        service = services[f"specdec-{role}"]
        assert service["spec"]["clusterIP"] == "None"
        c = container(deployments[f"specdec-{role}"])
        assert int(env(c)[f"SPECDEC_{role.upper()}_PORT"]) == port
        assert {"name": "grpc", "containerPort": port} in c["ports"]
        labels = deployments[f"specdec-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()


def test_prometheus_scrapes_the_port_each_service_serves_metrics_on(rendered):
    _, objects = rendered
    for d in by_kind(objects, "Deployment").values():
        c = container(d)
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == env(c)[f"SPECDEC_{c['args'][0].upper()}_METRICS_PORT"]


def test_only_orchestrators_reach_the_model_servers_grpc_ports(rendered):
    _, objects = rendered
    (policy,) = by_kind(objects, "NetworkPolicy").values()
    deployments = by_kind(objects, "Deployment")
    orchestrator_labels = deployments["specdec-orchestrator"]["spec"]["template"]["metadata"]["labels"]
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if ports & {50052, 50053}:
            (peer,) = rule["from"]
            assert peer["podSelector"]["matchLabels"].items() <= orchestrator_labels.items()
            assert "namespaceSelector" not in peer and "ipBlock" not in peer
        else:
            assert ports <= {8002, 8003, 8090}  # metrics and probes only
    selector = policy["spec"]["podSelector"]["matchExpressions"][0]
    assert set(selector["values"]) == {"draft", "target"}
    for d in by_kind(objects, "PodDisruptionBudget").values():
        assert d["spec"]["minAvailable"] == 1


def test_the_gpu_overlay_puts_each_model_server_on_a_gpu_and_takes_the_token_from_a_secret():
    deployments = by_kind(render("gpu"), "Deployment")
    for role in ("draft", "target"):
        c = container(deployments[f"specdec-{role}"])
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env(c)[f"SPECDEC_{role.upper()}_DEVICE"] == "cuda"
        assert env(c)["HF_TOKEN"]["secretKeyRef"]["name"] == "specdec-hf-token"
        assert c["image"].startswith("specdec-gpu")
    assert "nvidia.com/gpu" not in str(container(deployments["specdec-orchestrator"]).get("resources", {}))


def test_the_mtls_component_gives_every_service_the_files_its_settings_name():
    from specdec.config import ModelServerConfig, OrchestratorConfig

    deployments = by_kind(render("cpu-mtls"), "Deployment")
    fields = {"draft": ModelServerConfig, "target": ModelServerConfig, "orchestrator": OrchestratorConfig}
    for name, d in deployments.items():
        c = container(d)
        role = c["args"][0]
        settings = {k: v for k, v in env(c).items() if "TLS" in k}
        assert settings, name
        known = {f"SPECDEC_{role.upper()}_{f.upper()}" for f in fields[role].__dataclass_fields__}
        assert set(settings) <= known, set(settings) - known
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        for path in settings.values():
            if path.startswith("/"):
                assert any(path.startswith(m + "/") for m in mounts), path
