"""The Batch API end to end on a real replica of the default model, with `aigw serve` as a real
subprocess (auth on, the embedded SQLite stores): the openai SDK's flow for chat and completions
lines, a batch of agent-like lines sharing a system prompt and its prompt-cache hit ratio, and a
gateway SIGKILLed mid-batch that resumes: no recorded line runs again and the ledger holds each
line once."""

from __future__ import annotations

import io
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.fleet import embedded
from infra.ports import free_port
from tests.gateway.batch.test_batch_api import jsonl, read_jsonl, wait_done
from tests.processes import stop_process

pytestmark = pytest.mark.slow

# an agent's system prompt (~300 tokens), shared by every line of the agent-like batch
AGENT_SYSTEM = ("You are a coding agent working in a large Python repository. " + " ".join(
    f"Rule {i}: read the file before you edit it, keep each change small, run the tests that "
    f"cover what you touched, and explain what you changed in one sentence." for i in range(12)))


class ServeProcess:
    """`aigw serve` on one port and data_dir, started and killed at will."""

    def __init__(self, data_dir: Path, model: dict[str, Any]) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = data_dir / "gateway.toml"
        endpoints = ", ".join(f'"{e}"' for e in model["endpoints"])
        config.write_text(
            f'data_dir = "{data_dir}"\nhealth_interval_s = 0.5\nfirst_token_timeout_s = 120\n'
            f'response_timeout_s = 300\n[batch]\npoll_interval_s = 0.2\nmax_concurrent_lines = 2\n'
            f'[[models]]\nname = "{model["name"]}"\nbackend = "replica"\nendpoints = '
            f'[{endpoints}]\n'
            f'prices = {{ input_per_token = 1e-6, cached_input_per_token = 1e-7, '
            f'output_per_token = 2e-6 }}\n')
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIGW_")}
        log = open(self.data_dir / "serve.log", "ab")  # noqa: SIM115 - the child holds it
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "serve", "--config", str(self.config), "--port",
             str(self.port)], env=env, cwd=self.data_dir, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.data_dir / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("aigw serve did not become healthy")

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)

    def client(self) -> openai.OpenAI:
        key = (self.data_dir / "default-key.txt").read_text().strip()
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=2, timeout=120)


@pytest.fixture(scope="module")
def replica_model() -> Iterator[dict[str, Any]]:
    replicas = embedded.start_replicas(1, None, 32 * 1024 * 1024)
    try:
        embedded.wait_healthy(replicas, timeout_s=240)
        yield embedded.model_settings_for(replicas).model_dump()
    finally:
        embedded.stop_replicas(replicas)


@pytest.fixture(scope="module")
def serve(replica_model: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[ServeProcess]:
    process = ServeProcess(tmp_path_factory.mktemp("batch-serve"), replica_model)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def ledger(data_dir: Path, batch_id: str) -> list[str]:
    with sqlite3.connect(data_dir / "aigw.sqlite3") as conn:
        return [row[0] for row in conn.execute(
            "SELECT request_id FROM usage WHERE request_id LIKE ? ORDER BY request_id",
            (batch_id + "/%",))]


def submit(client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str) -> str:
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,  # type: ignore[arg-type]
                                 completion_window="24h").id


def test_the_sdk_batch_flow_on_the_default_model(serve: ServeProcess,
                                                 replica_model: dict[str, Any]) -> None:
    client, model = serve.client(), replica_model["name"]
    chat = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "max_tokens": 6, "temperature": 0,
                      "messages": [{"role": "user", "content": f"Name the color number {i}."}]}}
            for i in range(2)]
    completions = [{"custom_id": f"text-{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model, "max_tokens": 6, "temperature": 0,
                             "prompt": f"The {i}th planet from the sun is"}} for i in range(1)]
    chat_id = submit(client, chat, "/v1/chat/completions")
    text_id = submit(client, completions, "/v1/completions")
    done, text_done = wait_done(client, chat_id, 300), wait_done(client, text_id, 300)
    assert done.status == text_done.status == "completed"
    by_id = {o["custom_id"]: o["response"]["body"] for o in read_jsonl(client, done.output_file_id)}
    assert sorted(by_id) == ["chat-0", "chat-1"]
    assert all(body["usage"]["completion_tokens"] >= 1 for body in by_id.values())
    reference = client.chat.completions.create(**chat[1]["body"])  # the same, interactively
    assert (by_id["chat-1"]["choices"][0]["message"]["content"]
            == reference.choices[0].message.content)
    texts = {o["custom_id"]: o["response"]["body"]
             for o in read_jsonl(client, text_done.output_file_id)}
    assert sorted(texts) == ["text-0"]
    assert all(t["object"] == "text_completion" and t["choices"][0]["text"] for t in texts.values())
    assert ledger(serve.data_dir, chat_id) == [f"{chat_id}/{i}" for i in range(2)]


def test_agent_like_lines_share_the_prompt_cache(serve: ServeProcess,
                                                 replica_model: dict[str, Any]) -> None:
    """Five lines with one long system prompt, interleaved in the file with lines of another:
    the plan runs each group together, so all but a group's first few lines find the system
    prompt cached."""
    client, model = serve.client(), replica_model["name"]
    other_system = "You translate English into French. " * 20
    lines = []
    for i in range(5):
        for name, system in (("agent", AGENT_SYSTEM), ("translate", other_system)):
            lines.append({"custom_id": f"{name}-{i}", "method": "POST",
                          "url": "/v1/chat/completions",
                          "body": {"model": model, "max_tokens": 1, "temperature": 0,
                                   "messages": [{"role": "system", "content": system},
                                                {"role": "user", "content": f"Task {i}: go."}]}})
    done = wait_done(client, submit(client, lines, "/v1/chat/completions"), 600)
    assert done.status == "completed" and done.request_counts.completed == 10
    usage = [o["response"]["body"]["usage"] for o in read_jsonl(client, done.output_file_id)
             if o["custom_id"].startswith("agent-")]
    num_prompt = sum(u["prompt_tokens"] for u in usage)
    num_cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    ratio = num_cached / num_prompt
    print(f"agent-like batch: {num_cached}/{num_prompt} prompt tokens cached ({ratio:.0%})")
    assert sum(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in usage) >= 3
    assert ratio > 0.6
    assert done.usage.input_tokens_details.cached_tokens >= num_cached


def _recorded(data_dir: Path, batch_id: str) -> dict[int, bytes]:
    with sqlite3.connect(data_dir / "batch.sqlite3") as conn:
        return {row[0]: bytes(row[1]) for row in conn.execute(
            "SELECT idx, output FROM lines WHERE batch_id = ?", (batch_id,))}


def test_a_gateway_killed_mid_batch_resumes_and_meters_each_line_once(
        serve: ServeProcess, replica_model: dict[str, Any]) -> None:
    client, model = serve.client(), replica_model["name"]
    num_lines = 6
    lines = [{"custom_id": f"k-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "max_tokens": 8,
                       "messages": [{"role": "user", "content": f"Write a line about {i}."}]}}
             for i in range(num_lines)]
    batch_id = submit(client, lines, "/v1/chat/completions")
    deadline = time.monotonic() + 300
    while len(_recorded(serve.data_dir, batch_id)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    serve.kill()
    before = _recorded(serve.data_dir, batch_id)
    assert 2 <= len(before) < num_lines, len(before)
    serve.start()
    done = wait_done(serve.client(), batch_id, 600)
    assert done.status == "completed" and done.request_counts.completed == num_lines
    outputs = {o["custom_id"]: orjson.dumps(o) + b"\n"
               for o in read_jsonl(serve.client(), done.output_file_id)}
    assert sorted(outputs) == sorted(f"k-{i}" for i in range(num_lines))
    for index, output in before.items():  # recorded before the kill: kept, not run again
        assert orjson.loads(outputs[f"k-{index}"]) == orjson.loads(output)
    assert ledger(serve.data_dir, batch_id) == sorted(f"{batch_id}/{i}" for i in range(num_lines))
