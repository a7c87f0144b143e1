"""Behaviour that holds for any engine honouring the ServedEngine contract (fake or real).

These tests use only the engine's public interface (tokenizer, stats, max_model_len), so they
also run with AIGW_TEST_SERVER_ENGINE pointing at the real engine.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import orjson

from tests.engine.server.fakes import FakeEngine
from tests.engine.server.test_chat import sse_events

USER = [{"role": "user", "content": "Count from one to ten."}]
WAIT_S = 30.0


def test_greedy_stream_matches_the_non_streamed_reply(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=USER, temperature=0,  # type: ignore[arg-type]
                                           max_completion_tokens=12)
    chunks = list(client.chat.completions.create(model=model, messages=USER, temperature=0,  # type: ignore[arg-type]
                                                 max_completion_tokens=12, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_usage_counts_the_templated_prompt_and_every_generated_token(
        client: openai.OpenAI, engine: Any, model: str) -> None:
    completion = client.chat.completions.create(model=model, messages=USER,  # type: ignore[arg-type]
                                                max_completion_tokens=5)
    usage = completion.usage
    assert usage is not None
    assert usage.prompt_tokens == len(engine.tokenizer.encode_chat(USER))
    assert 1 <= usage.completion_tokens <= 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if completion.choices[0].finish_reason == "length":
        assert usage.completion_tokens == 5


def test_n_choices_share_one_prompt_count(client: openai.OpenAI, engine: Any, model: str) -> None:
    completion = client.chat.completions.create(model=model, messages=USER, n=2, seed=1,  # type: ignore[arg-type]
                                                max_completion_tokens=4)
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(engine.tokenizer.encode_chat(USER))


def test_logprob_entries_match_the_completion_tokens(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.create(model=model, messages=USER, logprobs=True,  # type: ignore[arg-type]
                                                top_logprobs=2, max_completion_tokens=4)
    content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and completion.usage is not None
    assert len(content) == completion.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_completions_accept_token_ids(client: openai.OpenAI, engine: Any, model: str) -> None:
    ids = engine.tokenizer.encode("Once upon a time")
    completion = client.completions.create(model=model, prompt=ids, max_tokens=3)
    assert completion.usage is not None and completion.usage.prompt_tokens == len(ids)
    assert completion.choices[0].finish_reason in ("stop", "length")


def test_hanging_up_mid_stream_stops_generation(http: httpx.Client, engine: Any,
                                                model: str) -> None:
    if isinstance(engine, FakeEngine):
        engine.token_delay_s = 0.01  # real-engine pace, so the request outlives the hang-up
    max_tokens = engine.max_model_len // 2
    body = {"model": model, "messages": USER, "stream": True, "ignore_eos": True,
            "max_tokens": max_tokens}
    num_generated_before = engine.stats().num_generation_tokens_total
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        first = orjson.loads(next(events)[6:])
        assert first["choices"][0]["delta"]["role"] == "assistant"
    deadline = time.monotonic() + WAIT_S
    while engine.stats().num_running_requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats().num_running_requests == 0
    assert engine.stats().num_generation_tokens_total - num_generated_before < max_tokens


def test_stream_ends_with_usage_and_done(http: httpx.Client, model: str) -> None:
    body = {"model": model, "messages": USER, "stream": True, "max_tokens": 3,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    final = orjson.loads(events[-2])
    assert final["choices"] == [] and final["usage"]["completion_tokens"] <= 3
