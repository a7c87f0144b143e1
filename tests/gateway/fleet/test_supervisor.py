"""The embedded-replica supervisor restarts a process that exited, with a capped backoff, one log
line per restart and the counts in the restarts file /metrics reads; and the gateway's /health
turns 503 "unready" once a model has had no endpoint that can serve for `unready_after_s`.
Real child processes and a real gateway on a socket; the replica processes here are stand-ins
(a sleeping Python), the real `aigw serve` case is in test_embedded_restart.py."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.mock_upstream import MockConfig, MockState, create_mock_app
from gateway.fleet.embedded import ReplicaProcess
from gateway.fleet.supervisor import ReplicaSupervisor, RestartsCollector, SupervisorSettings
from tests.gateway.conftest import GatewayFactory, LoopThread, start_app, wait_until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
QUITTER = [sys.executable, "-c", "raise SystemExit(3)"]
FAST = SupervisorSettings(initial_backoff_s=0.05, max_backoff_s=0.2, reset_after_s=30.0,
                          poll_interval_s=0.01)


@pytest.fixture
def started() -> Iterator[list[ReplicaProcess]]:
    replicas: list[ReplicaProcess] = []
    yield replicas
    for replica in replicas:
        replica.process.kill()
        replica.process.wait()


def _start(command: list[str], replicas: list[ReplicaProcess]) -> ReplicaProcess:
    replica = ReplicaProcess(subprocess.Popen(command), "http://127.0.0.1:9", command,
                             dict(os.environ))
    replicas.append(replica)
    return replica


def test_a_killed_replica_is_restarted_once_logged_and_counted(
        started: list[ReplicaProcess], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    replica = _start(SLEEPER, started)
    restarts_file = tmp_path / "restarts.json"
    supervisor = ReplicaSupervisor([replica], FAST, restarts_file)
    assert json.loads(restarts_file.read_text()) == {replica.url: 0}
    first = replica.process
    caplog.set_level(logging.WARNING, "aigw.gateway.supervisor")
    supervisor.start()
    try:
        first.send_signal(signal.SIGKILL)
        assert wait_until(lambda: supervisor.num_restarts[replica.url] == 1, timeout_s=10)
        assert replica.process is not first and replica.process.poll() is None
        assert wait_until(lambda: json.loads(restarts_file.read_text()) == {replica.url: 1})
    finally:
        supervisor.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"embedded replica {replica.url} exited with -9; restart 1 in 0.05s"]
    (family,) = RestartsCollector(restarts_file).collect()
    assert [(s.labels, s.value) for s in family.samples if s.name.endswith("_total")] == [
        ({"endpoint": "127.0.0.1:9"}, 1.0)]


def test_restarts_in_a_row_back_off_doubling_up_to_the_cap(
        started: list[ReplicaProcess], caplog: pytest.LogCaptureFixture) -> None:
    replica = _start(QUITTER, started)
    supervisor = ReplicaSupervisor([replica], FAST)
    caplog.set_level(logging.WARNING, "aigw.gateway.supervisor")
    supervisor.start()
    try:
        assert wait_until(lambda: supervisor.num_restarts[replica.url] >= 5, timeout_s=20)
    finally:
        supervisor.stop()
    waits = [float(re.search(r"in ([0-9.]+)s$", r.getMessage())[1]) for r in caplog.records]
    assert waits[:6] == [0.05, 0.1, 0.2, 0.2, 0.2, 0.2][:len(waits[:6])]
    assert all("exited with 3" in r.getMessage() for r in caplog.records)


def test_a_stopped_supervisor_restarts_nothing(started: list[ReplicaProcess]) -> None:
    replica = _start(SLEEPER, started)
    supervisor = ReplicaSupervisor([replica], FAST)
    supervisor.start()
    supervisor.stop()
    replica.process.kill()
    replica.process.wait()
    first = replica.process
    assert not wait_until(lambda: replica.process is not first, timeout_s=0.3)


def test_no_restarts_file_means_no_samples() -> None:
    (family,) = RestartsCollector(None).collect()
    assert family.samples == []


def test_health_turns_unready_after_the_grace_and_ready_when_an_endpoint_is_back(
        make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(health_interval_s=0.05, unready_after_s=0.6)
    upstream = gateway.upstreams[0].state.config

    def status() -> tuple[int, str]:
        response = httpx.get(gateway.url + "/health")
        return response.status_code, response.json()["status"]

    assert status() == (200, "ok")
    upstream.health_status = 503
    assert wait_until(lambda: status() == (200, "degraded"), timeout_s=5)
    assert wait_until(lambda: status() == (503, "unready"), timeout_s=5)
    assert httpx.get(gateway.url + "/health/live").status_code == 200
    upstream.health_status = 200
    assert wait_until(lambda: status() == (200, "ok"), timeout_s=5)


def test_a_model_whose_fallback_serves_leaves_the_gateway_ready(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    """One dead model whose requests its fallback answers took the whole gateway out of
    rotation (503 unready) though none of its requests failed."""
    primary, backup = MockConfig(health_status=503), MockConfig()
    runners, urls = [], []
    for config in (primary, backup):
        runner, url = loop_thread.run(start_app(create_mock_app(MockState(config))))
        runners.append(runner)
        urls.append(url)
    try:
        gateway = make_gateway(health_interval_s=0.05, unready_after_s=0.3, models=[
            {"name": "dead", "backend": "replica", "endpoints": [urls[0]], "fallbacks": ["backup"]},
            {"name": "backup", "backend": "replica", "endpoints": [urls[1]]}])

        def status() -> tuple[int, str]:
            response = httpx.get(gateway.url + "/health")
            return response.status_code, response.json()["status"]

        assert wait_until(lambda: status() == (200, "degraded"), timeout_s=5)
        assert not wait_until(lambda: status()[0] == 503, timeout_s=1.0)  # past the grace
        backup.health_status = 503  # now neither the model nor its chain can serve
        assert wait_until(lambda: status() == (503, "unready"), timeout_s=5)
    finally:
        for runner in runners:
            loop_thread.run(runner.cleanup())
