"""One real engine replica (a subprocess) and a gateway in front of it, shared by the tests of
tests/gateway/telemetry and tests/gateway/dashboard (session fixtures, registered in
tests/gateway/conftest.py).

The gateway runs with auth on (a two-key authenticator: an invoking project key and an admin
key) and the real embedded meter (SQLite under a temp dir), on a background event loop.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from auth.principal import AuthError, Principal, Scope
from gateway.fleet import embedded
from gateway.settings import GatewaySettings, Prices
from gateway.web.app import create_app
from gateway.web.services import metering_settings
from infra import ports
from tests.gateway.conftest import LoopThread, start_app
from tests.processes import stop_process

USER_KEY = "sk-test-acme"
ADMIN_KEY = "sk-test-admin"
PROJECT = "acme"
REPLICA_START_TIMEOUT_S = 120.0


class TwoKeyAuthenticator:
    """USER_KEY invokes as project `acme`; ADMIN_KEY is an operator (Scope.ADMIN)."""

    PRINCIPALS = {
        USER_KEY: Principal(project=PROJECT, key_id="key-acme",
                            scopes=frozenset({Scope.INVOKE.value})),
        ADMIN_KEY: Principal(project="ops", key_id="key-admin",
                             scopes=frozenset({Scope.ADMIN.value})),
    }

    async def authenticate(self, credential: str | None) -> Principal:
        principal = self.PRINCIPALS.get(credential or "")
        if principal is None:
            raise AuthError(401, "invalid_api_key", "unknown API key")
        return principal


@dataclass
class Served:
    url: str
    model: str
    replica_url: str


@pytest.fixture(scope="session")
def replica_url() -> Iterator[str]:
    port = ports.free_port()
    command = [sys.executable, "-m", "cli.main", "replica", "--port", str(port), "--threads", "1",
               "--kv-cache-memory", "67108864", "--no-auth"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + REPLICA_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the replica exited with {process.returncode} before /health")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the replica was not healthy within {REPLICA_START_TIMEOUT_S:g}s")
            time.sleep(0.25)
        yield url
    finally:
        stop_process(process, timeout_s=10)


@pytest.fixture(scope="session")
def observability_loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="session")
def served(replica_url: str, observability_loop: LoopThread,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from gateway.metering import open_meter

    model = embedded.model_settings_for([embedded.ReplicaProcess(None, replica_url)])  # type: ignore[arg-type]
    model = model.model_copy(update={"prices": Prices(input_per_token=2e-6,
                                                      cached_input_per_token=5e-7,
                                                      output_per_token=8e-6)})
    data_dir: Path = tmp_path_factory.mktemp("aigw-data")
    settings = GatewaySettings(auth_enabled=True, models=[model], data_dir=data_dir,
                               health_interval_s=0.5, first_token_timeout_s=60, idle_timeout_s=60)
    meter = observability_loop.run(open_meter(metering_settings(settings), data_dir=data_dir))
    app = create_app(settings, authenticator=TwoKeyAuthenticator(), meter=meter)
    runner, url = observability_loop.run(start_app(app))
    try:
        yield Served(url, model.name, replica_url)
    finally:
        observability_loop.run(runner.cleanup())
        observability_loop.run(meter.close())
