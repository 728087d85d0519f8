"""Every manifest in ``deploy/k8s/`` validates against the Kubernetes schemas (``kubernetes-validate``, which
bundles the upstream OpenAPI schemas: offline, strict, so an unknown or misspelt field fails), for the oldest
Kubernetes the manifests support (1.30: appArmorProfile, the pod-index label) and the newest the validator knows. Custom
resources have no bundled schema: the ServiceMonitor is checked here for what Prometheus Operator needs (a
selector that picks the broker's Service, an endpoint on a port that Service names). And the pieces agree: the
probes ask the broker's health endpoints on the port its --metrics-port serves, the actor pods request NVIDIA
GPUs, key files are mounted private, and every Secret the manifests name is made in deploy/README.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

validate_mod = pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate is not installed "
                                   "(the 'test' extra: pip install -e '.[test]')")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VERSIONS = ("1.30.0", validate_mod.latest_version())
CUSTOM = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None and path.name != "kustomization.yaml":
                out.append((path.name, doc))
    return out


def by_kind(kind: str, name: str) -> dict[str, Any]:
    return next(d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name)


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name, doc", [m for m in manifests() if (m[1]["apiVersion"], m[1]["kind"]) not in CUSTOM],
                         ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_each_manifest_validates_against_the_kubernetes_schema(name: str, doc: dict, version: str) -> None:
    validate_mod.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_the_validator_rejects_a_misspelt_field() -> None:
    doc = by_kind("Deployment", "libra-broker")
    bad = {**doc, "spec": {**doc["spec"], "replica": 1}}
    with pytest.raises(validate_mod.ValidationError):
        validate_mod.validate(bad, VERSIONS[0], strict=True)


def test_kustomization_lists_every_cluster_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kust["resources"])
    assert all((K8S / r).is_file() for r in listed)
    assert {p.name for p in K8S.glob("*.yaml")} - listed == {"kustomization.yaml", "driver-job.yaml"}  # per job
    assert [i["name"] for i in kust["images"]] == ["libra"]
    assert {c["image"] for _, d in manifests() if "template" in d.get("spec", {}) for c in containers(d)} == {"libra"}


def test_the_servicemonitor_scrapes_the_brokers_metrics_port() -> None:
    sm = by_kind("ServiceMonitor", "libra-broker")
    svc = by_kind("Service", "libra-broker")
    assert sm["metadata"]["name"] and isinstance(sm["spec"]["endpoints"], list)
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    names = {p["name"] for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in names and ep.get("path", "/metrics") == "/metrics"
        assert re.fullmatch(r"\d+(ms|s|m)", ep["interval"])


def test_the_probes_ask_the_brokers_health_endpoints_on_its_metrics_port() -> None:
    dep = by_kind("Deployment", "libra-broker")
    (c,) = containers(dep)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert f"--metrics-port={ports['metrics']}" in c["args"] and "--bind=tcp://0.0.0.0:%d" % ports["zmq"] in c["args"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    svc = by_kind("Service", "libra-broker")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(ports)


def test_actor_pods_request_gpus_and_lay_out_as_the_driver_does() -> None:
    sts = by_kind("StatefulSet", "libra-actors")
    (c,) = containers(sts)
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert f"--gpus-per-node={gpus}" in c["args"] and f"--node-gpus={gpus}" in c["args"]
    assert f"--nodes={sts['spec']['replicas']}" in c["args"] and "--node=$(POD_INDEX)" in c["args"]
    driver = containers(by_kind("Job", "libra-driver"))[0]["args"][0]
    assert f"--nodes {sts['spec']['replicas']} --gpus-per-node {gpus}" in driver


def test_key_files_are_mounted_private_and_every_secret_is_made_in_the_readme() -> None:
    readme = (ROOT / "deploy" / "README.md").read_text()
    made = set(re.findall(r"kubectl -n libra create secret generic (\S+)", readme))
    named = set()
    for _, d in manifests():
        spec = d.get("spec", {}).get("template", {}).get("spec", {})
        assert "fsGroup" not in spec.get("securityContext", {})  # it would make key files group-readable
        for v in spec.get("volumes", []):
            if "secret" in v:
                named.add(v["secret"]["secretName"])
                if v["secret"]["secretName"] in ("libra-broker-key", "libra-actor-keys", "libra-driver-key") \
                        and "items" not in v["secret"]:  # a secret key inside: 0400 (libra refuses 0o077 bits)
                    assert v["secret"]["defaultMode"] == 0o400, v
    assert named <= made, f"Secrets the manifests mount but deploy/README.md never makes: {named - made}"
