"""The cache-miss explainer: with `x-aigw-debug: 1` an answer says how many prompt tokens hit the
prefix cache and, for a session, where its prompt first diverged from the previous turn's (which
message, tool or field, at which char and token); the trace always says it; the dashboard lists a
session's turns; nothing of one project's sessions is visible to another."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import anthropic
import httpx
import openai
import pytest

from bench.mock_upstream import MockConfig, MockState, create_mock_app
from gateway.request.cache_explainer import CacheExplainer, diverge, prompt_parts
from gateway.request.canonical import CanonicalRequest, Message, Tool
from gateway.settings import GatewaySettings
from gateway.telemetry.keys import TELEMETRY
from gateway.web.services import create_served_app
from tests.gateway.conftest import MODEL, GatewayFactory, LoopThread, start_app, wait_until

SYSTEM = "You are a careful agent. " * 8 + "Today is 2026-01-01 10:00:00."  # 229 chars
TOOLS = [{"name": f"tool_{i}", "description": f"Does thing number {i} well.",
          "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}
         for i in range(5)]
DEBUG = {"x-aigw-debug": "1"}


def _chat(system: str, user: str = "What now?") -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _request(**fields: Any) -> CanonicalRequest:
    return CanonicalRequest(request_id="r", model="m", project="p", **fields)


def test_the_first_difference_is_named_by_part_and_char() -> None:
    tools = [Tool(t["name"], t["description"], t["parameters"]) for t in TOOLS]
    turn1 = _request(tools=tools, messages=[Message("system", SYSTEM), Message("user", "hi")])
    changed = list(tools)
    changed[3] = Tool("tool_3", "Does thing number 3 badly.", tools[3].parameters)
    turn2 = _request(tools=changed, messages=turn1.messages)
    assert diverge(prompt_parts(turn1), prompt_parts(turn2))[0] == \
        "tools[3].description changed at char 20"
    later = _request(tools=tools, messages=[Message("system", SYSTEM.replace("10:00", "10:05")),
                                            Message("user", "hi")])
    where, num_chars = diverge(prompt_parts(turn1), prompt_parts(later))  # type: ignore[misc]
    assert where == f"messages[0].content changed at char {SYSTEM.index('10:00') + 4}"
    assert num_chars > sum(len(t["description"]) for t in TOOLS)  # the tools came before it
    extended = _request(tools=tools, messages=[*turn1.messages, Message("assistant", "ok"),
                                               Message("user", "next")])
    assert diverge(prompt_parts(turn1), prompt_parts(extended)) is None  # an agent loop's turn
    assert diverge(prompt_parts(extended), prompt_parts(turn1))[0] == "messages[2] removed"
    fewer = _request(tools=tools[:4], messages=turn1.messages)
    assert diverge(prompt_parts(turn1), prompt_parts(fewer))[0] == "tools[4] removed"
    formatted = _request(tools=tools, messages=turn1.messages,
                         response_format={"type": "json_object"})
    assert diverge(prompt_parts(turn1), prompt_parts(formatted))[0] == "response_format added"
    other_model = _request(tools=tools, messages=turn1.messages)
    other_model.model = "m2"
    assert diverge(prompt_parts(turn1), prompt_parts(other_model)) == ("model changed", 0)


def test_the_store_is_bounded_in_bytes_and_keyed_by_project() -> None:
    explainer = CacheExplainer(max_bytes=64 * 1024)
    for i in range(200):
        request = _request(messages=[Message("user", "x" * 2000)], prompt_cache_key=f"s{i}")
        explainer.explain(request)
    assert explainer.num_bytes <= 64 * 1024
    first = _request(messages=[Message("user", "mine")], prompt_cache_key="shared")
    assert explainer.explain(first).divergence is None  # type: ignore[union-attr]
    other = _request(messages=[Message("user", "theirs")], prompt_cache_key="shared")
    other.project = "q"
    turn = explainer.explain(other)
    assert turn is not None and turn.turn == 1 and turn.divergence is None
    assert [t.turn for t in explainer.turns("p", "shared")] == [1]
    assert explainer.turns("q", "nope") == []


def test_one_projects_sessions_never_evict_anothers() -> None:
    """Each project's sessions have their own share of the bytes: a tenant sending thousands of
    sessions evicts only its own, never another tenant's history."""
    explainer = CacheExplainer(max_bytes=64 * 1024)
    theirs = _request(messages=[Message("user", "a quiet session")], prompt_cache_key="quiet")
    theirs.project = "q"
    explainer.explain(theirs)
    for i in range(500):
        explainer.explain(_request(messages=[Message("user", "x" * 2000)],
                                   prompt_cache_key=f"flood-{i}"))
    assert explainer.num_bytes <= 64 * 1024
    assert [t.turn for t in explainer.turns("q", "quiet")] == [1]
    again = _request(messages=[Message("user", "a quiet session")], prompt_cache_key="quiet")
    again.project = "q"
    assert explainer.explain(again).turn == 2  # type: ignore[union-attr]


def test_the_openai_sdk_is_told_which_message_changed(make_gateway: GatewayFactory,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_TRACING", "1")
    gateway = make_gateway(configs=[MockConfig(num_cached_tokens=30)])
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)

    def turn(system: str, stream: bool = False) -> httpx.Headers:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=_chat(system), prompt_cache_key="agent/1",  # type: ignore[arg-type]
            extra_headers=DEBUG, stream=stream)
        raw.parse() if not stream else list(raw.parse())
        return raw.headers

    first = turn(SYSTEM)
    assert first["x-aigw-cache-session-turn"] == "1" and first["x-aigw-cache-divergence"] == "none"
    assert first["x-aigw-cache-hit-tokens"] == "30" and int(first["x-aigw-prompt-tokens"]) > 30
    moved = SYSTEM.replace("10:00:00", "10:00:07")
    second = turn(moved)
    assert second["x-aigw-cache-session-turn"] == "2"
    assert second["x-aigw-cache-divergence"] == "messages[0].content changed at char 227"
    # estimated (no ids rendered here): the role and the content before it, ~4 chars a token
    assert second["x-aigw-cache-divergence-token"] == f"~{(len('system') + 227) // 4}"
    streamed = turn(moved, stream=True)  # the same prompt again: no divergence
    assert streamed["x-aigw-cache-divergence"] == "none"
    plain = client.chat.completions.with_raw_response.create(model=MODEL, messages=_chat(SYSTEM))
    assert "x-aigw-cache-divergence" not in plain.headers  # only when asked
    trace_id = second["x-aigw-trace-id"]
    buffer = gateway.app[TELEMETRY].spans
    assert wait_until(lambda: buffer.trace(trace_id))
    root = buffer.trace(trace_id)[0]["attributes"]
    assert root["aigw.cache.divergence"] == "messages[0].content changed at char 227"
    assert root["aigw.cache.session_turn"] == 2 and root["aigw.cached_tokens"] == 30
    assert root["aigw.cache.divergence_exact"] is False
    view = httpx.get(gateway.url + "/dashboard/api/sessions/anonymous/" + quote("agent/1", safe=""))
    turns = view.json()["turns"]  # (auth off: the dashboard is open, the project "anonymous")
    assert [t["turn"] for t in turns] == [1, 2, 3] and turns[0]["divergence"] is None
    assert turns[1]["divergence"]["where"] == "messages[0].content changed at char 227"
    assert turns[1]["cached_tokens"] == 30 and 0 < turns[1]["hit_ratio"] < 1


@pytest.fixture
def served(loop_thread: LoopThread, tmp_path: Path) -> Any:
    """`aigw serve`'s app (real keys in SQLite) with a token limit (so admission renders the
    prompt's ids and the divergence's token index is exact): keys of projects `a` and `b`, and an
    admin key of `ops`."""
    from auth import AuthSettings, open_auth

    state = MockState(MockConfig(num_cached_tokens=16))
    upstream, upstream_url = loop_thread.run(start_app(create_mock_app(state)))

    async def make_keys() -> dict[str, str]:
        services = await open_auth(AuthSettings(data_dir=tmp_path))
        try:
            keys = {}
            for project, scope in (("a", "invoke"), ("b", "invoke"), ("ops", "admin")):
                await services.admin.create_project(project)
                scopes = sorted({f"ai_gateway:{scope}", "ai_gateway:invoke"})
                keys[project] = (await services.admin.create_key(project, scopes))[1]
            return keys
        finally:
            await services.close()

    keys = loop_thread.run(make_keys())
    settings = GatewaySettings(data_dir=tmp_path, limits={"tokens_per_minute": 1_000_000},
                               models=[{"name": MODEL, "backend": "replica",
                                        "endpoints": [upstream_url]}])
    app = loop_thread.run(create_served_app(settings))
    runner, url = loop_thread.run(start_app(app))
    yield url, keys
    loop_thread.run(runner.cleanup())
    loop_thread.run(upstream.cleanup())


def test_the_anthropic_sdk_is_told_which_tool_changed_and_projects_stay_apart(
        served: Any) -> None:
    url, keys = served

    def turn(key: str, tools: list[dict[str, Any]], text: str = "What now?") -> httpx.Headers:
        claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
        raw = claude.messages.with_raw_response.create(
            model=MODEL, max_tokens=8, system=SYSTEM, tools=tools,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": text}], metadata={"user_id": "session-7"},
            extra_headers=DEBUG)
        raw.parse()
        return raw.headers

    tools = [{"name": t["name"], "description": t["description"],
              "input_schema": t["parameters"]} for t in TOOLS]
    assert turn(keys["a"], tools)["x-aigw-cache-divergence"] == "none"
    edited = [dict(t) for t in tools]
    edited[3]["description"] = "Does thing number 3 differently."
    second = turn(keys["a"], edited)
    assert second["x-aigw-cache-divergence"] == "tools[3].description changed at char 20"
    token_index = int(second["x-aigw-cache-divergence-token"])  # exact: the rendered ids
    counted = httpx.post(url + "/v1/messages/count_tokens", headers={"x-api-key": keys["a"]},
                         json={"model": MODEL, "system": SYSTEM, "tools": edited, "messages": [
                             {"role": "user", "content": "What now?"}]}).json()["input_tokens"]
    assert 0 < token_index < counted  # (the template writes the tools after some framing)
    assert second["x-aigw-cache-hit-tokens"] == "16"
    # project b, same session name, another prompt: its own first turn, nothing of a's
    other = turn(keys["b"], tools[:2], "Something else")
    assert other["x-aigw-cache-session-turn"] == "1" and other["x-aigw-cache-divergence"] == "none"
    sessions = url + "/dashboard/api/sessions/a/session-7"
    refused = httpx.get(sessions, headers={"authorization": f"Bearer {keys['b']}"})
    assert refused.status_code == 403
    view = httpx.get(sessions, headers={"authorization": f"Bearer {keys['ops']}"}).json()
    assert [t["turn"] for t in view["turns"]] == [1, 2]
    assert view["turns"][1]["divergence"] == {
        "where": "tools[3].description changed at char 20", "token_index": token_index,
        "exact": True}
    assert view["turns"][1]["hit_ratio"] == pytest.approx(16 / view["turns"][1]["prompt_tokens"])
    b_view = httpx.get(url + "/dashboard/api/sessions/b/session-7",
                       headers={"authorization": f"Bearer {keys['ops']}"}).json()
    assert [t["turn"] for t in b_view["turns"]] == [1]
