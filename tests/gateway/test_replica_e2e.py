"""End to end on real engine replicas (the default model): the SDKs through the gateway, and
failover when one of two replicas is killed mid-run."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.fleet import embedded
from gateway.settings import GatewaySettings
from gateway.web.app import create_app
from tests.gateway.conftest import LoopThread, start_app, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_replicas() -> Iterator[list[embedded.ReplicaProcess]]:
    replicas = embedded.start_replicas(2, None, 64 * 1024 * 1024)
    try:
        embedded.wait_healthy(replicas, timeout_s=180)
        yield replicas
    finally:
        embedded.stop_replicas(replicas)


@pytest.fixture(scope="module")
def served(two_replicas: list[embedded.ReplicaProcess],
           loop_thread: LoopThread) -> Iterator[tuple[str, str]]:
    model = embedded.model_settings_for(two_replicas)
    settings = GatewaySettings(auth_enabled=False, models=[model], health_interval_s=0.5,
                               first_token_timeout_s=60, idle_timeout_s=30)
    runner, url = loop_thread.run(start_app(create_app(settings)))
    yield url, model.name
    loop_thread.run(runner.cleanup())


def test_openai_sdk_chat_stream_tools_and_responses(served: tuple[str, str]) -> None:
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=model, max_tokens=8,
                                          messages=[{"role": "user", "content": "Say hi"}])
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8
    chunks = list(client.chat.completions.create(model=model, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "Count"}]))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = client.chat.completions.create(model=model, max_tokens=32, tools=tools,
                                                messages=[{"role": "user",
                                                           "content": "Weather in Paris?"}])
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")
    response = client.responses.create(model=model, input="Say hi", max_output_tokens=8)
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens >= 1


def test_anthropic_sdk_messages_and_stream(served: tuple[str, str]) -> None:
    url, model = served
    client = anthropic.Anthropic(base_url=url + "/anthropic", api_key="x", max_retries=0,
                                 timeout=120)
    message = client.messages.create(model=model, max_tokens=8, system="Be brief.",
                                     messages=[{"role": "user", "content": "Say hi"}])
    assert message.content and message.usage.output_tokens >= 1
    with client.messages.stream(model=model, max_tokens=8,
                                messages=[{"role": "user", "content": "Say hi"}]) as stream:
        events = list(stream)
    final = stream.get_final_message()
    assert final.content and final.usage.output_tokens >= 1
    # message_start already carries the input tokens (clients such as LangChain read them there)
    started = events[0].message.usage
    assert events[0].type == "message_start" and started.input_tokens > 0
    assert (started.input_tokens, started.cache_read_input_tokens) == (
        final.usage.input_tokens, final.usage.cache_read_input_tokens)


def test_openai_sdk_n_choices_pass_through_to_the_replica(served: tuple[str, str]) -> None:
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model=model, max_tokens=6, n=3, temperature=1.0, seed=7,
                                           messages=messages)  # type: ignore[arg-type]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in whole.choices)
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(model=model, max_tokens=6, n=2, temperature=1.0,
                                                messages=messages, stream=True,  # type: ignore[arg-type]
                                                stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert sorted(texts) == sorted(finished) == [0, 1] and all(texts.values())
    assert usage is not None and 2 <= usage.completion_tokens <= 12  # both choices counted
    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4,
                                           n=2)
    assert ([c.index for c in completion.choices] == [0, 1]
            and completion.usage.completion_tokens > 4)


def test_logprobs_come_back_through_the_gateway_in_each_dialects_form(
        served: tuple[str, str]) -> None:
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(model=model, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=2, messages=messages)  # type: ignore[arg-type]
    entries = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(entries) == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(e.token for e in entries) == whole.choices[0].message.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
    assert entries[0].top_logprobs[0].logprob >= entries[0].top_logprobs[1].logprob
    streamed = []
    for chunk in client.chat.completions.create(model=model, max_tokens=6, temperature=0,
                                                logprobs=True, messages=messages,  # type: ignore[arg-type]
                                                stream=True):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                streamed += [(e.token, round(e.logprob, 4)) for e in choice.logprobs.content]
    assert streamed == [(e.token, round(e.logprob, 4)) for e in entries]  # greedy: the same tokens
    legacy = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                       temperature=0, logprobs=1)
    tokens = legacy.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert (len(tokens) == legacy.usage.completion_tokens  # type: ignore[union-attr]
            and "".join(tokens) == legacy.choices[0].text)
    assert len(legacy.choices[0].logprobs.top_logprobs[0]) == 1  # type: ignore[union-attr,index]


def test_a_completions_prompt_of_token_ids_reaches_the_replica_as_ids(
        served: tuple[str, str]) -> None:
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    as_text = client.completions.create(model=model, prompt="The capital of France is",
                                        max_tokens=4, temperature=0)
    ids = [504, 3575, 282, 4649, 314]  # SmolLM2's tokens of "The capital of France is"
    as_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    nested = client.completions.create(model=model, prompt=[ids], max_tokens=4, temperature=0)
    assert as_ids.usage.prompt_tokens == nested.usage.prompt_tokens == len(ids)
    assert as_ids.choices[0].text == nested.choices[0].text == as_text.choices[0].text  # greedy
    with pytest.raises(openai.BadRequestError):  # an id outside the vocabulary: the replica's 400
        client.completions.create(model=model, prompt=[10**9], max_tokens=2)


def test_several_completions_prompts_get_n_choices_each_in_order(served: tuple[str, str]) -> None:
    """OpenAI's several prompts in one request: prompt i's choices at i*n .. i*n + n - 1, streamed
    or not, each equal to that prompt sent alone (greedy); usage sums the prompts."""
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    prompts = ["The capital of France is", "One, two, three,"]
    alone = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0)
             for p in prompts]
    both = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert ([c.text for c in both.choices]
            == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2)
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens
    assert both.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    for chunk in client.completions.create(model=model, prompt=[[504, 3575, 282, 4649, 314], [504]],
                                           max_tokens=5, temperature=0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts[0] == alone[0].choices[0].text and sorted(texts) == sorted(finishes) == [0, 1]


def test_structured_output_parses_through_the_gateway_in_chat_and_responses(
        served: tuple[str, str]) -> None:
    import pydantic

    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=24)
        kind: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog", "bird"]})
        age_years: int = pydantic.Field(ge=0, le=30)

    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Describe a pet dog named Rex."}]
    chat = client.chat.completions.parse(model=model, messages=messages, response_format=Pet,
                                         max_tokens=40, temperature=0)
    assert isinstance(chat.choices[0].message.parsed, Pet), chat.choices[0].message.content
    response = client.responses.parse(model=model, input=messages, text_format=Pet,
                                      max_output_tokens=40, temperature=0)
    assert isinstance(response.output_parsed, Pet), response.output_text
    assert response.text.format.type == "json_schema"


def test_completions_echo_scores_the_prompt_through_the_gateway(served: tuple[str, str]) -> None:
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    prompt = "The capital of France is"
    for stream in (False, True):
        kwargs = dict(model=model, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                      logprobs=1)
        if stream:
            chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
            text = "".join(c.choices[0].text for c in chunks)
            tokens = [t for c in chunks if c.choices[0].logprobs
                      for t in c.choices[0].logprobs.tokens]
            token_logprobs = [lp for c in chunks if c.choices[0].logprobs
                              for lp in c.choices[0].logprobs.token_logprobs]
        else:
            answer = client.completions.create(**kwargs)
            text, logprobs = answer.choices[0].text, answer.choices[0].logprobs
            tokens, token_logprobs = logprobs.tokens, logprobs.token_logprobs
            assert answer.usage.completion_tokens == 2
            assert len(tokens) == answer.usage.prompt_tokens + 2
        assert text.startswith(prompt) and len(text) > len(prompt)
        assert "".join(tokens) == text
        assert token_logprobs[0] is None and all(lp <= 0 for lp in token_logprobs[1:])
    scored = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True,
                                       logprobs=0)
    choice = scored.choices[0]
    assert ((choice.text, choice.finish_reason, scored.usage.completion_tokens)
            == (prompt, "length", 0))
    assert choice.logprobs.token_logprobs == token_logprobs[:scored.usage.prompt_tokens]


def test_anthropic_count_tokens_equals_the_replicas_own_prompt_count(
        served: tuple[str, str]) -> None:
    url, model = served
    client = anthropic.Anthropic(base_url=url + "/anthropic", api_key="x", max_retries=0,
                                 timeout=120)
    tool = {"name": "get_weather", "description": "Weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    conversation = {"system": "You answer with one word.", "tools": [tool], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user",
         "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]}
    counted = client.messages.count_tokens(model=model, **conversation).input_tokens  # type: ignore[arg-type]
    message = client.messages.create(model=model, max_tokens=2, **conversation)  # type: ignore[arg-type]
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens > 20


def test_anthropic_prefill_continues_the_assistant_text_on_a_real_replica(
        served: tuple[str, str]) -> None:
    """The prompt ends inside the assistant turn (3 more tokens than a new turn, no end of turn):
    counted the same by count_tokens and by the replica."""
    url, model = served
    client = anthropic.Anthropic(base_url=url + "/anthropic", api_key="x", max_retries=0,
                                 timeout=120)
    question = {"role": "user", "content": "Name a color"}
    prefill = [question, {"role": "assistant", "content": "The color is"}]
    counted = client.messages.count_tokens(model=model, messages=prefill).input_tokens  # type: ignore[arg-type]
    message = client.messages.create(model=model, max_tokens=2, messages=prefill)  # type: ignore[arg-type]
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert (counted
            == client.messages.count_tokens(model=model, messages=[question]).input_tokens + 3)


def test_an_agent_loop_round_trips_its_calls_and_reads_its_growing_prefix_from_cache(
        served: tuple[str, str]) -> None:
    """Five turns of a forced-tool agent loop, streamed (the SDK's helper) and not in turn: each
    call is answered by its id in the next turn, no turn carries text beside its call, and each
    turn reads the previous turn's prompt from the prefix cache (routed to the replica holding
    it), within one 16-token block."""
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    tools: Any = [{"type": "function", "function": {
        "name": "done", "description": "Finish the task",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]
    messages: list[Any] = [
        {"role": "system", "content": "You are a coding agent. Call a tool at every step. " * 6},
        {"role": "user", "content": "Fix the bug."}]
    prompt_tokens, completion_tokens, cached_tokens = [], [], []
    for turn in range(5):
        ask: Any = {"model": model, "messages": messages, "tools": tools, "max_tokens": 24,
                    "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
        if turn % 2:
            with client.chat.completions.stream(**ask, stream_options={"include_usage": True}) as s:
                completion: Any = s.get_final_completion()
        else:
            completion = client.chat.completions.create(**ask)
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "tool_calls" and not message.content, message
        (call,) = message.tool_calls
        messages += [{"role": "assistant", "content": None,
                      "tool_calls": [call.model_dump(exclude_none=True)]},
                     {"role": "tool", "tool_call_id": call.id, "content": f"step {turn}: ok"}]
        prompt_tokens.append(completion.usage.prompt_tokens)
        completion_tokens.append(completion.usage.completion_tokens)
        cached_tokens.append(completion.usage.prompt_tokens_details.cached_tokens)
    for turn in range(1, 5):  # the forced call is spaced as the template re-renders it, so the
        # cache reaches past it: the whole previous turn, its answer too, within one block
        assert cached_tokens[turn] >= (prompt_tokens[turn - 1] + completion_tokens[turn - 1]
                                       ) // 16 * 16 - 16, (prompt_tokens, completion_tokens,
                                                           cached_tokens)


def _prompt_renders(replicas: list[embedded.ReplicaProcess]) -> dict[str, float]:
    """aigw_replica_prompt_renders_total summed over the replicas, by who rendered."""
    totals = {"gateway": 0.0, "replica": 0.0}
    for replica in replicas:
        for line in httpx.get(replica.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("aigw_replica_prompt_renders_total{"):
                by = line.split('by="', 1)[1].split('"', 1)[0]
                totals[by] += float(line.rsplit(" ", 1)[1])
    return totals


def test_the_prompt_is_rendered_once_by_the_gateway_and_answers_as_a_replica_rendering_it(
        served: tuple[str, str], two_replicas: list[embedded.ReplicaProcess]) -> None:
    """The router renders and tokenizes the chat prompt to hash it; the replica takes those ids
    (same render id: tokenizer, template, chat format) instead of rendering the messages again,
    and answers exactly as it does when it renders them itself (greedy, tools in the prompt)."""
    url, model = served
    tools: Any = [{"type": "function", "function": {"name": "read_file", "description": "Read",
                   "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
    ask: Any = {"model": model, "max_tokens": 12, "temperature": 0, "tools": tools, "messages": [
        {"role": "system", "content": "You help with code. " * 8},
        {"role": "user", "content": "What is in main.py?"}]}
    before = _prompt_renders(two_replicas)
    through = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    answer = through.chat.completions.create(**ask)
    after = _prompt_renders(two_replicas)
    assert after["gateway"] == before["gateway"] + 1 and after["replica"] == before["replica"]
    direct = openai.OpenAI(base_url=two_replicas[0].url + "/v1", api_key="x", max_retries=0,
                           timeout=120).chat.completions.create(**ask)
    assert _prompt_renders(two_replicas)["replica"] == after["replica"] + 1
    assert answer.choices[0].message == direct.choices[0].message
    assert answer.usage.prompt_tokens == direct.usage.prompt_tokens


def _retained_until(replica_url: str, since: int) -> list[float]:
    """Each BlockRetained's `retained_until_ts` in the replica's KV events after batch `since`."""
    page = httpx.get(replica_url + "/kv/events", params={"since": since}, timeout=10).json()
    return [event["retained_until_ts"] for batch in page["batches"] for event in batch["events"]
            if event["type"] == "BlockRetained"]


def _gateway_sees_idle(gateway_url: str, replica_url: str) -> bool:
    """The gateway's last load report of `replica_url` shows nothing running, queued or predicted
    to queue: the router's view, which lags the replica by up to a health interval."""
    endpoint = replica_url.removeprefix("http://")
    lines = [line for line in httpx.get(gateway_url + "/metrics", timeout=10).text.splitlines()
             if f'endpoint="{endpoint}"' in line and line.startswith((
                 "aigw_endpoint_requests_running", "aigw_endpoint_requests_waiting",
                 "aigw_endpoint_predicted_queue_delay_ms"))]
    return bool(lines) and all(float(line.rsplit(" ", 1)[1]) == 0.0 for line in lines)


def _last_seq(replica_url: str) -> int:
    return int(httpx.get(replica_url + "/kv/events", params={"since": 10**9}, timeout=10)
               .json()["last_seq"])


def test_sdk_cache_retention_fields_keep_a_prefix_through_pressure_that_evicts_others(
        served: tuple[str, str], two_replicas: list[embedded.ReplicaProcess]) -> None:
    """OpenAI's prompt_cache_retention and Anthropic's cache_control ttl reach the replica as KV
    retention (clamped to the gateway's 1 h maximum): its events name the kept blocks, and after
    unrelated prompts that fill the whole pool (91 blocks) the session's next turn still hits them
    while a prefix sent without retention is gone."""
    import time

    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    system = ("You are a terse assistant for the harbour office. "
              + "Tide tables and berth rules. " * 40)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Berth 4?"}]
    seqs = {r.url: _last_seq(r.url) for r in two_replicas}
    started = time.time()
    first = client.chat.completions.with_raw_response.create(
        model=model, max_tokens=4, temperature=0, messages=messages,  # type: ignore[arg-type]
        prompt_cache_key="harbour-agent-1", prompt_cache_retention="24h")
    replica = "http://" + first.headers["x-aigw-replica"]
    assert replica in seqs, (replica, list(seqs))
    untils = _retained_until(replica, seqs[replica])
    assert untils and all(started + 3590 <= t <= time.time() + 3601 for t in untils)  # 24h -> 1 h
    num_prompt = first.parse().usage.prompt_tokens
    bare = openai.OpenAI(base_url=replica + "/v1", api_key="x", max_retries=0, timeout=120)
    plain = "Lighthouse keeping notes, unretained. " * 40
    bare.completions.create(model=model, prompt=plain, max_tokens=1)
    for k in range(3):  # unrelated prompts of ~1,100 tokens each: every unreferenced block goes
        bare.completions.create(model=model, prompt=f"{k} " + "Granary ledger entry. " * 200,
                                max_tokens=1)
    again = bare.completions.create(model=model, prompt=plain, max_tokens=1)
    assert (again.usage.prompt_tokens_details is None
            or not again.usage.prompt_tokens_details.cached_tokens)
    # the router weighs the load it last saw: a report taken while the prompts above ran would
    # send the turn elsewhere (as it should, under load), which is not what this test is about
    assert wait_until(lambda: _gateway_sees_idle(url, replica), 30)
    raw = client.chat.completions.with_raw_response.create(
        model=model, max_tokens=4, temperature=0, prompt_cache_key="harbour-agent-1",
        messages=[*messages, {"role": "assistant", "content": "Free."},  # type: ignore[list-item]
                  {"role": "user", "content": "And berth 5?"}])
    cached = raw.parse().usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached >= (num_prompt // 16 - 1) * 16, (cached, num_prompt, replica,
                                                   raw.headers.get("x-aigw-replica"))

    claude = anthropic.Anthropic(base_url=url + "/anthropic", api_key="x", max_retries=0,
                                 timeout=120)
    seqs = {r.url: _last_seq(r.url) for r in two_replicas}
    started = time.time()
    # (the same system prompt: on the replica whose project share the first session filled, its
    # head is already kept and costs nothing, so this retention is recorded wherever it lands)
    claude.messages.create(model=model, max_tokens=2, system=[
        {"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "5m"}}],
        messages=[{"role": "user", "content": "Form 12?"}])
    untils = [t for r in two_replicas for t in _retained_until(r.url, seqs[r.url])]
    assert untils and all(started + 295 <= t <= time.time() + 301 for t in untils)
    with pytest.raises(anthropic.BadRequestError, match="ttl"):
        claude.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "2d"}}]}])  # type: ignore[typeddict-item]


# last in the module: it kills one of the replicas the other tests share
def test_killing_one_replica_mid_run_never_hangs_a_request(
        served: tuple[str, str], two_replicas: list[embedded.ReplicaProcess]) -> None:
    url, model = served
    results: list[str] = []

    def one_request() -> None:
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
                    "model": model, "max_tokens": 48, "stream": True,
                    "messages": [{"role": "user", "content": "Tell a story"}]}) as response:
                text = response.read().decode()
            results.append("ok" if "[DONE]" in text else "error_event" if '"error"' in text
                           else "bad")
        except httpx.HTTPError as exc:
            results.append(f"transport:{exc!r}")

    threads = [threading.Thread(target=one_request) for _ in range(6)]
    for thread in threads:
        thread.start()
    two_replicas[0].process.kill()
    for thread in threads:
        thread.join(150)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert set(results) <= {"ok", "error_event"}, results
    after = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert after.status_code == 200
