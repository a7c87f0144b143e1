"""Chat completions through the official openai SDK against the fake engine."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson

from tests.engine.server.fakes import FakeEngine

USER = [{"role": "user", "content": "Say hello"}]


def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines()
            if line.startswith("data: ")]


def test_chat_completion_returns_reply_and_exact_usage(client: openai.OpenAI,
                                                       fake_engine: FakeEngine, model: str) -> None:
    completion = client.chat.completions.create(model=model, messages=USER)  # type: ignore[arg-type]
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    choice = completion.choices[0]
    assert choice.index == 0 and choice.finish_reason == "stop"
    assert choice.message.role == "assistant" and choice.message.content == fake_engine.reply
    assert choice.message.tool_calls is None
    prompt = fake_engine.calls[0].prompt_token_ids
    assert prompt == fake_engine.tokenizer.encode_chat([{"role": "user", "content": "Say hello"}])
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(prompt)
    num_reply_tokens = len(fake_engine.tokenizer.encode(str(fake_engine.reply))) + 1  # + eos
    assert completion.usage.completion_tokens == num_reply_tokens
    assert completion.usage.total_tokens == len(prompt) + num_reply_tokens


def test_sampling_fields_reach_the_engine(client: openai.OpenAI, fake_engine: FakeEngine,
                                          model: str) -> None:
    client.chat.completions.create(
        model=model, messages=USER, temperature=0.5, top_p=0.9, seed=7,  # type: ignore[arg-type]
        max_completion_tokens=50, stop=["zzz"], presence_penalty=0.5, frequency_penalty=-0.5,
        extra_body={"top_k": 5, "min_tokens": 2, "ignore_eos": False, "stop_token_ids": [3],
                    "cache_salt": "tenant-a", "unknown_field": 1})
    call = fake_engine.calls[0]
    params = call.params
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 5, 7)
    assert (params.max_tokens, params.min_tokens, params.stop) == (50, 2, ("zzz",))
    assert params.stop_token_ids == (3,)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert call.cache_salt == "tenant-a"


def test_max_completion_tokens_ends_with_length(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.create(model=model, messages=USER,  # type: ignore[arg-type]
                                                max_completion_tokens=3)
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.content == "Hel"
    assert completion.usage is not None and completion.usage.completion_tokens == 3


def test_stop_string_is_trimmed(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.create(model=model, messages=USER, stop="I am")  # type: ignore[arg-type]
    assert completion.choices[0].message.content == "Hello! "
    assert completion.choices[0].finish_reason == "stop"


def test_n_fans_out_with_consecutive_seeds_and_counts_prompt_once(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    completion = client.chat.completions.create(model=model, messages=USER, n=2, seed=10)  # type: ignore[arg-type]
    assert [c.index for c in completion.choices] == [0, 1]
    assert sorted(call.request_id for call in fake_engine.calls) == [f"{completion.id}-0",
                                                                 f"{completion.id}-1"]
    by_id = {call.request_id: call.params for call in fake_engine.calls}
    assert by_id[f"{completion.id}-0"].seed == 10 and by_id[f"{completion.id}-1"].seed == 11
    assert all(params.n == 1 for params in by_id.values())
    assert completion.usage is not None
    num_prompt = len(fake_engine.calls[0].prompt_token_ids)
    num_reply = len(fake_engine.tokenizer.encode(str(fake_engine.reply))) + 1
    assert completion.usage.prompt_tokens == num_prompt
    assert completion.usage.completion_tokens == 2 * num_reply


def test_logprobs_have_openai_shape(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.create(model=model, messages=USER, logprobs=True,  # type: ignore[arg-type]
                                                top_logprobs=3, max_completion_tokens=4)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [entry.token for entry in logprobs.content] == ["H", "e", "l", "l"]
    first = logprobs.content[0]
    assert first.logprob == -0.25 and first.bytes == [ord("H")]
    assert len(first.top_logprobs) == 3 and first.top_logprobs[0].token == "H"


def test_repeated_prompt_reports_cached_tokens_unless_salt_differs(
        client: openai.OpenAI, model: str) -> None:
    long_user = [{"role": "user", "content": "x" * 100}]
    first = client.chat.completions.create(model=model, messages=long_user)  # type: ignore[arg-type]
    again = client.chat.completions.create(model=model, messages=long_user)  # type: ignore[arg-type]
    salted = client.chat.completions.create(model=model, messages=long_user,  # type: ignore[arg-type]
                                            extra_body={"cache_salt": "other"})
    cached = [c.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
              for c in (first, again, salted)]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0


def test_developer_role_and_text_parts_are_accepted(client: openai.OpenAI, fake_engine: FakeEngine,
                                                    model: str) -> None:
    client.chat.completions.create(model=model, messages=[  # type: ignore[arg-type]
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "part one"},
                                     {"type": "text", "text": "part two"}]},
    ])
    prompt = fake_engine.prompt_text(fake_engine.calls[0])
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt
    assert "part one\npart two" in prompt


def test_alias_is_served_and_echoed(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="fake-alias", messages=USER)  # type: ignore[arg-type]
    assert completion.model == "fake-alias"


def test_stream_sends_role_then_content_then_finish(client: openai.OpenAI, fake_engine: FakeEngine,
                                                    model: str) -> None:
    chunks = list(client.chat.completions.create(model=model, messages=USER, stream=True))  # type: ignore[arg-type]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == fake_engine.reply
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stream_usage_chunk_then_done(http: httpx.Client, fake_engine: FakeEngine,
                                      model: str) -> None:
    body = {"model": model, "messages": USER, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    usage_chunk = orjson.loads(events[-2])
    assert usage_chunk["choices"] == []
    num_prompt = len(fake_engine.calls[0].prompt_token_ids)
    assert usage_chunk["usage"]["prompt_tokens"] == num_prompt
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(orjson.loads(e)["usage"] is None for e in events[:-2])


def test_stream_with_n_2_finishes_each_choice(client: openai.OpenAI, fake_engine: FakeEngine,
                                              model: str) -> None:
    chunks = list(client.chat.completions.create(model=model, messages=USER, n=2, stream=True))  # type: ignore[arg-type]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == fake_engine.reply
        assert mine[-1].finish_reason == "stop"


def test_stream_logprobs_come_with_their_tokens(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.chat.completions.create(model=model, messages=USER, stream=True,  # type: ignore[arg-type]
                                                 logprobs=True, max_completion_tokens=3))
    tokens = [entry.token for c in chunks if c.choices and c.choices[0].logprobs
              for entry in c.choices[0].logprobs.content or []]
    assert tokens == ["H", "e", "l"]


def test_output_grammars_are_compiled_off_the_event_loop(http: httpx.Client, model: str,
                                                         monkeypatch: object) -> None:
    """Compiling a large schema or tool set takes tens of milliseconds (40 tools: ~45 ms):
    done on the event loop, it would stall every other stream of the replica."""
    import threading

    import contracts.output_grammar as og

    threads: list[str] = []
    compile_grammar = og.grammar_of

    def recording(spec: og.OutputGrammar) -> str:
        threads.append(threading.current_thread().name)
        return compile_grammar(spec)

    monkeypatch.setattr(og, "grammar_of", recording)  # type: ignore[attr-defined]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
    messages = [{"role": "user", "content": "hi"}]
    for path, body in [
        ("/v1/chat/completions", {"messages": messages, "response_format": response_format}),
        ("/v1/chat/completions", {"messages": messages, "tools": [weather],
                                  "tool_choice": "required"}),
        ("/v1/completions", {"prompt": "hi", "response_format": response_format}),
    ]:
        assert http.post(path, json={"model": model, "max_tokens": 4, **body}).status_code == 200
    assert len(threads) == 3 and "replica-server" not in threads


def test_the_gateways_prompt_ids_are_used_only_under_this_replicas_render_id(
        http: httpx.Client, fake_engine: FakeEngine, model: str, server: Any) -> None:
    """The gateway sends the prompt it rendered (chat/render.py) with its render id: the same id
    means the same tokenizer, template and format, and the replica does not render again; any
    other id (another tokenizer loaded there) and the replica renders the messages itself."""
    from engine.server.keys import SERVING_KEY

    render_id = server.app[SERVING_KEY].renderer.render_id
    messages = [{"role": "user", "content": "Say hello"}]
    rendered = fake_engine.tokenizer.encode_chat(messages)
    given = [*rendered[:-1], 7]  # not what the messages render to: shows which one was used
    body = {"model": model, "messages": messages, "max_tokens": 4, "prompt_token_ids": given}
    assert http.post("/v1/chat/completions", json={**body, "prompt_render_id": render_id}
                     ).status_code == 200
    assert fake_engine.calls[-1].prompt_token_ids == given
    assert http.post("/v1/chat/completions", json={**body, "prompt_render_id": "0" * 16}
                     ).status_code == 200
    assert fake_engine.calls[-1].prompt_token_ids == rendered
    outside = http.post("/v1/chat/completions", json={
        **body, "prompt_token_ids": [10**9], "prompt_render_id": render_id})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "prompt_token_ids"
    renders = {line.split('by="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in http.get("/metrics").text.splitlines()
               if line.startswith("aigw_replica_prompt_renders_total{")}
    assert renders == {"gateway": 1.0, "replica": 1.0}
