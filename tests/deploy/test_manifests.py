"""deploy/k8s: valid Kubernetes 1.30 objects that agree with each other and with the code.

Validation is offline: the `kubernetes-validate` package's strict JSON schemas (see manifests.py).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from cli.main import build_parser
from gateway.fleet.discovery import DnsTarget, parse_discover
from gateway.routing import ROUTER_NAMES
from gateway.settings import load_settings
from tests.deploy.manifests import (
    AIGW_IMAGE,
    K8S,
    KUBERNETES_VERSION,
    Obj,
    containers,
    env_value,
    expanded_args,
    find,
    k8s_objects,
    kustomization,
    pod_spec,
)

OBJECTS = k8s_objects()


def _id(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _gateway_settings(tmp_path: Path):  # type: ignore[no-untyped-def]
    config = tmp_path / "gateway.toml"
    config.write_text(find(OBJECTS, "ConfigMap", "aigw-gateway-config")["data"]["gateway.toml"])
    return load_settings(config)


def _container(kind: str, name: str) -> Obj:
    return pod_spec(find(OBJECTS, kind, name))["containers"][0]  # type: ignore[index]


def _pre_stop_sleep_s(container: Obj) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


def test_every_manifest_file_is_in_the_kustomization() -> None:
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert files == set(kustomization()["resources"])


@pytest.mark.parametrize("obj", OBJECTS, ids=_id)
def test_object_validates_against_the_kubernetes_schema(obj: Obj) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_schema_validation_rejects_a_misspelled_field() -> None:
    broken = copy.deepcopy(find(OBJECTS, "Deployment", "aigw-gateway"))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_same_objects() -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                              timeout=60, check=True).stdout
    assert sorted(map(_id, yaml.safe_load_all(rendered))) == sorted(map(_id, OBJECTS))


def test_gateway_config_loads_and_discovers_replicas_through_the_headless_service(
        tmp_path: Path) -> None:
    settings = _gateway_settings(tmp_path)
    replicas = find(OBJECTS, "StatefulSet", "aigw-replica")
    service = find(OBJECTS, "Service", replicas["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # headless: one A record per ready pod
    namespace, port = service["metadata"]["namespace"], service["spec"]["ports"][0]["port"]
    target = parse_discover(settings.models[0].discover or "")
    assert target == DnsTarget(f"{service['metadata']['name']}.{namespace}.svc.cluster.local", port)
    assert [m.endpoints for m in settings.models] == [()]  # no hand-kept list
    assert settings.host == "0.0.0.0"
    assert settings.router in ROUTER_NAMES


def test_headless_service_selects_the_replica_pods_on_a_named_port() -> None:
    replicas = find(OBJECTS, "StatefulSet", "aigw-replica")
    service = find(OBJECTS, "Service", replicas["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    labels = replicas["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    # DNS SRV records are _<port name>._tcp.<service>: the port needs a name
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]


def test_replicas_request_gpus_and_are_ready_only_on_health() -> None:
    container = _container("StatefulSet", "aigw-replica")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = expanded_args(OBJECTS, container)
    assert ports[probe["port"]] == int(args[args.index("--port") + 1])
    assert args[args.index("--device") + 1] == "cuda"


def test_replicas_drain_within_their_termination_grace_period() -> None:
    spec = pod_spec(find(OBJECTS, "StatefulSet", "aigw-replica"))
    aiohttp_drain_s = 60  # engine/server/app.py: web.run_app's default shutdown_timeout
    assert spec is not None
    assert spec["terminationGracePeriodSeconds"] >= (
        _pre_stop_sleep_s(spec["containers"][0]) + aiohttp_drain_s)


def test_gateway_drains_within_its_termination_grace_period(tmp_path: Path) -> None:
    spec = pod_spec(find(OBJECTS, "Deployment", "aigw-gateway"))
    assert spec is not None
    drain_s = _gateway_settings(tmp_path).drain_timeout_s
    assert (spec["terminationGracePeriodSeconds"]
            > _pre_stop_sleep_s(spec["containers"][0]) + drain_s)


def test_gateway_autoscaler_targets_the_gateway_deployment_on_cpu() -> None:
    hpa = find(OBJECTS, "HorizontalPodAutoscaler", "aigw-gateway")
    target = hpa["spec"]["scaleTargetRef"]
    deployment = find(OBJECTS, target["kind"], target["name"])
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert pod_spec(deployment)["containers"][0]["resources"]["requests"]["cpu"]  # type: ignore[index]


@pytest.mark.parametrize("service", [o for o in OBJECTS if o["kind"] == "Service"], ids=_id)
def test_service_selects_a_workload_and_targets_its_named_ports(service: Obj) -> None:
    selected = [o for o in OBJECTS
                if pod_spec(o) is not None and service["spec"]["selector"].items()
                <= o["spec"]["template"]["metadata"]["labels"].items()]
    assert len(selected) == 1
    port_names = {p.get("name") for c in pod_spec(selected[0])["containers"]  # type: ignore[index]
                  for p in c.get("ports", [])}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in port_names


@pytest.mark.parametrize("pair",
                         [p for p in containers(OBJECTS) if AIGW_IMAGE.match(p[1]["image"])],
                         ids=lambda p: p[1]["name"])
def test_aigw_container_args_parse_with_the_aigw_cli(pair: tuple[Obj, Obj]) -> None:
    args = expanded_args(OBJECTS, pair[1])
    parsed = build_parser().parse_args(args)
    assert parsed.command == args[0]


def test_every_secret_and_configmap_reference_resolves() -> None:
    def keys(kind: str, name: str) -> set[str]:
        obj = find(OBJECTS, kind, name)
        return set(obj.get("data", {})) | set(obj.get("stringData", {}))

    for workload, container in containers(OBJECTS):
        for entry in container.get("env", []):
            source = entry.get("valueFrom", {})
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                assert ref["key"] in keys("Secret", ref["name"]), (workload["metadata"], ref)
            if "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                assert ref["key"] in keys("ConfigMap", ref["name"]), (workload["metadata"], ref)
        for entry in container.get("envFrom", []):
            find(OBJECTS, "ConfigMap", entry["configMapRef"]["name"])
    for workload in OBJECTS:
        for volume in (pod_spec(workload) or {}).get("volumes", []):
            if "configMap" in volume:
                find(OBJECTS, "ConfigMap", volume["configMap"]["name"])


def test_replicas_and_gateways_read_one_replica_secret_from_a_mounted_secret() -> None:
    """Each aigw container's AIGW_REPLICA_SECRET_FILE lies in a read-only mount of the Secret
    key `replica-secret`, the same for the replicas (which require it) and the gateways."""
    sources = {}
    for workload, container in containers(OBJECTS):
        if not AIGW_IMAGE.match(container["image"]):
            continue
        path = env_value(OBJECTS, container, "AIGW_REPLICA_SECRET_FILE")
        (mount,) = [m for m in container["volumeMounts"]
                    if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mount.get("readOnly") is True
        (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
        (item,) = [i for i in volume["secret"]["items"]
                   if path == f"{mount['mountPath'].rstrip('/')}/{i['path']}"]
        sources[workload["metadata"]["name"]] = (volume["secret"]["secretName"], item["key"])
        assert not any("ADMIN_TOKEN" in e["name"] for e in container.get("env", []))
    assert {"aigw-gateway", "aigw-replica"} <= set(sources)
    assert len(set(sources.values())) == 1
    secret_name, key = next(iter(sources.values()))
    assert key in find(OBJECTS, "Secret", secret_name)["stringData"]


def test_gateway_liveness_survives_a_replica_outage_and_readiness_does_not() -> None:
    (container,) = [c for w, c in containers(OBJECTS) if w["metadata"]["name"] == "aigw-gateway"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_redis_keeps_keys_and_usage_across_restarts_and_never_evicts() -> None:
    conf = find(OBJECTS, "ConfigMap", "aigw-redis-config")["data"]["redis.conf"]
    settings = dict(line.split(None, 1) for line in conf.splitlines()
                    if line.strip() and not line.lstrip().startswith("#"))
    assert settings["appendonly"] == "yes"
    assert settings["appendfsync"] == "everysec"
    assert settings["maxmemory-policy"] == "noeviction"
    redis = find(OBJECTS, "StatefulSet", "aigw-redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
