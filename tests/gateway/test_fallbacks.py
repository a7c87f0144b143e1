"""Fallback chains across models, through the openai and anthropic SDKs against mock upstreams
that speak the OpenAI wire format: a model that throttles, fails, times out, has its breakers
open or refuses a prompt as too long hands the request to the next model of its chain before the
first token; the answer names the model that served it, one usage record bills it at that
model's price; a stream that breaks after its first token never falls back."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from aiohttp import web
from pydantic import ValidationError

from bench.mock_upstream import THROTTLE_HEADERS, MockConfig, MockState, create_mock_app
from gateway.settings import GatewaySettings
from gateway.telemetry.keys import TELEMETRY
from gateway.web.keys import FLEET, METER
from gateway.web.services import create_served_app
from infra.config_errors import one_line
from tests.gateway.conftest import (
    GatewayFactory,
    LoopThread,
    start_app,
    start_chat_upstream,
    wait_until,
)

PRICES_A = {"input_per_token": 1e-6, "output_per_token": 2e-6}
PRICES_B = {"input_per_token": 3e-6, "output_per_token": 5e-6}
HI = [{"role": "user", "content": "hi"}]


def _models(urls: dict[str, str], chains: dict[str, list[str]],
            backends: dict[str, str] | None = None) -> list[dict[str, Any]]:
    return [{"name": name, "backend": (backends or {}).get(name, "replica"), "endpoints": [url],
             "fallbacks": chains.get(name, []),
             "prices": PRICES_A if name == "model-a" else PRICES_B} for name, url in urls.items()]


def _fallbacks_counted(url: str) -> dict[tuple[str, str, str], float]:
    """aigw_fallbacks_total as /metrics serves it: (model, fallback, reason) -> count."""
    counted = {}
    for labels, value in re.findall(r"^aigw_fallbacks_total\{([^}]*)\} (\S+)$",
                                    httpx.get(url + "/metrics").text, re.MULTILINE):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        counted[(pairs["model"], pairs["fallback"], pairs["reason"])] = float(value)
    return counted


def _chain_gateway(make_gateway: GatewayFactory, configs: list[MockConfig],
                   names: list[str], chains: dict[str, list[str]], **overrides: Any) -> Any:
    """A gateway whose model names[i] is served by a mock with configs[i]."""
    for name, config in zip(names, configs, strict=True):
        config.model = name  # (what its /v1/models lists, with its max_model_len)
    gateway = make_gateway(configs=configs)
    urls = {name: upstream.url for name, upstream in zip(names, gateway.upstreams, strict=True)}
    return make_gateway(num_upstreams=0, configs=[], models=_models(urls, chains),
                        **overrides), gateway.upstreams


@pytest.fixture
def served(loop_thread: LoopThread, tmp_path: Path) -> Any:
    """`aigw serve`'s app (real keys, a real SQLite ledger): model-a (an `openai` upstream that
    throttles) falls back to model-b (a replica, at other prices)."""
    from auth import AuthSettings, open_auth

    throttling, serving = MockState(MockConfig(fail_mode="throttle")), MockState()
    runners = [loop_thread.run(start_app(create_mock_app(state)))
               for state in (throttling, serving)]

    async def make_key() -> str:
        services = await open_auth(AuthSettings(data_dir=tmp_path))
        try:
            await services.admin.create_project("default")
            return (await services.admin.create_key("default", ["ai_gateway:invoke"]))[1]
        finally:
            await services.close()

    key = loop_thread.run(make_key())
    urls = {"model-a": runners[0][1], "model-b": runners[1][1]}
    settings = GatewaySettings(data_dir=tmp_path, models=_models(
        urls, {"model-a": ["model-b"]}, {"model-a": "openai"}))
    app = loop_thread.run(create_served_app(settings))
    runner, url = loop_thread.run(start_app(app))
    yield url, key, app, throttling, serving
    loop_thread.run(runner.cleanup())
    for upstream, _ in runners:
        loop_thread.run(upstream.cleanup())


def test_a_429_falls_back_to_the_next_model_which_serves_and_is_billed_once(
        served: Any, loop_thread: LoopThread) -> None:
    url, key, app, throttling, serving = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="model-a", messages=HI)
    answer = raw.parse()
    assert answer.model == "model-b" and raw.headers["x-aigw-served-model"] == "model-b"
    assert answer.choices[0].message.content == "tok " * 8
    streamed = list(client.chat.completions.create(model="model-a", messages=HI, stream=True,
                                                   stream_options={"include_usage": True}))
    assert {chunk.model for chunk in streamed} == {"model-b"}
    claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    message = claude.messages.create(model="model-a", max_tokens=20, messages=HI)
    assert message.model == "model-b" and message.content[0].text == "tok " * 8  # type: ignore[union-attr]
    assert len(throttling.bodies) == len(serving.bodies) == 3
    assert {body["model"] for body in serving.bodies} == {"model-b"}  # b's own upstream name

    meter = app[METER]
    assert wait_until(lambda: len(loop_thread.run(meter.usage_records("default"))) >= 3)
    records = loop_thread.run(meter.usage_records("default"))
    assert len(records) == 3  # one each, never one per model tried
    for record in records:
        assert record.model == "model-b" and record.status == 200
        expected = (record.prompt_tokens * PRICES_B["input_per_token"]
                    + record.completion_tokens * PRICES_B["output_per_token"])
        assert record.cost_usd == pytest.approx(expected) and record.cost_usd > 0
    assert _fallbacks_counted(url) == {("model-a", "model-b", "throttled"): 3.0}


def test_a_key_limited_to_a_model_is_never_served_by_a_fallback_it_may_not_call(
        served: Any, loop_thread: LoopThread, tmp_path: Path) -> None:
    from auth import AuthSettings, open_auth

    url, _, app, throttling, serving = served

    async def make_key() -> str:
        services = await open_auth(AuthSettings(data_dir=tmp_path))
        try:
            return (await services.admin.create_key("default", ["ai_gateway:invoke"],
                                                    allowed_models=["model-a"]))[1]
        finally:
            await services.close()

    client = openai.OpenAI(base_url=url + "/v1", api_key=loop_thread.run(make_key()),
                           max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model="model-b", messages=HI)
    for stream in (False, True):  # model-a throttles; its fallback model-b is not this key's
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="model-a", messages=HI, stream=stream)
    assert len(throttling.bodies) == 2 and serving.bodies == []
    assert _fallbacks_counted(url) == {}


def test_an_exhausted_chain_answers_the_upstreams_429_with_its_retry_after(
        make_gateway: GatewayFactory) -> None:
    gateway, upstreams = _chain_gateway(
        make_gateway, [MockConfig(fail_mode="throttle"), MockConfig(fail_mode="throttle")],
        ["model-a", "model-b"], {"model-a": ["model-b"]})
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="model-a", messages=HI, stream=stream)
        assert {k: caught.value.response.headers[k] for k in THROTTLE_HEADERS} == THROTTLE_HEADERS
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude.messages.create(model="model-a", max_tokens=5, messages=HI)
    assert refused.value.response.headers["retry-after"] == "7"
    assert [len(u.state.bodies) for u in upstreams] == [3, 3]
    assert wait_until(lambda: gateway.meter.num_settle_calls == 3)
    records = list(gateway.meter.settled.values())  # one each, named as the answer that came:
    assert {(r.model, r.endpoint, r.status) for r in records} == {  # model-b's 429
        ("model-b", upstreams[1].url.split("://")[1], 429)}


@pytest.mark.parametrize("cause", ["server_error", "timeout", "breaker_open"])
def test_a_failure_before_the_first_token_falls_back(make_gateway: GatewayFactory,
                                                     cause: str) -> None:
    failing = MockConfig(fail_mode="hang" if cause == "timeout" else "before_first_byte")
    gateway, upstreams = _chain_gateway(
        make_gateway, [failing, MockConfig()], ["model-a", "model-b"], {"model-a": ["model-b"]},
        first_token_timeout_s=0.5, response_timeout_s=0.5, num_failures_to_eject=1,
        ejection_s=60)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0)
    first = client.chat.completions.create(model="model-a", messages=HI, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in first if c.choices) == "tok " * 8
    reasons = {"server_error": "server_error", "timeout": "timeout"}
    if cause == "breaker_open":  # the first failure opened model-a's only breaker
        with claude.messages.stream(model="model-a", max_tokens=20, messages=HI) as stream:
            assert "".join(stream.text_stream) == "tok " * 8
        assert stream.get_final_message().model == "model-b"
        assert len(upstreams[0].state.bodies) == 1  # not tried again while open
        counted = _fallbacks_counted(gateway.url)
        assert counted == {("model-a", "model-b", "server_error"): 1.0,
                           ("model-a", "model-b", "breaker_open"): 1.0}
        return
    assert _fallbacks_counted(gateway.url) == {("model-a", "model-b", reasons[cause]): 1.0}
    assert wait_until(lambda: gateway.meter.num_settle_calls == 1)
    record = next(iter(gateway.meter.settled.values()))
    assert record.model == "model-b" and record.status == 200


def test_a_prompt_too_long_goes_to_a_model_with_a_longer_context(
        make_gateway: GatewayFactory) -> None:
    """model-a (64 tokens) refuses it as vLLM does; model-short (48) is skipped unasked; model-b
    (4096) serves. A prompt that fits model-a never leaves it."""
    gateway, upstreams = _chain_gateway(
        make_gateway, [MockConfig(max_model_len=64, enforce_context=True),
                       MockConfig(max_model_len=48, enforce_context=True),
                       MockConfig(max_model_len=4096, enforce_context=True)],
        ["model-a", "model-short", "model-b"], {"model-a": ["model-short", "model-b"]})
    fleet = gateway.app[FLEET]  # the health checker reads each /v1/models' max_model_len
    assert wait_until(lambda: all(e.context_length for _, e in fleet.all_endpoints()))
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0)
    long_prompt = [{"role": "user", "content": "word " * 200}]  # ~250 tokens
    message = claude.messages.create(model="model-a", max_tokens=16, messages=long_prompt)
    assert message.model == "model-b"
    assert [len(u.state.bodies) for u in upstreams] == [1, 0, 1]
    short = claude.messages.create(model="model-a", max_tokens=16, messages=HI)
    assert short.model == "model-a"
    assert _fallbacks_counted(gateway.url) == {("model-a", "model-b", "context_length"): 1.0}


def test_a_stream_that_breaks_after_its_first_token_does_not_fall_back(
        make_gateway: GatewayFactory) -> None:
    gateway, upstreams = _chain_gateway(
        make_gateway, [MockConfig(fail_mode="mid_stream", fail_after_tokens=2), MockConfig()],
        ["model-a", "model-b"], {"model-a": ["model-b"]})
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    received = []
    with pytest.raises(openai.APIError, match="upstream"):
        for chunk in client.chat.completions.create(model="model-a", messages=HI, stream=True):
            received += [c.delta.content for c in chunk.choices if c.delta.content]
    assert "".join(received) == "tok " * 2
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.APIStatusError):
        with claude.messages.stream(model="model-a", max_tokens=50, messages=HI) as stream:
            list(stream.text_stream)
    assert len(upstreams[1].state.bodies) == 0 and _fallbacks_counted(gateway.url) == {}
    # (a broken stream's prompt is counted with the replica's tokenizer first: its first load)
    assert wait_until(lambda: gateway.meter.num_settle_calls == 2, timeout_s=30)
    assert {r.model for r in gateway.meter.settled.values()} == {"model-a"}


def test_a_refusal_of_the_request_itself_does_not_fall_back(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    """A 400 the next model would give too (a field it finds invalid) ends at the first model,
    passed through as the upstream said it."""
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {
            "message": "Invalid value for 'tool_choice'", "type": "invalid_request_error",
            "param": "tool_choice", "code": "invalid_value"}}, status=400)

    runner, refusing = start_chat_upstream(loop_thread, refuse)
    serving = make_gateway().upstreams[0]
    gateway = make_gateway(num_upstreams=0, configs=[], models=_models(
        {"model-a": refusing, "model-b": serving.url}, {"model-a": ["model-b"]},
        {"model-a": "openai"}))
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="model-a", messages=HI)
    assert caught.value.code == "invalid_value" and caught.value.param == "tool_choice"
    assert len(serving.state.bodies) == 0 and _fallbacks_counted(gateway.url) == {}
    loop_thread.run(runner.cleanup())


def test_the_retry_budget_bounds_the_hops(make_gateway: GatewayFactory) -> None:
    """With no retry left in the budget, the first model's error is the answer."""
    gateway, upstreams = _chain_gateway(
        make_gateway, [MockConfig(fail_mode="throttle"), MockConfig()], ["model-a", "model-b"],
        {"model-a": ["model-b"]}, retry_budget_ratio=0.0, num_retries_reserve=1)
    statuses = [httpx.post(gateway.url + "/v1/chat/completions",
                           json={"model": "model-a", "messages": HI}).status_code
                for _ in range(3)]
    assert statuses == [200, 429, 429]
    assert len(upstreams[1].state.bodies) == 1


def test_traces_show_each_attempt_and_the_hop(make_gateway: GatewayFactory,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_TRACING", "1")
    gateway, _ = _chain_gateway(make_gateway, [MockConfig(fail_mode="throttle"), MockConfig()],
                                ["model-a", "model-b"], {"model-a": ["model-b"]})
    response = httpx.post(gateway.url + "/v1/chat/completions",
                          json={"model": "model-a", "messages": HI})
    trace_id = response.headers["x-aigw-trace-id"]
    buffer = gateway.app[TELEMETRY].spans
    assert wait_until(lambda: buffer.trace(trace_id))
    spans = buffer.trace(trace_id)
    routes = [s["attributes"]["aigw.routing.model"] for s in spans if s["name"] == "gateway.route"]
    assert routes == ["model-a", "model-b"]
    calls = [s for s in spans if s["name"] == "upstream POST /v1/chat/completions"]
    assert [c["attributes"]["http.response.status_code"] for c in calls] == [429, 200]
    (hop,) = [s["attributes"] for s in spans if s["name"] == "gateway.fallback"]
    assert hop == {"aigw.fallback.from_model": "model-a", "aigw.fallback.to_model": "model-b",
                   "aigw.fallback.reason": "throttled",
                   "aigw.fallback.error_code": "rate_limit_exceeded"}


@pytest.mark.parametrize(("chains", "message"), [
    ({"a": ["b"], "b": ["a"]}, "fallback loop: a -> b -> a"),
    ({"a": ["a"]}, "fallback loop: a -> a"),
    ({"a": ["b"], "b": ["c"], "c": ["b"]}, "fallback loop: b -> c -> b"),
    ({"a": ["nowhere"]}, "model 'a': fallback 'nowhere' is not a configured model"),
    ({"a": ["b", "b"]}, "model 'a': a fallback is listed twice in ['b', 'b']"),
])
def test_loops_and_unknown_targets_are_refused_at_load(chains: dict[str, list[str]],
                                                       message: str) -> None:
    models = [{"name": name, "endpoints": ["http://127.0.0.1:1"], "fallbacks": chains.get(name, [])}
              for name in ("a", "b", "c")]
    with pytest.raises(ValidationError) as caught:
        GatewaySettings(models=models)
    assert one_line(caught.value) == f"GatewaySettings: {message}"


def test_a_chain_follows_each_fallbacks_own_fallbacks_once() -> None:
    from gateway.request.fallback import fallback_chains

    settings = GatewaySettings(models=[
        {"name": name, "endpoints": ["http://127.0.0.1:1"], "fallbacks": fallbacks}
        for name, fallbacks in (("a", ["b", "c"]), ("b", ["d"]), ("c", ["d"]), ("d", []))])
    assert fallback_chains(settings.models) == {"a": ("b", "d", "c"), "b": ("d",), "c": ("d",)}


def test_a_replica_model_falls_back_to_an_anthropic_upstream(make_gateway: GatewayFactory,
                                                             loop_thread: LoopThread) -> None:
    """Across backend kinds: a replica model that throttles hands the request to a model whose
    backend is a native Anthropic upstream, through the openai SDK, streamed and not; the
    Anthropic upstream gets its own body (its model name and credential)."""
    from tests.gateway.anthropic_upstream import AnthropicState, create_anthropic_app

    state = AnthropicState()
    runner, claude_url = loop_thread.run(start_app(create_anthropic_app(state)))
    throttling = make_gateway(configs=[MockConfig(fail_mode="throttle")]).upstreams[0]
    gateway = make_gateway(num_upstreams=0, configs=[], models=[
        {"name": "model-a", "endpoints": [throttling.url], "fallbacks": ["claude"]},
        {"name": "claude", "backend": "anthropic", "endpoints": [claude_url],
         "upstream_model": "claude-sonnet-4-5", "api_key": "sk-ant-upstream", "prices": PRICES_B}])
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    answer = client.chat.completions.create(model="model-a", messages=HI)
    assert answer.model == "claude" and answer.choices[0].message.content == "Hello from Claude"
    chunks = list(client.chat.completions.create(model="model-a", messages=HI, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "Hello from Claude"
    assert [body["model"] for body in state.bodies] == ["claude-sonnet-4-5"] * 2
    assert {h.get("x-api-key") for h in state.headers} == {"sk-ant-upstream"}
    assert wait_until(lambda: gateway.meter.num_settle_calls == 2)
    records = list(gateway.meter.settled.values())
    assert {r.model for r in records} == {"claude"} and all(r.prompt_tokens == 12 for r in records)
    assert _fallbacks_counted(gateway.url) == {("model-a", "claude", "throttled"): 2.0}
    loop_thread.run(runner.cleanup())
