"""The Kubernetes manifests in deploy/: the core resources validate against
Kubernetes' own schemas (kubernetes-validate, strict); the Istio
VirtualService, whose schema kubernetes-validate does not carry, is checked
for the routing it must do. Neither can run on this machine."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
ENVS = ("prod", "canary", "staging")


def resources() -> list[dict]:
    return [
        doc
        for path in sorted(K8S.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


@pytest.mark.parametrize(
    "resource",
    [r for r in resources() if not r["apiVersion"].startswith("networking.istio.io")],
    ids=lambda r: f"{r['kind']}/{r['metadata']['name']}",
)
def test_core_resources_validate_strictly(resource):
    kubernetes_validate.validate(resource, "1.37", strict=True)


def test_every_environment_has_probed_deployment_and_service():
    by_kind = {}
    for r in resources():
        by_kind.setdefault(r["kind"], {})[r["metadata"]["name"]] = r
    for env in ENVS:
        pod = by_kind["Deployment"][f"o3-{env}"]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        service = by_kind["Service"][f"o3-{env}"]["spec"]
        assert service["selector"] == {"app": "o3", "env": env}


def test_virtualservice_routes_by_header_weight_and_refuses_unknown():
    (vs,) = [r for r in resources() if r["kind"] == "VirtualService"]
    routes = vs["spec"]["http"]
    exact = {}
    for route in routes[:3]:
        value = route["match"][0]["headers"]["x-o3-env"]["exact"]
        exact[value] = route["route"][0]["destination"]["host"]
    assert exact == {env: f"o3-{env}" for env in ENVS}
    unknown = routes[3]
    assert unknown["match"][0]["headers"]["x-o3-env"] == {"regex": ".*"}
    assert unknown["directResponse"]["status"] == 400
    split = {r["destination"]["host"]: r["weight"] for r in routes[4]["route"]}
    assert "match" not in routes[4]
    assert split == {"o3-prod": 95, "o3-canary": 5}
