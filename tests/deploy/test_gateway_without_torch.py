"""`pip install aigw` is the gateway without torch: in a venv holding only the core dependencies
(tests/deploy/torchless_venv.py), `aigw serve` with an `openai` upstream answers the openai SDK
with real keys and metering, and the commands that need the engine say how to install it."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bench.mock_upstream import MockState, create_mock_app
from infra.ports import free_port
from tests.deploy.torchless_venv import build_gateway_venv, core_requirements
from tests.gateway.conftest import MODEL, LoopThread, start_app
from tests.processes import stop_process

INSTALL_HINT = "pip install 'aigw[engine]'"


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gateway_venv(tmp_path_factory.mktemp("torchless"))


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    try:
        yield thread
    finally:
        thread.close()


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIGW_", "PYTHON", "VIRTUAL_ENV"))}
    return {**env, "HOME": str(tmp_path), "AIGW_DATA_DIR": str(tmp_path / "data")}


def test_the_core_dependencies_name_no_engine_package() -> None:
    names = {req.name.lower() for req in core_requirements()}
    assert not names & {"torch", "triton", "ninja", "llguidance", "safetensors", "gguf"}


def test_the_venv_has_no_torch(venv: Path, tmp_path: Path) -> None:
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"],
                           env=_env(tmp_path), capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr


def test_aigw_serve_answers_the_openai_sdk_through_an_openai_upstream_without_torch(
        venv: Path, tmp_path: Path, loop_thread: LoopThread) -> None:
    state = MockState()
    runner, upstream_url = loop_thread.run(start_app(create_mock_app(state)))
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\nhealth_interval_s = 1.0\n'
                      f'[[models]]\nname = "{MODEL}"\nbackend = "openai"\n'
                      f'endpoints = ["{upstream_url}"]\n')
    process = subprocess.Popen([str(venv / "bin" / "aigw"), "serve", "--config", str(config),
                                "--port", str(port)], env=_env(tmp_path), cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        key_file = tmp_path / "data" / "default-key.txt"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert process.poll() is None, process.stdout.read().decode()  # type: ignore[union-attr]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200 and key_file.exists():
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key=key_file.read_text().strip(),
                               max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].message.content and reply.usage is not None
        assert reply.usage.completion_tokens == 4
        assert len(state.bodies) == 1  # the upstream served it
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0
                          ).chat.completions.create(model=MODEL, max_tokens=4,
                                                    messages=[{"role": "user", "content": "hi"}])
        metrics = httpx.get(url + "/metrics").text
        assert 'status="200"' in metrics and 'status="401"' in metrics
    finally:
        stop_process(process)
        loop_thread.run(runner.cleanup())


@pytest.mark.parametrize("argv", [["replica", "--no-auth"], ["generate", "hi"],
                                  ["serve", "--no-auth"]],
                         ids=["replica", "generate", "serve_with_embedded_replicas"])
def test_a_command_that_needs_the_engine_is_one_line_naming_the_engine_extra(
        venv: Path, tmp_path: Path, argv: list[str]) -> None:
    if argv[0] == "serve":
        argv = [*argv, "--port", str(free_port())]
    result = subprocess.run([str(venv / "bin" / "aigw"), *argv], env=_env(tmp_path), cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and INSTALL_HINT in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
