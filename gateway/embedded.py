"""The embedded default: with no models configured, `aigw serve` starts N local engine replicas
(`aigw replica` subprocesses on free ports), waits for their /health, routes to them, and stops
them on exit. This runs before the event loop starts, so its blocking waits are fine here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.settings import ModelSettings
from infra.ports import free_port


@dataclass
class ReplicaProcess:
    process: subprocess.Popen[bytes]
    url: str


def start_replicas(num_replicas: int, model_path: str | None, kv_cache_memory_bytes: int | None,
                   host: str = "127.0.0.1", extra_args: list[str] | None = None) -> list[ReplicaProcess]:
    """Start `aigw replica` processes; without `model_path` each uses the engine's default model.
    `extra_args` go to every replica's command line as they are (`aigw serve --replica-args`)."""
    replicas = []
    for _ in range(num_replicas):
        port = free_port(host)
        command = [sys.executable, "-m", "gateway.cli", "replica", "--host", host, "--port", str(port)]
        if model_path is not None:
            command += ["--model", model_path]
        if kv_cache_memory_bytes is not None:
            command += ["--kv-cache-memory", str(kv_cache_memory_bytes)]
        command += extra_args or []
        replicas.append(ReplicaProcess(subprocess.Popen(command, env=replica_environ(os.environ)),
                                       f"http://{host}:{port}"))
    return replicas


def replica_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The embedded replicas' environment: the gateway's, except that an `OTEL_SERVICE_NAME` set
    for the gateway names them `<that name>-replica`, so that their spans (exported by each replica
    itself, and shown by the dashboard) are not filed under the gateway's service; and without
    `PROMETHEUS_MULTIPROC_DIR`, which is the gateway workers' (each replica serves its own
    /metrics; its counters in there would be summed into the gateway's)."""
    env = dict(environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if env.get("OTEL_SERVICE_NAME"):
        env["OTEL_SERVICE_NAME"] += "-replica"
    return env


def wait_healthy(replicas: list[ReplicaProcess], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            if replica.process.poll() is not None:
                raise RuntimeError(f"replica {replica.url} exited with {replica.process.returncode}")
            try:
                with urllib.request.urlopen(replica.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        pending.remove(replica)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"replicas not healthy after {timeout_s:g}s: {[r.url for r in pending]}")
        if pending:
            time.sleep(0.25)


def model_settings_for(replicas: list[ReplicaProcess]) -> ModelSettings:
    """One model served by all replicas, named as the first replica's /v1/models says."""
    with urllib.request.urlopen(replicas[0].url + "/v1/models", timeout=5) as response:
        entry = json.loads(response.read())["data"][0]
    context_length = entry.get("max_model_len") or entry.get("context_length")
    return ModelSettings(name=entry["id"], backend="replica", endpoints=tuple(r.url for r in replicas),
                         context_length=context_length, owned_by="aigw")


def stop_replicas(replicas: list[ReplicaProcess], timeout_s: float = 10.0) -> None:
    for replica in replicas:
        if replica.process.poll() is None:
            replica.process.terminate()
    for replica in replicas:
        try:
            replica.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait()
