"""Loading the deploy/ files the way their tools do, offline, for tests/deploy/test_*.py.

Schemas (no network, no cluster, no Docker engine):
  Kubernetes  the `kubernetes-validate` package's JSON schemas (generated from the Kubernetes
              OpenAPI spec, one directory per minor version; we use 1.30, `-strict`, which
              rejects unknown fields).
  Compose     the compose-spec JSON schema that `check-jsonschema` vendors
              (check_jsonschema/builtin_schemas/vendor/compose-spec.json, Apache-2.0, from
              github.com/compose-spec/compose-spec).
"""

from __future__ import annotations

import importlib.resources
import json
import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILES = (DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.gpu.yml")
KUBERNETES_VERSION = "1.30"
AIGW_IMAGE = re.compile(r"^(?:.*/)?aigw:")  # our image, whatever the registry

Obj = dict[str, Any]


def kustomization() -> Obj:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def k8s_objects() -> list[Obj]:
    """Every object of the kustomization's resources, with the kustomization's namespace."""
    config = kustomization()
    objects = []
    for resource in config["resources"]:
        for obj in yaml.safe_load_all((K8S / resource).read_text()):
            if obj:
                obj.setdefault("metadata", {}).setdefault("namespace", config["namespace"])
                if obj["kind"] == "Namespace":
                    obj["metadata"].pop("namespace")
                objects.append(obj)
    return objects


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind} {name}")


def pod_spec(obj: Obj) -> Obj | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return None


def containers(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    """(workload, container) for every container of every workload."""
    return [(obj, c) for obj in objects if (spec := pod_spec(obj)) is not None
            for c in spec.get("initContainers", []) + spec["containers"]]


def env_value(objects: list[Obj], container: Obj, name: str) -> str:
    """The value a container's env var gets (fieldRef: a stand-in pod name)."""
    for entry in container.get("env", []):
        if entry["name"] != name:
            continue
        if "value" in entry:
            return str(entry["value"])
        source = entry["valueFrom"]
        if "fieldRef" in source:
            return "aigw-replica-0"
        ref = source.get("configMapKeyRef") or source["secretKeyRef"]
        data = find(objects, "ConfigMap" if "configMapKeyRef" in source else "Secret",
                     ref["name"])
        return str(data.get("data", data.get("stringData", {}))[ref["key"]])
    raise AssertionError(f"container {container['name']} has no env var {name}")


def expanded_args(objects: list[Obj], container: Obj) -> list[str]:
    """The container's args with Kubernetes' $(VAR) references expanded."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                   lambda m: env_value(objects, container, m.group(1)), arg)
            for arg in container.get("args", [])]


def compose(path: Path = COMPOSE_FILES[0]) -> Obj:
    return yaml.safe_load(path.read_text())


def compose_schema() -> Obj:
    vendor = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor"
    return json.loads((vendor / "compose-spec.json").read_text())


def env_var_names(text: str) -> set[str]:
    return set(re.findall(r"\bAIGW_[A-Z0-9_]+\b", text))
