"""Every failure answers in OpenAI's error envelope with the right status."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.engine.server.fakes import FakeEngine
from tests.engine.server.test_chat import sse_events

MODEL = "fake-alias"  # served as an alias by the settings fixture, whatever the engine
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


def assert_envelope(response: httpx.Response, status: int, type_: str = "invalid_request_error",
                    code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["code"] == code
    assert "Traceback" not in error["message"]
    return error  # type: ignore[no-any-return]


@pytest.mark.parametrize(("name", "body", "param"), [
    ("wrong type", chat(temperature="hot"), "temperature"),
    ("string number", chat(max_tokens="10"), "max_tokens"),
    ("missing messages", {"model": MODEL}, "messages"),
    ("empty messages", chat(messages=[]), "messages"),
    ("missing model", {"messages": USER}, "model"),
    ("unknown role", chat(messages=[{"role": "robot", "content": "x"}]), "messages.0"),
    ("image part", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), None),
    ("tool message without id", chat(messages=[{"role": "tool", "content": "x"}]), None),
    ("stream_options without stream", chat(stream_options={"include_usage": True}), None),
    ("stream_options wrong type", chat(stream=True, stream_options="yes"), "stream_options"),
    ("tool_choice without tools", chat(tool_choice="required"), None),
    ("top_logprobs without logprobs", chat(top_logprobs=2), None),
])
def test_malformed_bodies_are_400(http: httpx.Client, name: str, body: dict[str, Any],
                                  param: str | None) -> None:
    error = assert_envelope(http.post("/v1/chat/completions", json=body), 400)
    if param is not None:
        assert error["param"] == param, name


@pytest.mark.parametrize("fields", [
    {"temperature": 5}, {"top_p": 0}, {"n": 0}, {"max_tokens": 0}, {"top_logprobs": 21,
                                                                    "logprobs": True},
    {"presence_penalty": 3}, {"stop": [""]}, {"seed": 1 << 63}, {"seed": -(1 << 63) - 1},
])
def test_out_of_range_sampling_values_are_400(http: httpx.Client, fields: dict[str, Any]) -> None:
    assert_envelope(http.post("/v1/chat/completions", json=chat(**fields)), 400)


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 17}, "n"), ({"top_k": 0}, "top_k"), ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"), ({"stop": ["s"] * 17}, "stop"),
    ({"stop": ["s" * 513]}, "stop"),  # over MAX_STOP_BYTES
    # outside the vocabulary (the sampler indexes the logits with them), over MAX_STOP_TOKEN_IDS
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [1 << 40]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * 257}, "stop_token_ids"),
])
def test_a_refused_sampling_value_is_named_in_param(http: httpx.Client, fields: dict[str, Any],
                                                   param: str) -> None:
    # the gateway passes the replica's `param` through (n 17-128 passes its own check): it was null
    assert (assert_envelope(http.post("/v1/chat/completions", json=chat(**fields)), 400)["param"]
            == param)


def test_completion_logprobs_above_5_are_400(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 6})
    assert assert_envelope(response, 400)["param"] == "logprobs"


@pytest.mark.parametrize("encoding", ["foo", "gzip, deflate"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_content_encoding_the_replica_cannot_decode_is_a_415(http: httpx.Client, path: str,
                                                               encoding: str) -> None:
    """Read as identity before: the JSON under an encoding nobody decoded was answered."""
    body = chat() if path.endswith("chat/completions") else {"model": MODEL, "prompt": "x"}
    response = http.post(path, json=body, headers={"content-encoding": encoding})
    error = assert_envelope(response, 415, code="unsupported_media_type")
    assert repr(encoding) in error["message"] and "gzip, deflate" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_cache_salt_over_its_byte_bound_is_400_naming_it(http: httpx.Client,
                                                          fake_engine: FakeEngine,
                                                          path: str) -> None:
    """The salt is part of every prefix-cache and grammar-cache key: one as long as the whole
    body was accepted, hashed and kept with the grammars built for it. Bounded in UTF-8 bytes,
    not characters."""
    from contracts.replica_protocol import MAX_CACHE_SALT_BYTES

    body = chat() if path.endswith("chat/completions") else {"model": MODEL, "prompt": "x"}
    at_bound = "é" * (MAX_CACHE_SALT_BYTES // 2)  # (two bytes each)
    for salt in (at_bound + "x", "s" * (512 << 10)):
        error = assert_envelope(http.post(path, json={**body, "cache_salt": salt}), 400)
        assert error["param"] == "cache_salt" and str(MAX_CACHE_SALT_BYTES) in error["message"]
    assert not fake_engine.calls
    assert http.post(path, json={**body, "cache_salt": at_bound}).status_code == 200
    assert [call.cache_salt for call in fake_engine.calls] == [at_bound]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
def test_non_object_json_is_400(http: httpx.Client, raw: bytes) -> None:
    response = http.post("/v1/chat/completions", content=raw,
                         headers={"content-type": "application/json"})
    assert_envelope(response, 400)


def test_unknown_model_is_404_model_not_found(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=chat(model="gpt-9"))
    assert assert_envelope(response, 404, code="model_not_found")["param"] == "model"


def test_prompt_longer_than_the_window_is_context_length_exceeded(http: httpx.Client,
                                                                  engine: Any) -> None:
    body = chat(messages=[{"role": "user", "content": "hello " * (engine.max_model_len + 1)}])
    assert_envelope(http.post("/v1/chat/completions", json=body), 400,
                    code="context_length_exceeded")


def test_prompt_plus_max_tokens_over_the_window_is_context_length_exceeded(
        http: httpx.Client, fake_engine: FakeEngine) -> None:
    error = assert_envelope(http.post("/v1/chat/completions", json=chat(max_tokens=1020)), 400,
                            code="context_length_exceeded")
    assert "1020 in the completion" in error["message"]
    assert fake_engine.calls == []


def test_engine_prompt_too_long_error_is_context_length_exceeded(
        http: httpx.Client, fake_engine: FakeEngine) -> None:
    fake_engine.kv_capacity_tokens = 10  # tighter than the window the server checks against
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 20,
                                                  "stream": True, "n": 2})
    error = assert_envelope(response, 400, code="context_length_exceeded")
    assert "KV cache size is 10 tokens" in error["message"] and error["param"] == "prompt"


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_the_engine_refuses_when_adding_the_request_is_400(
        http: httpx.Client, fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch,
        stream: bool) -> None:
    """llguidance may refuse a grammar only once it meets the tokenizer, in the engine thread
    (LLMEngine.add_request); AsyncEngine.generate then raises it before the first output."""
    from contracts.output_grammar import OutputGrammarError

    async def refusing(*args: Any, **kwargs: Any) -> Any:
        raise OutputGrammarError("output grammar: lexer too complex")
        yield  # an async generator, as the engine's

    monkeypatch.setattr(fake_engine, "generate", refusing)
    body = chat(response_format={"type": "json_object"}, stream=stream, n=2)
    error = assert_envelope(http.post("/v1/chat/completions", json=body), 400)
    assert "lexer too complex" in error["message"]


def test_the_grammar_is_prepared_before_the_request_reaches_the_engine(
        http: httpx.Client, fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server builds a grammar's parser in its worker thread (a refusal is a 400 there)."""
    from contracts.output_grammar import OutputGrammarError

    assert http.post("/v1/chat/completions", json=chat(
        response_format={"type": "json_object"})).status_code == 200
    assert [g.kind for g in fake_engine.prepared_grammars] == ["json_object"]
    assert fake_engine.calls[-1].params.grammar == fake_engine.prepared_grammars[0]

    def refusing(grammar: Any, cache_salt: str | None = None) -> None:
        raise OutputGrammarError("output grammar: lexer too complex")

    monkeypatch.setattr(fake_engine, "prepare_grammar", refusing)
    num_calls = len(fake_engine.calls)
    error = assert_envelope(http.post("/v1/chat/completions", json=chat(
        response_format={"type": "json_object"})), 400)
    assert "lexer too complex" in error["message"] and len(fake_engine.calls) == num_calls


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_schema_nested_deeper_than_orjson_writes_is_400(http: httpx.Client, where: str) -> None:
    """orjson reads 1024 levels but writes only 254: the grammar's text could not be made."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(300):
        schema = {"type": "array", "items": schema}
    fields: dict[str, Any] = (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        if where == "response_format" else
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
         "tool_choice": "required"})
    error = assert_envelope(http.post("/v1/chat/completions", json=chat(max_tokens=4, **fields)),
                            400)
    assert error["message"].startswith(where) and "nested too deeply" in error["message"]


def test_body_over_the_cap_is_413(http: httpx.Client) -> None:
    body = chat(messages=[{"role": "user", "content": "x" * (2 * 1024 * 1024)}])
    assert_envelope(http.post("/v1/chat/completions", json=body), 413, code="request_too_large")


def test_unknown_route_and_wrong_method_answer_json(http: httpx.Client) -> None:
    assert_envelope(http.get("/v1/nope"), 404, code="not_found")
    assert_envelope(http.get("/v1/chat/completions"), 405, code="method_not_allowed")


def test_engine_failure_is_a_500_envelope_without_traceback(http: httpx.Client,
                                                            fake_engine: FakeEngine) -> None:
    fake_engine.fail_after_num_tokens = 2
    response = http.post("/v1/chat/completions", json=chat())
    assert_envelope(response, 500, type_="server_error")


def test_engine_failure_mid_stream_sends_error_event_without_done(
        http: httpx.Client, fake_engine: FakeEngine) -> None:
    fake_engine.fail_after_num_tokens = 2
    with http.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert "[DONE]" not in events
    assert '"error"' in events[-1] and "server_error" in events[-1]


def test_sdk_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=USER)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=USER, temperature=5)  # type: ignore[arg-type]


def test_request_id_is_echoed_or_generated(http: httpx.Client) -> None:
    given = http.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    generated = http.post("/v1/chat/completions", json=chat(model="gpt-9"))
    assert len(generated.headers["x-request-id"]) == 32
    unsafe = http.get("/health", headers={"x-request-id": "a b<c>"})
    assert unsafe.headers["x-request-id"] != "a b<c>"
    streamed = http.post("/v1/chat/completions", json=chat(stream=True),
                         headers={"x-request-id": "s-1"})
    assert streamed.headers["x-request-id"] == "s-1"


def test_engine_failure_before_the_first_token_of_a_stream_is_a_500_envelope(
        http: httpx.Client, fake_engine: FakeEngine) -> None:
    fake_engine.fail_after_num_tokens = 0
    response = http.post("/v1/chat/completions", json=chat(stream=True, n=2))
    assert_envelope(response, 500, type_="server_error")


def test_unusable_response_format_and_too_many_choices_are_400(http: httpx.Client) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    error = assert_envelope(http.post("/v1/chat/completions",
                                      json=chat(response_format=bad_schema)), 400)
    assert "response_format" in error["message"] and "JSON schema" in error["message"]
    assert_envelope(http.post("/v1/chat/completions", json=chat(
        response_format={"type": "json_schema"})), 400)
    assert "min_tokens" in assert_envelope(http.post("/v1/chat/completions", json=chat(
        response_format={"type": "json_object"}, min_tokens=2, max_tokens=8)), 400)["message"]
    assert http.post("/v1/chat/completions", json=chat(
        response_format={"type": "text"})).status_code == 200
    many = {"model": MODEL, "prompt": ["a"] * 20, "n": 8}
    assert "at most 128 choices" in assert_envelope(http.post("/v1/completions", json=many),
                                                    400)["message"]


ENDLESS_SCHEMAS = [  # (schema, the $ref named): each value would have to contain itself again
    ({"$ref": "#"}, "#"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
      "$ref": "#/$defs/a"}, "#/$defs/a"),
    ({"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}, "#"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#"),
]


@pytest.mark.parametrize(("schema", "ref"), ENDLESS_SCHEMAS)
@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_schema_whose_recursion_never_ends_is_400_naming_the_ref(
        http: httpx.Client, where: str, schema: dict[str, Any], ref: str) -> None:
    """llguidance compiles these, into a grammar that allows no first token (or none after
    `{"child":`): the answer was an empty 200."""
    fields: dict[str, Any] = (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        if where == "response_format" else
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {  # "#" = these
            "type": "object", "properties": {"x": schema}, "required": ["x"],
            "$defs": schema.get("$defs", {})}}}],
         "tool_choice": "required"})
    error = assert_envelope(http.post("/v1/chat/completions", json=chat(max_tokens=4, **fields)),
                            400)
    assert error["param"] == where and f"'$ref': {ref!r} admits no finite value" in error[
        "message"], error


def test_a_recursive_schema_with_a_way_out_is_served(http: httpx.Client) -> None:
    tree = {"type": "object", "properties": {"name": {"type": "string"}, "children": {
        "type": "array", "items": {"$ref": "#"}}}, "required": ["name", "children"]}
    listed = {"$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [
        {"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["next"]}},
        "$ref": "#/$defs/node"}
    for schema in (tree, listed):
        answer = http.post("/v1/chat/completions", json=chat(max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
        assert answer.status_code == 200, answer.text
    # a $ref to a schema without any value is no recursion: not blamed as one
    dead_end = {"type": "object", "properties": {"x": {"$ref": "#/$defs/none"}},
                "required": ["x"], "$defs": {"none": False}}
    answer = http.post("/v1/chat/completions", json=chat(max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": dead_end}}))
    assert "admits no finite value" not in answer.text


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_schema_over_the_grammar_bound_is_400_before_it_is_compiled(
        http: httpx.Client, where: str) -> None:
    """llguidance took 15 s of a worker thread on a 7.9 MB enum before refusing it itself."""
    schema = {"enum": [f"value-{i}" for i in range(60_000)]}  # ~840 KB
    fields: dict[str, Any] = (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        if where == "response_format" else
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": schema}, "required": ["x"]}}}],
         "tool_choice": "required"})
    error = assert_envelope(http.post("/v1/chat/completions", json=chat(max_tokens=4, **fields)),
                            400)
    assert error["param"] == where and "is over 524288 characters" in error["message"], error
