"""`aigw replica --model DIR` serves a gpt-oss checkpoint (MXFP4 experts) over HTTP: the completion
of a prompt longer than the sliding window is transformers' greedy continuation, logprobs within
2e-3."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from infra.ports import free_port
from tests.engine.models._gpt_oss import SLIDING_WINDOW, GptOssCheckpoint
from tests.engine.models._greedy import hf_greedy

PROMPT = [(7 * i + 3) % 300 for i in range(3 * SLIDING_WINDOW + 5)]
NUM_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def replica_url(gpt_oss_checkpoints: dict[str, GptOssCheckpoint]) -> Iterator[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIGW_")}
    command = [sys.executable, "-m", "cli.main", "replica", "--port", str(port), "--threads", "1",
               "--kv-cache-memory", str(32 << 20), "--no-auth",
               "--model", str(gpt_oss_checkpoints["mxfp4"].directory),
               "--exact"]  # float32: transformers' tokens (the default path quantizes at load)
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                stderr = process.stderr.read().decode()  # type: ignore[union-attr]
                raise AssertionError(f"aigw replica exited: {stderr[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "aigw replica did not become healthy"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_replica_completes_a_prompt_past_the_window_as_transformers_does(
        replica_url: str, gpt_oss_checkpoints: dict[str, GptOssCheckpoint]) -> None:
    checkpoint = gpt_oss_checkpoints["mxfp4"]
    tokens, logprobs = hf_greedy(checkpoint.model, PROMPT, NUM_NEW_TOKENS)
    body = {"model": checkpoint.directory.name, "prompt": PROMPT, "max_tokens": NUM_NEW_TOKENS,
            "temperature": 0, "logprobs": 0}
    response = httpx.post(replica_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint.directory / "tokenizer.json"))
    assert choice["text"] == tokenizer.decode(tokens, skip_special_tokens=False)
    served = choice["logprobs"]["token_logprobs"]
    assert len(served) == NUM_NEW_TOKENS
    assert max(abs(a - b) for a, b in zip(served, logprobs, strict=True)) < 2e-3
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), NUM_NEW_TOKENS)
