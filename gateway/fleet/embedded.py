"""The embedded default: with no models configured, `aigw serve` starts N local engine replicas
(`aigw replica` subprocesses on free ports), waits for their /health, routes to them, restarts one
that dies (gateway/fleet/supervisor.py), and stops them on exit. This runs before the event loop
starts, so its blocking waits are fine here.

The replicas get the gateway's replica credential in their environment (AIGW_REPLICA_SECRET, not
on the command line, which every local user can read): `aigw serve` generates a random one at each
start unless one is configured (GatewaySettings.replica_secret / replica_secret_file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.settings import ModelSettings
from infra.ports import free_port

SECRET_ENV = "AIGW_REPLICA_SECRET"  # what engine/server/settings.py reads
SECRET_FILE_ENV = "AIGW_REPLICA_SECRET_FILE"


@dataclass
class ReplicaProcess:
    """One embedded replica: the process now serving `url`, and how to start it again."""

    process: subprocess.Popen[bytes]
    url: str
    command: list[str] = field(default_factory=list)  # empty: not restartable (started elsewhere)
    env: dict[str, str] = field(default_factory=dict)
    is_embedding: bool = False  # serves an embedding model (POST /v1/embeddings only)

    def restart(self) -> None:
        """A new process on the same port (the gateway's endpoint stays valid). The old one
        must have exited."""
        self.process = subprocess.Popen(self.command, env=self.env, start_new_session=True)


def start_replicas(num_replicas: int, model_path: str | None, kv_cache_memory_bytes: int | None,
                   host: str = "127.0.0.1", extra_args: list[str] | None = None,
                   secret: str | None = None, host_tier_bytes: int | None = None,
                   embedding_model_path: str | None = None) -> list[ReplicaProcess]:
    """Start `aigw replica` processes; without `model_path` each uses the engine's default model.
    `host_tier_bytes`: each replica's second KV tier (`--kv-host-tier-bytes`; None: the replica's
    default). `extra_args` go to every replica's command line as they are (`aigw serve
    --replica-args`). `secret`: the credential they require (None: `--no-auth`, every route open).
    `embedding_model_path`: one more replica, last, serving that embedding model (an encoder
    checkpoint: `aigw replica` serves it on its embedding path; the extra args go to it too)."""
    replicas = []
    env = replica_environ(os.environ, secret)
    for _ in range(num_replicas):
        port = free_port(host)
        command = [sys.executable, "-m", "cli.main", "replica", "--host", host, "--port", str(port)]
        if model_path is not None:
            command += ["--model", model_path]
        if kv_cache_memory_bytes is not None:
            command += ["--kv-cache-memory", str(kv_cache_memory_bytes)]
        if host_tier_bytes is not None:
            command += ["--kv-host-tier-bytes", str(host_tier_bytes)]
        if secret is None:
            command.append("--no-auth")
        command += extra_args or []
        # a session of its own: a terminal's Ctrl-C reaches `aigw serve` alone, which drains,
        # then stops the replicas (they would die first, and be restarted, otherwise)
        process = subprocess.Popen(command, env=env, start_new_session=True)
        replicas.append(ReplicaProcess(process, f"http://{host}:{port}", command, env))
    if embedding_model_path is not None:
        port = free_port(host)
        command = [sys.executable, "-m", "cli.main", "replica", "--host", host, "--port", str(port),
                   "--model", embedding_model_path, *(["--no-auth"] if secret is None else []),
                   *(extra_args or [])]
        process = subprocess.Popen(command, env=env, start_new_session=True)
        replicas.append(ReplicaProcess(process, f"http://{host}:{port}", command, env,
                                       is_embedding=True))
    return replicas


def replica_environ(environ: Mapping[str, str], secret: str | None = None) -> dict[str, str]:
    """The embedded replicas' environment: the gateway's, except that an `OTEL_SERVICE_NAME` set
    for the gateway names them `<that name>-replica`, so that their spans (exported by each replica
    itself, and shown by the dashboard) are not filed under the gateway's service; without
    `PROMETHEUS_MULTIPROC_DIR`, which is the gateway workers' (each replica serves its own
    /metrics; its counters in there would be summed into the gateway's); and with `secret` as
    their credential (any other AIGW_REPLICA_SECRET[_FILE] dropped)."""
    env = dict(environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.pop(SECRET_ENV, None)
    env.pop(SECRET_FILE_ENV, None)
    if secret is not None:
        env[SECRET_ENV] = secret
    if env.get("OTEL_SERVICE_NAME"):
        env["OTEL_SERVICE_NAME"] += "-replica"
    return env


def wait_healthy(replicas: list[ReplicaProcess], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            if replica.process.poll() is not None:
                raise RuntimeError(f"replica {replica.url} exited with "
                                   f"{replica.process.returncode}")
            try:
                with urllib.request.urlopen(replica.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        pending.remove(replica)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"replicas not healthy after {timeout_s:g}s: "
                               f"{[r.url for r in pending]}")
        if pending:
            time.sleep(0.25)


def model_settings_for(replicas: list[ReplicaProcess], secret: str | None = None) -> ModelSettings:
    """One model served by all replicas, named as the first replica's /v1/models says."""
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    request = urllib.request.Request(replicas[0].url + "/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=5) as response:
        entry = json.loads(response.read())["data"][0]
    context_length = entry.get("max_model_len") or entry.get("context_length")
    return ModelSettings(name=entry["id"], backend="replica",
                         endpoints=tuple(r.url for r in replicas),
                         context_length=context_length, owned_by="aigw")


def models_for(replicas: list[ReplicaProcess], secret: str | None = None
               ) -> tuple[ModelSettings, ...]:
    """The chat model all chat replicas serve, then the embedding model (if one was started)."""
    groups = ([r for r in replicas if not r.is_embedding], [r for r in replicas if r.is_embedding])
    return tuple(model_settings_for(group, secret) for group in groups if group)


def embedded_model(models: tuple[ModelSettings, ...]) -> ModelSettings | None:
    """The configured model `aigw serve`'s embedded replicas serve (`embedded = true`), if any."""
    return next((model for model in models if model.embedded), None)


def fill_embedded(configured: tuple[ModelSettings, ...], served: tuple[ModelSettings, ...]
                  ) -> tuple[ModelSettings, ...]:
    """The configured models with the embedded one's endpoints filled in from `served` (what
    `models_for` read from the started replicas: the chat model, then the embedding model);
    its `upstream_model` and `context_length`, when unset, become the replicas' own. The
    embedding model is appended unless a configured model has its name."""
    chat, *rest = served
    names = {model.name for model in configured}
    filled = tuple(
        model.model_copy(update={
            "endpoints": chat.endpoints,
            "upstream_model": model.upstream_model or chat.name,
            "context_length": model.context_length or chat.context_length})
        if model.embedded else model
        for model in configured)
    return filled + tuple(model for model in rest if model.name not in names)


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
