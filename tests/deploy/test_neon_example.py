"""neon.example.ts runs with Node against a live `aigw serve` and sees the prompt cache.

The test installs `openai` and `tsx` from npm into a temporary folder, starts one CPU replica of
the bundled model and a gateway with auth on (a fresh SQLite store: its first start creates the
`default` project and writes its key to data_dir/default-key.txt), and runs the example with
OPENAI_BASE_URL / OPENAI_API_KEY set the way a `neon.ts` with `aiGateway: true` sets them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from infra.ports import free_port
from tests.processes import stop_process

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "neon.example.ts"
KV_CACHE_BYTES = 64 << 20  # 91 blocks of 16 tokens for SmolLM2-135M: ample for the example

pytestmark = pytest.mark.slow


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("AIGW_", "OPENAI_"))}


@contextmanager
def _process(command: list[str], log_path: Path,
             env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        stop_process(process)


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: Path,
                  timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{url} exited early:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not healthy after {timeout_s:g}s:\n{log_path.read_text()[-3000:]}")


def _npm_install(prefix: Path) -> Path:
    """`npm install --prefix PREFIX openai tsx`; returns the tsx binary."""
    result = subprocess.run(
        ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error",
         "openai", "tsx"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"npm install failed:\n{result.stdout}\n{result.stderr}"
    tsx = prefix / "node_modules" / ".bin" / "tsx"
    assert tsx.exists(), "npm installed no tsx binary"
    return tsx


def test_neon_example_runs_against_a_live_gateway_and_reports_cached_tokens(tmp_path: Path) -> None:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("npm/node are not installed (Debian: apt-get install nodejs npm)")
    env = {**_clean_env(), "AIGW_REPLICA_SECRET": "neon-example-replica-secret"}  # both sides
    replica_port, gateway_port = free_port(), free_port()
    replica_url = f"http://127.0.0.1:{replica_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    data_dir = tmp_path / "data"
    config = tmp_path / "gateway.toml"
    replica_log, gateway_log = tmp_path / "replica.log", tmp_path / "gateway.log"

    replica_cmd = [sys.executable, "-m", "cli.main", "replica", "--host", "127.0.0.1",
                   "--port", str(replica_port), "--threads", "1",
                   "--kv-cache-memory", str(KV_CACHE_BYTES)]
    with _process(replica_cmd, replica_log, env) as replica:
        tsx = _npm_install(tmp_path / "npm")  # while the replica loads its weights
        _wait_healthy(replica_url, replica, replica_log)
        models = urllib.request.Request(replica_url + "/v1/models", headers={
            "Authorization": f"Bearer {env['AIGW_REPLICA_SECRET']}"})
        with urllib.request.urlopen(models, timeout=5) as response:
            model_id = json.loads(response.read())["data"][0]["id"]
        config.write_text(f'data_dir = "{data_dir}"\nhealth_interval_s = 1.0\n'
                          f'[[models]]\nname = "smollm2"\nupstream_model = "{model_id}"\n'
                          f'backend = "replica"\nendpoints = ["{replica_url}"]\n')
        gateway_cmd = [sys.executable, "-m", "cli.main", "serve", "--config", str(config),
                       "--host", "127.0.0.1", "--port", str(gateway_port)]
        with _process(gateway_cmd, gateway_log, env) as gateway:
            _wait_healthy(gateway_url, gateway, gateway_log)
            key = (data_dir / "default-key.txt").read_text().strip()
            # beside its node_modules: Node resolves `openai` from the script's own folder
            script = shutil.copy(EXAMPLE, tmp_path / "npm" / EXAMPLE.name)
            result = subprocess.run(
                [str(tsx), str(script)], cwd=tmp_path / "npm", capture_output=True, text=True,
                timeout=300, env={**env, "OPENAI_BASE_URL": gateway_url + "/v1",
                                  "OPENAI_API_KEY": key})

    output = result.stdout + result.stderr
    print(output)  # shown with `pytest -s`: what a user of the example sees
    assert result.returncode == 0, f"example failed:\n{output}\n{gateway_log.read_text()[-3000:]}"
    assert "model: smollm2" in result.stdout  # the first model the gateway lists
    assert re.search(r"stream usage: prompt=\d+ completion=\d+", result.stdout), output
    match = re.search(r"cached tokens \(turn 2\): (\d+)", result.stdout)
    assert match is not None, output
    assert int(match.group(1)) > 0, output
