"""A real `aigw serve` whose embedded replica (requiring the secret serve generated for it) is
SIGKILLed: /health goes 503 "unready" once the grace has passed, the supervisor starts the
replica again on its port (one log line, one count on /metrics), and the gateway serves again.
A tiny random Llama with the default model's tokenizer, one thread: the replica loads in
seconds, where the default model took ~65 s a load on the loaded 2-core VM (and this test loads
it twice)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from infra.ports import free_port
from tests.processes import child_processes, stop_process
from tests.tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow

GRACE_S = 1.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _replica_pids(parent: int) -> list[int]:
    """The `aigw replica` children of process `parent`."""
    return [pid for pid, argv in child_processes(parent) if "replica" in argv]


def _status(url: str) -> tuple[int, str] | None:
    try:
        response = httpx.get(url + "/health", timeout=2)
    except httpx.HTTPError:
        return None
    return response.status_code, response.json()["status"]


def _wait_for(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s:g}s: {what}")


def _chat(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 4,
        "messages": [{"role": "user", "content": "Name a color."}]})


def test_a_killed_embedded_replica_makes_health_unready_then_comes_back_and_serves(
        tmp_path: Path, tiny_model: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIGW_")}
    env.update(AIGW_UNREADY_AFTER_S=str(GRACE_S), AIGW_HEALTH_INTERVAL_S="0.3")
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "serve", "--no-auth", "--port", str(port),
             "--model", str(tiny_model), "--kv-cache-memory", str(32 << 20),
             "--embedding-model", "none", "--replica-args", "--threads 1"],
            env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: process.poll() is None and _status(url) == (200, "ok"), 120,
                  "aigw serve healthy")
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        assert _chat(url, model).status_code == 200
        (first,) = _replica_pids(process.pid)
        argv = Path(f"/proc/{first}/cmdline").read_bytes().decode().split("\0")
        assert "--no-auth" not in argv  # serve made it a secret, passed in its environment
        replica_url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        assert httpx.get(replica_url + "/kv/events?since=0").status_code == 401
        assert httpx.get(replica_url + "/health").status_code == 200
        os.kill(first, signal.SIGKILL)
        killed_at = time.monotonic()
        _wait_for(lambda: _status(url) == (503, "unready"), 30, "/health 503 unready")
        assert time.monotonic() - killed_at >= GRACE_S  # not before the grace
        _wait_for(lambda: _status(url) == (200, "ok"), 120, "/health back to ok")
        (second,) = _replica_pids(process.pid)
        assert second != first
        reply = _chat(url, model)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        metrics = httpx.get(url + "/metrics").text
        assert re.search(r'^aigw_embedded_replica_restarts_total\{endpoint="127\.0\.0\.1:\d+"\} '
                         r'1\.0$',
                         metrics, re.MULTILINE), metrics[-2000:]
    finally:
        stop_process(process)
    lines = [line for line in log_path.read_text().splitlines() if "embedded replica" in line]
    assert len(lines) == 1 and "exited with -9; restart 1 in 1s" in lines[0], lines
    assert _replica_pids(process.pid) == []  # stopped with the gateway


def test_sigterm_while_the_replicas_load_stops_them_too(tmp_path: Path, tiny_model: Path) -> None:
    """The replicas run in sessions of their own (a terminal's Ctrl-C reaches the gateway, which
    drains first): `aigw serve` must stop them itself, also when told to before it serves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIGW_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--no-auth", "--port", str(free_port()),
         "--model", str(tiny_model), "--kv-cache-memory", str(32 << 20),
         "--embedding-model", "none", "--replica-args", "--threads 1"],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: _replica_pids(process.pid), 60, "an embedded replica started")
        (replica,) = _replica_pids(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 128 + signal.SIGTERM
        _wait_for(lambda: not Path(f"/proc/{replica}").exists()
                  or "\nState:\tZ" in Path(f"/proc/{replica}/status").read_text(), 15,
                  "the replica stopped")
    finally:
        stop_process(process)
