"""`aigw replica --model DIR` serves a tiny Qwen3-MoE checkpoint over HTTP; through the openai SDK
its greedy completions are transformers' tokens with transformers' logprobs (2e-3), for a token-id
prompt and for a chat, and a repeated chat reports its prompt-cache hit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from engine.loader import load_tokenizer
from infra.ports import free_port
from tests.engine.models._greedy import hf_greedy
from tests.engine.models._qwen3 import TinyCheckpoint
from tests.processes import stop_process

SECRET = "qwen3-replica-test"
NUM_NEW_TOKENS = 8
PROMPT_IDS = [5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 200]


pytestmark = pytest.mark.slow  # a replica process: ~25 s to start on the 2-core CI machine


@pytest.fixture(scope="module")
def checkpoint(qwen3_checkpoints: dict[str, TinyCheckpoint]) -> TinyCheckpoint:
    return qwen3_checkpoints["qwen3_moe"]


@pytest.fixture(scope="module")
def client(checkpoint: TinyCheckpoint) -> Iterator[openai.OpenAI]:
    port = free_port()
    env = {**os.environ, "AIGW_REPLICA_SECRET": SECRET}
    process = subprocess.Popen(
        [sys.executable, "-m", "cli", "replica", "--model", str(checkpoint.directory), "--port",
         str(port), "--threads", "1", "--kv-cache-memory", str(8 << 20), "--max-num-batched-tokens",
         "32", "--max-num-seqs", "8",
         # float32: the replica's answers are transformers' (the default quantizes at load)
         "--exact"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(process, url)
        yield openai.OpenAI(base_url=url + "/v1", api_key=SECRET, max_retries=0, timeout=60)
    finally:
        stop_process(process)
        if process.stderr is not None:
            process.stderr.close()


def _wait_healthy(process: subprocess.Popen[bytes], url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = process.stderr.read().decode() if process.stderr else ""
            raise AssertionError(f"replica exited with {process.returncode}: {err[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.25)
    raise AssertionError(f"replica not healthy after {timeout_s} s")


def _assert_logprobs_close(ours: list[float], theirs: list[float]) -> None:
    assert len(ours) == len(theirs)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 2e-3


def test_completion_of_token_ids_is_transformers_greedy_continuation(
        client: openai.OpenAI, checkpoint: TinyCheckpoint) -> None:
    model = client.models.list().data[0].id
    tokens, logprobs = hf_greedy(checkpoint.model, PROMPT_IDS, NUM_NEW_TOKENS)
    completion = client.completions.create(model=model, prompt=PROMPT_IDS,
                                           max_tokens=NUM_NEW_TOKENS,
                                           temperature=0, logprobs=1,
                                           extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert choice.text == load_tokenizer(checkpoint.directory).decode(tokens)
    _assert_logprobs_close(choice.logprobs.token_logprobs, logprobs)
    assert completion.usage.prompt_tokens == len(PROMPT_IDS)
    assert completion.usage.completion_tokens == NUM_NEW_TOKENS


def test_chat_is_transformers_greedy_answer_and_a_repeat_hits_the_prompt_cache(
        client: openai.OpenAI, checkpoint: TinyCheckpoint) -> None:
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Tell me one fact about the moon and the sea, then one "
                                            "about bread, jazz and chess."}]
    tokenizer = load_tokenizer(checkpoint.directory)
    prompt = tokenizer.encode_chat(messages)
    tokens, logprobs = hf_greedy(checkpoint.model, prompt, NUM_NEW_TOKENS)
    for attempt in range(2):
        chat = client.chat.completions.create(model=model, messages=messages,
                                              max_tokens=NUM_NEW_TOKENS,
                                              temperature=0, logprobs=True,
                                              extra_body={"ignore_eos": True})
        assert chat.usage.prompt_tokens == len(prompt)
        assert chat.choices[0].message.content == tokenizer.decode(tokens)
        _assert_logprobs_close([entry.logprob for entry in chat.choices[0].logprobs.content],
                               logprobs)
        cached = chat.usage.prompt_tokens_details.cached_tokens
        assert (cached >= 16) if attempt else (cached == 0)
