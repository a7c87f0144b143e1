"""`aigw replica` as a real subprocess on 127.0.0.1, driven over a real socket with the official
openai SDK (streaming and not, tools, token-id prompts), plus the ops endpoints (/metrics,
/kv/events, /kv/snapshot)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from contracts.kv_events import apply_events, batch_from_json

BLOCK_SIZE = 16
KV_CACHE_BYTES = 64 << 20  # 91 blocks of 16 tokens: the context window is bounded to 1,456 tokens
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def replica_url() -> Iterator[str]:
    port = _free_port()
    repo_root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items()
           if k not in ("AIGW_REPLICA_SECRET", "AIGW_REDIS_URL")}
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "replica", "--port", str(port), "--threads", "1",
             "--kv-cache-memory", str(KV_CACHE_BYTES), "--no-auth", "--exact"],  # float32 answers
            cwd=repo_root, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    pytest.fail("replica exited with "
                                f"{process.returncode}:\n{log.read().decode()[-3000:]}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail("replica did not become healthy within 120 s")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


@pytest.fixture(scope="module")
def client(replica_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=replica_url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def metric(replica_url: str, name: str) -> float:
    for line in httpx.get(replica_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_models_and_metrics_say_how_the_replica_computes(replica_url: str) -> None:
    """--exact: float32 weights; on the CPU the kernel variant chosen at start-up, in both
    places."""
    from engine.kernels.cpu import isa

    meta = httpx.get(replica_url + "/v1/models", timeout=10).json()["data"][0]["metadata"]
    assert (meta["decode_weights"], meta["weights"]) == ("float", "float32")
    assert meta["cpu_isa"] in (*isa.VARIANTS, None) and meta["cpu_isa_forced"] is False
    lines = httpx.get(replica_url + "/metrics", timeout=10).text.splitlines()
    isa_line = next(line for line in lines if line.startswith("aigw_replica_cpu_isa{"))
    assert f'isa="{meta["cpu_isa"] or "none"}"' in isa_line and isa_line.endswith(" 1.0")
    assert any(line.startswith("aigw_replica_decode_weights{") and 'mode="float"' in line
               for line in lines)


def test_chat_completion_non_streaming_reports_usage(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage is not None and usage.prompt_tokens > 10 and 0 < usage.completion_tokens <= 16
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streaming_repeated_prompt_reports_exact_cached_tokens(client: openai.OpenAI,
                                                               model: str) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant who loves trains. " * 6},
                {"role": "user", "content": "Name a famous railway."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                           temperature=0)
    assert first.usage is not None
    prompt_tokens = first.usage.prompt_tokens
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    assert ([c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            == [first.choices[0].finish_reason])
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.prompt_tokens == prompt_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE and cached > 0


def test_tools_reach_the_prompt_and_the_request_succeeds(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=32,
                                           temperature=0)
    with_tools = client.chat.completions.create(model=model, messages=messages,
                                                tools=[WEATHER_TOOL], max_tokens=48, temperature=0)
    assert plain.usage is not None and with_tools.usage is not None
    # the schema is in the prompt
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    choice = with_tools.choices[0]
    if choice.message.tool_calls:  # the 135M model may or may not call the tool
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments), dict)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


def test_streaming_with_tools_ends_with_a_finish_reason(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Oslo, please."}],
        tools=[WEATHER_TOOL], max_tokens=48, temperature=0, stream=True)
    reasons = [c.choices[0].finish_reason for c in stream
               if c.choices and c.choices[0].finish_reason]
    assert len(reasons) == 1 and reasons[0] in ("stop", "length", "tool_calls")


def test_completion_accepts_a_token_id_prompt(client: openai.OpenAI, model: str) -> None:
    prompt_ids = [1, 504, 3575, 282, 4649, 314]  # "<|im_start|>The capital of France is"
    response = client.completions.create(model=model, prompt=prompt_ids, max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert response.usage is not None and response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 8
    assert response.choices[0].finish_reason == "length" and response.choices[0].text


def test_n_seeded_choices_are_reproducible_after_a_cache_reset(replica_url: str,
                                                               client: openai.OpenAI,
                                                               model: str) -> None:
    """Same seed, same computation: same samples. (The prefix cache is reset between the runs,
    because a cache hit changes how the prompt's tail is computed, which is only equal up to float
    rounding.)"""
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Say something about owls."}],
                  max_tokens=12, temperature=1.0, seed=5, n=2)
    assert httpx.post(replica_url + "/kv/reset", timeout=10).json() == {"reset": True}
    first = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert httpx.post(replica_url + "/kv/reset", timeout=10).json() == {"reset": True}
    again = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert len(first.choices) == 2 and [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    # seed + choice index
    assert first.choices[0].message.content != first.choices[1].message.content


def test_a_seed_beyond_64_bits_is_a_400_and_one_at_the_edge_seeds_every_choice(
        client: openai.OpenAI, model: str) -> None:
    """torch seeds at most 2**64 - 1: seed 2**64 - 1 with n=2 gave choice 1 the seed 2**64,
    which failed in the engine thread (a 500); the seed is a signed 64-bit integer (OpenAI's
    int64), and seed + choice wraps within that range."""
    messages = [{"role": "user", "content": "Hi."}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                       max_tokens=2, temperature=1.0, seed=2**64 - 1, n=2)
    assert refused.value.body["param"] == "seed"  # type: ignore[index]
    edge = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                          max_tokens=2, temperature=1.0, seed=2**63 - 1, n=2)
    assert [c.index for c in edge.choices] == [0, 1]


def test_client_disconnect_mid_stream_frees_its_blocks(replica_url: str, model: str) -> None:
    body = {"model": model,
            "messages": [{"role": "user", "content": "Write a very long story about a fox."}],
            "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", replica_url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            num_data = 0
            for line in lines:
                num_data += line.startswith("data: ")
                if num_data >= 5:
                    break
            assert metric(replica_url, "aigw_replica_kv_blocks_used") > 0
    for _ in range(100):  # bounded: up to ~10 s
        if metric(replica_url, "aigw_replica_kv_blocks_used") == 0:
            break
        time.sleep(0.1)
    assert metric(replica_url, "aigw_replica_kv_blocks_used") == 0
    assert metric(replica_url, "aigw_replica_num_requests_running") == 0


def test_prompt_over_the_context_window_is_a_400_context_length_exceeded(client: openai.OpenAI,
                                                                         model: str) -> None:
    too_long = [504] * 9000  # over both the model's 8,192-token window and the KV bound
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=too_long, max_tokens=4)
    assert info.value.status_code == 400
    assert info.value.code == "context_length_exceeded"


def test_kv_events_over_http_replay_to_the_snapshot(replica_url: str, client: openai.OpenAI,
                                                    model: str) -> None:
    client.chat.completions.create(model=model,
                                   messages=[{"role": "user", "content": "Count to five."}],
                                   max_tokens=8, temperature=0)
    page = httpx.get(replica_url + "/kv/events", params={"since": 0}, timeout=10).json()
    snapshot = httpx.get(replica_url + "/kv/snapshot", timeout=10).json()
    assert not page.get("snapshot_required")
    batches = [batch_from_json(b) for b in page["batches"]]
    assert [b.seq for b in batches] == list(range(1, page["last_seq"] + 1))
    assert snapshot["seq"] == page["last_seq"]  # the replica is idle: nothing happened in between
    held: set[int] = set()
    for batch in batches:
        apply_events(held, batch.events)
    assert held == set(snapshot["block_hashes"]) and held


def test_structured_output_parses_into_the_sdks_pydantic_model(client: openai.OpenAI,
                                                               model: str) -> None:
    import pydantic

    class City(pydantic.BaseModel):
        name: str
        country: str
        # bounded: the 135M model loops digits
        population: int = pydantic.Field(ge=0, le=99_999_999)

    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City, max_tokens=60, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City), choice.message.content

    colors = {"type": "object", "properties": {"colors": {
        "type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
        "maxItems": 2}},
        "required": ["colors"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Two colors as JSON."}], max_tokens=60,
        temperature=0.8, seed=5, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "colors", "schema": colors}})
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert set(json.loads(text)["colors"]) <= {"red", "green", "blue"}, text


@pytest.mark.parametrize("stream", [False, True])
def test_a_demanded_tool_call_is_always_made_in_the_tools_schema(client: openai.OpenAI, model: str,
                                                                 stream: bool) -> None:
    clock = {"type": "function", "function": {
        "name": "get_time", "description": "The time in a timezone", "parameters": {
            "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
            "additionalProperties": False}}}
    asks = [({"type": "function", "function": {"name": "get_time"}}, None, {"get_time"}),
            ("required", False, {"get_time", "get_weather"})]
    for tool_choice, parallel, names in asks:
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Tell me a joke."}], max_tokens=60,
            tools=[WEATHER_TOOL, clock], tool_choice=tool_choice, temperature=0, stream=stream,
            **extra)
        if stream:
            chunks = [c for c in answer if c.choices]
            calls = [call.function for c in chunks for call in c.choices[0].delta.tool_calls or ()]
            finish_reason = chunks[-1].choices[0].finish_reason
        else:
            calls = [call.function for call in answer.choices[0].message.tool_calls or ()]
            finish_reason = answer.choices[0].finish_reason
        assert finish_reason == "tool_calls" and len(calls) == 1, (tool_choice, calls)
        assert calls[0].name in names
        arguments = json.loads(calls[0].arguments)
        if calls[0].name == "get_time":
            assert arguments == {"tz": arguments["tz"]} and arguments["tz"] in ("UTC", "CET")
        else:
            assert isinstance(arguments, dict)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_under_a_schema_without_additional_properties_ends_closed(
        client: openai.OpenAI, model: str, stream: bool) -> None:
    """LangChain sends a tool's schema without `additionalProperties`; the forced call's grammar
    closes the object (as OpenAI's strict mode reads it), so the call ends after its keys. Left
    open, SmolLM2 answers this one {"location": "USA", "unit": "c", "unit_map": "USA"}."""
    langchain_tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "properties": {"location": {"type": "string"},
                       "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["location"], "type": "object"}}}
    max_tokens = 120
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a joke."}],
        max_tokens=max_tokens, tools=[langchain_tool], temperature=0, stream=stream,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **({"stream_options": {"include_usage": True}} if stream else {}))
    if stream:
        chunks = list(answer)
        calls = [call.function for c in chunks if c.choices
                 for call in c.choices[0].delta.tool_calls or ()]
        finish_reason = [c for c in chunks if c.choices][-1].choices[0].finish_reason
        usage = chunks[-1].usage
    else:
        calls = [call.function for call in answer.choices[0].message.tool_calls or ()]
        finish_reason, usage = answer.choices[0].finish_reason, answer.usage
    assert finish_reason == "tool_calls" and len(calls) == 1, (finish_reason, calls)
    arguments = json.loads(calls[0].arguments)
    assert "location" in arguments and set(arguments) <= {"location", "unit"}, arguments
    assert usage is not None and usage.completion_tokens < max_tokens
