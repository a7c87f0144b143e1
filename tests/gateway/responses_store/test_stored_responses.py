"""Stored Responses (`store`, `previous_response_id`, GET/DELETE /v1/responses/{id}, input_items)
through the gateway before the mock upstream, with the real openai SDK: what a continuation sends
upstream, per-project isolation, retention, the bounds, and the store's backends on their own
(SQLite in a temporary directory, a real redis-server)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from auth.principal import AuthError, Principal, Scope
from gateway.responses_store import ResponseStore, ResponseStoreSettings
from gateway.responses_store.redis_store import RedisResponseStore
from gateway.responses_store.sqlite_store import SqliteResponseStore
from gateway.web.keys import FLEET, RESPONSES, ROUTER
from tests.gateway.conftest import MODEL, Gateway, GatewayFactory, LoopThread, wait_until

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


class TwoProjects:
    """Key 'a' is project A's, 'b' project B's; both may invoke."""

    async def authenticate(self, credential: str | None) -> Principal:
        if credential in ("a", "b"):
            return Principal(f"project-{credential}", f"key-{credential}",
                             frozenset({Scope.INVOKE.value}))
        raise AuthError(401, "invalid_api_key", "unknown key")


@pytest.fixture
def served(make_gateway: GatewayFactory, tmp_path: Path) -> Gateway:
    return make_gateway(authenticator=TwoProjects(), data_dir=str(tmp_path))


def _client(gateway: Gateway, key: str = "a") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _upstream_messages(gateway: Gateway) -> list[dict[str, Any]]:
    return gateway.upstreams[0].state.bodies[-1]["messages"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("stream", [False, True])
def test_a_continuation_sends_the_stored_conversation_before_the_new_input(
        served: Gateway, stream: bool) -> None:
    client = _client(served)

    def create(**kwargs: Any) -> Any:
        if not stream:
            return client.responses.create(model=MODEL, **kwargs)
        with client.responses.stream(model=MODEL, **kwargs) as events:
            return events.get_final_response()

    first = create(instructions="Be brief.", input="My name is Ada.")
    assert first.store is True and first.previous_response_id is None
    second = create(instructions="Answer in French.", input="What is my name?",
                    previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.id != first.id
    # the instructions are this request's alone; the first turn and its answer come first
    assert _upstream_messages(served) == [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}]
    third = create(input="Thanks.", previous_response_id=second.id)
    assert [m["role"] for m in _upstream_messages(served)] == [
        "user", "assistant", "user", "assistant", "user"]
    assert _upstream_messages(served)[3]["content"] == second.output_text

    stored = client.responses.retrieve(third.id)
    assert (stored.id, stored.status, stored.output_text, stored.usage, stored.created_at) == (
        third.id, third.status, third.output_text, third.usage, third.created_at)
    assert stored.previous_response_id == second.id
    items = client.responses.input_items.list(third.id, order="asc")
    texts = [item.content[0].text for item in items.data]
    assert texts == ["My name is Ada.", first.output_text, "What is my name?",
                     second.output_text, "Thanks."]
    assert all(item.id for item in items.data) and not items.has_more


def test_input_items_page_newest_first_by_default(served: Gateway) -> None:
    client = _client(served)
    response = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": f"line {i}"} for i in range(5)])
    page = client.responses.input_items.list(response.id, limit=2)
    assert [i.content[0].text for i in page.data] == ["line 4", "line 3"] and page.has_more
    assert page.first_id == page.data[0].id and page.last_id == page.data[1].id
    rest = client.responses.input_items.list(response.id, limit=2, after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["line 2", "line 1"]
    ordered = [i.content[0].text for i in client.responses.input_items.list(
        response.id, order="asc")]
    assert ordered == [f"line {i}" for i in range(5)]
    http = httpx.Client(base_url=served.url, headers={"authorization": "Bearer a"})
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"),
                         ("after=msg_nope", "after")):
        answer = http.get(f"/v1/responses/{response.id}/input_items?{query}")
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_a_function_call_output_answers_the_previous_responses_call(served: Gateway) -> None:
    client = _client(served)
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS)
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(model=MODEL, tools=TOOLS, previous_response_id=first.id,
                                      input=[{"type": "function_call_output",
                                              "call_id": call.call_id, "output": "sunny"}])
    assert second.status == "completed"
    sent = _upstream_messages(served)
    assert sent[-2]["tool_calls"][0]["id"] == call.call_id
    assert sent[-1] == {"role": "tool", "content": "sunny", "tool_call_id": call.call_id}
    # an item_reference to the stored call resolves; to anything else it is a 400
    client.responses.create(model=MODEL, tools=TOOLS, previous_response_id=first.id, input=[
        {"type": "item_reference", "id": call.id},
        {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}])
    assert _upstream_messages(served)[-1]["content"] == "rain"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, previous_response_id=first.id,
                                input=[{"type": "item_reference", "id": "fc_unknown"}])
    assert refused.value.body["param"] == "input[0].id"  # type: ignore[index]
    # without the previous response, the output answers no call
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[{"type": "function_call_output",
                                                     "call_id": call.call_id, "output": "x"}])


def test_another_projects_key_sees_nothing(served: Gateway) -> None:
    mine, theirs = _client(served, "a"), _client(served, "b")
    response = mine.responses.create(model=MODEL, input="secret")
    with pytest.raises(openai.NotFoundError) as missing:
        theirs.responses.retrieve(response.id)
    assert missing.value.body == {"message": f"Response with id '{response.id}' not found.",
                                  "type": "invalid_request_error", "param": None,
                                  "code": "not_found"}
    with pytest.raises(openai.NotFoundError):
        theirs.responses.input_items.list(response.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(response.id)
    with pytest.raises(openai.BadRequestError) as refused:
        theirs.responses.create(model=MODEL, input="x", previous_response_id=response.id)
    assert refused.value.code == "previous_response_not_found"
    assert mine.responses.retrieve(response.id).id == response.id  # B's delete removed nothing


def test_delete_store_false_and_unknown_ids(served: Gateway) -> None:
    client = _client(served)
    kept = client.responses.create(model=MODEL, input="keep me")
    client.responses.delete(kept.id)
    for call in (lambda: client.responses.retrieve(kept.id),
                 lambda: client.responses.delete(kept.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model=MODEL, input="forget me", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for previous in (unstored.id, "resp_" + "0" * 32, "not-an-id"):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="x", previous_response_id=previous)
        assert refused.value.status_code == 400 and refused.value.body == {  # as OpenAI
            "message": f"Previous response with id '{previous}' not found.",
            "type": "invalid_request_error", "param": "previous_response_id",
            "code": "previous_response_not_found"}
    with pytest.raises(openai.BadRequestError) as refused:  # streamed: refused before it starts
        client.responses.create(model=MODEL, input="x", stream=True,
                                previous_response_id="resp_" + "1" * 32)
    assert refused.value.code == "previous_response_not_found"
    with client.responses.create(model=MODEL, input="stream, forget me", store=False,
                                 stream=True) as events:
        streamed = list(events)[-1].response
    assert streamed.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(streamed.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("../../etc")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="nope",
                      max_retries=0).responses.retrieve(kept.id)
    http = httpx.Client(base_url=served.url, headers={"authorization": "Bearer a"})
    for query, param in (("stream=maybe", "stream"), ("stream=true&starting_after=x",
                                                      "starting_after")):
        answer = http.get(f"/v1/responses/{unstored.id}?{query}")
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    assert http.get(f"/v1/responses/{kept.id}?stream=true").status_code == 404


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_stored_response_streams_back_as_the_events_that_made_it(served: Gateway,
                                                                   tools: Any) -> None:
    client = _client(served)
    extra = {"tools": tools} if tools else {}
    with client.responses.create(model=MODEL, input="Say hi", stream=True, **extra) as events:
        original = list(events)
    stored_id = original[-1].response.id
    with client.responses.retrieve(stored_id, stream=True) as events:
        replayed = list(events)
    assert replayed[-1].response.model_dump() == client.responses.retrieve(stored_id).model_dump()
    assert [e.sequence_number for e in replayed] == list(range(len(replayed)))

    def shape(events: list[Any]) -> list[tuple[str, str | None]]:  # deltas: one a part, replayed
        kinds = [(e.type, getattr(e, "item_id", None)) for e in events if not e.type.endswith(
            ".delta")]
        return kinds

    assert shape(replayed) == shape(original)
    if tools is None:
        text = "".join(e.delta for e in replayed if e.type == "response.output_text.delta")
        assert text == original[-1].response.output_text
    with client.responses.retrieve(stored_id, stream=True, starting_after=3) as events:
        assert [e.sequence_number for e in events] == list(range(4, len(replayed)))


def test_a_stream_cut_mid_way_is_stored_as_failed(make_gateway: GatewayFactory,
                                                  tmp_path: Path) -> None:
    from bench.mock_upstream import MockConfig

    served = make_gateway(configs=[MockConfig(fail_mode="mid_stream", fail_after_tokens=2)],
                          authenticator=TwoProjects(), data_dir=str(tmp_path))
    client = _client(served)
    seen: list[Any] = []
    with pytest.raises(openai.APIError, match="broke off"):  # the SDK raises the error event
        with client.responses.create(model=MODEL, input="Say hi", stream=True) as events:
            seen.extend(events)
    created = seen[0].response.id
    stored = client.responses.retrieve(created)
    assert stored.status == "failed" and stored.error is not None and stored.usage is None


def test_a_length_cut_answer_is_stored_incomplete(served: Gateway) -> None:
    client = _client(served)
    with client.responses.create(model=MODEL, input="Count", max_output_tokens=2,
                                 stream=True) as events:
        last = list(events)[-1]
    assert last.type == "response.incomplete"
    final = last.response
    stored = client.responses.retrieve(final.id)
    assert stored.status == "incomplete" and stored.incomplete_details.reason == "max_output_tokens"
    assert stored.output_text == final.output_text


def test_expired_responses_are_gone(make_gateway: GatewayFactory, tmp_path: Path) -> None:
    served = make_gateway(authenticator=TwoProjects(), data_dir=str(tmp_path),
                          responses_store_ttl_s=0.5)
    client = _client(served)
    response = client.responses.create(model=MODEL, input="short-lived")
    assert client.responses.retrieve(response.id).id == response.id
    import time

    time.sleep(0.7)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", previous_response_id=response.id)


def test_a_conversation_over_the_cap_is_refused_and_an_answer_over_it_not_stored(
        make_gateway: GatewayFactory, tmp_path: Path, loop_thread: LoopThread) -> None:
    served = make_gateway(authenticator=TwoProjects(), data_dir=str(tmp_path),
                          responses_store_max_response_bytes=4096)
    client = _client(served)
    big = client.responses.create(model=MODEL, input="x" * 5000)  # answered, not stored
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(big.id)
    small = client.responses.create(model=MODEL, input="hello")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="y" * 4000, previous_response_id=small.id)
    assert refused.value.code == "conversation_too_large"
    unstored = client.responses.create(model=MODEL, input="y" * 4000, store=False,
                                       previous_response_id=small.id)
    assert unstored.status == "completed"
    store = served.app[RESPONSES].store
    assert loop_thread.run(store.num_bytes()) < 4096


# ---- the backends on their own: bounds, expiry, isolation -----------------------------------

def _bounds(**overrides: Any) -> ResponseStoreSettings:
    values: dict[str, Any] = {"ttl_s": 60.0, "max_response_bytes": 100,
                              "max_project_bytes": 300, "max_bytes": 500}
    return ResponseStoreSettings(**{**values, **overrides})


def _rid(i: int) -> str:
    return f"resp_{i:032x}"


async def _check_bounds(store: ResponseStore) -> None:
    assert not await store.put("p", _rid(0), b"x" * 101)  # over max_response_bytes
    for i in range(1, 5):  # 4 x 100 bytes in one project: its oldest goes past 300
        assert await store.put("p", _rid(i), bytes([i]) * 100)
    assert await store.get("p", _rid(1)) is None
    assert [await store.get("p", _rid(i)) for i in (2, 3, 4)] == [bytes([i]) * 100
                                                                  for i in (2, 3, 4)]
    for i in range(5, 8):  # another project: the store's 500 evicts the soonest-expiring
        assert await store.put("q", _rid(i), b"q" * 100)
    assert await store.num_bytes() <= 500
    assert await store.get("p", _rid(2)) is None and await store.get("q", _rid(7)) is not None
    assert await store.get("q", _rid(4)) is None  # another project's id: nothing
    assert not await store.delete("q", _rid(4)) and await store.delete("p", _rid(4))
    assert await store.get("p", _rid(4)) is None


async def _check_expiry(store: ResponseStore) -> None:
    assert await store.put("p", _rid(1), b"soon")
    await asyncio.sleep(0.3)
    assert await store.get("p", _rid(1)) is None and not await store.delete("p", _rid(1))
    assert await store.put("p", _rid(2), b"later")  # purges the expired one's bytes
    assert await store.num_bytes() == len(b"later")


def test_sqlite_store_bounds_and_expiry(tmp_path: Path, loop_thread: LoopThread) -> None:
    async def run() -> None:
        store = SqliteResponseStore(_bounds(), tmp_path / "a.sqlite3")
        await _check_bounds(store)
        await store.close()
        store = SqliteResponseStore(_bounds(ttl_s=0.2), tmp_path / "b.sqlite3")
        await _check_expiry(store)
        await store.close()
        reopened = SqliteResponseStore(_bounds(ttl_s=0.2), tmp_path / "b.sqlite3")
        assert await reopened.num_bytes() == len(b"later")  # the totals live in the file
        await reopened.close()

    loop_thread.run(run())
    assert not (tmp_path / "never.sqlite3").exists()


def test_redis_store_bounds_and_expiry(any_clean_redis_url: str, loop_thread: LoopThread) -> None:
    """On one server and on a Cluster (every key of a script under the {resp} hash tag)."""
    from infra.redis_client import connect_redis

    async def run() -> None:
        store = RedisResponseStore(_bounds(), connect_redis(any_clean_redis_url), owns_client=True)
        await _check_bounds(store)
        await store.close()
        store = RedisResponseStore(_bounds(ttl_s=0.2), connect_redis(any_clean_redis_url),
                                   prefix="t2", owns_client=True)
        await _check_expiry(store)
        await store.close()

    loop_thread.run(run())


def test_a_gateway_with_redis_keeps_responses_there(make_gateway: GatewayFactory, tmp_path: Path,
                                                    clean_redis_url: str) -> None:
    served = make_gateway(authenticator=TwoProjects(), data_dir=str(tmp_path),
                          redis_url=clean_redis_url)
    client = _client(served)
    first = client.responses.create(model=MODEL, input="My name is Ada.")
    second = client.responses.create(model=MODEL, input="And?", previous_response_id=first.id)
    assert client.responses.retrieve(second.id).previous_response_id == first.id
    assert not (tmp_path / "responses.sqlite3").exists()
    import redis

    keys = redis.Redis.from_url(clean_redis_url).keys("aigw:{resp}:r:*")
    assert sorted(k.decode().split(":")[3] for k in keys) == sorted([first.id, second.id])
    stored = orjson.loads(redis.Redis.from_url(clean_redis_url).get(
        f"aigw:{{resp}}:r:{second.id}:project-a"))
    assert len(stored["input_items"]) == 3


def test_a_stored_conversation_is_one_session_unless_the_client_names_its_own(
        make_gateway: GatewayFactory, tmp_path: Path) -> None:
    served = make_gateway(authenticator=TwoProjects(), data_dir=str(tmp_path))
    client = _client(served)
    first = client.responses.create(model=MODEL, input="one")
    second = client.responses.create(model=MODEL, input="two", previous_response_id=first.id)
    client.responses.create(model=MODEL, input="three", previous_response_id=second.id)
    client.responses.create(model=MODEL, input="own", prompt_cache_key="mine",
                            previous_response_id=second.id)
    named = client.responses.create(model=MODEL, input="a", prompt_cache_key="agent-7")
    client.responses.create(model=MODEL, input="b", previous_response_id=named.id)
    client.responses.create(model=MODEL, input="unstored", store=False)
    assert wait_until(lambda: len(served.meter.settled) == 7)
    assert [r.session_id for r in served.meter.settled.values()] == [
        first.id] * 3 + ["mine", "agent-7", "agent-7", None]


def test_each_turn_of_a_conversation_goes_to_the_replica_of_the_turn_before(
        make_gateway: GatewayFactory, tmp_path: Path) -> None:
    """Two replica servers (the fake engine) behind the prefix router: two conversations start at
    once, so on both; each later turn, sent alone to an idle fleet, goes to the replica of its
    conversation (the stored conversation's session credits it with the previous turn's blocks),
    not to the one an idle tie would pick: the session's replica wins the tie (scoring.py; a
    conversation whose first prompt is a prefix of the other's ties on its second turn)."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.server import ReplicaServerSettings
    from tests.engine.server.conftest import ServerThread
    from tests.engine.server.fakes import FakeEngine

    class SyncedFake(FakeEngine):  # a snapshot the prefix router syncs from (no blocks held)
        def kv_snapshot(self) -> dict[str, Any]:
            return {**super().kv_snapshot(), "seq": 0, "block_size": 16}

        def kv_events_since(self, seq: int) -> dict[str, Any]:
            return {"batches": [], "last_seq": 0, "replica_id": self.replica_id}

    engines = [SyncedFake(token_delay_s=0.05, replica_id=f"fake-{i}") for i in range(2)]
    servers = [ServerThread(engine, ReplicaServerSettings()) for engine in engines]
    for server in servers:
        server.start()
    try:
        served = make_gateway(authenticator=TwoProjects(), data_dir=str(tmp_path), router="prefix",
                              models=[{"name": MODEL, "backend": "replica", "upstream_model":
                                       "fake-model", "endpoints": [s.base_url for s in servers]}])
        client = _client(served)
        router = served.app[ROUTER]
        # The fakes send no KV events: the previous turn's blocks are the router's tentative
        # entries, which must outlive a turn on a slow machine (the default 5 s did not, once).
        router.config = dataclasses.replace(router.config, tentative_ttl_s=600.0)
        assert wait_until(lambda: all(
            e.can_serve() and router.consumer(e).is_synced  # type: ignore[attr-defined]
            for e in served.app[FLEET].routes[MODEL].endpoints), 10)

        def new_call() -> int:
            """The replica that got a call since the last look (the turns after the first go
            one at a time)."""
            grown = [n for n, engine in enumerate(engines) if len(engine.calls) > seen[n]]
            seen[:] = [len(engine.calls) for engine in engines]
            assert len(grown) == 1
            return grown[0]

        with ThreadPoolExecutor(2) as pool:  # conversation i's first prompt: 40 + 40 i words
            firsts = list(pool.map(lambda i: client.responses.create(
                model=MODEL, input="word " * (40 + 40 * i)), range(2)))
        by_length = sorted(range(2), key=lambda n: len(engines[n].calls[0].prompt_token_ids))
        where = {i: [by_length[i]] for i in range(2)}
        assert sorted(by_length) == [0, 1]  # (one conversation on each replica)
        seen = [1, 1]
        previous = {i: firsts[i].id for i in range(2)}
        for turn in (1, 2):
            for i in (1, 0):
                previous[i] = client.responses.create(model=MODEL, input=f"turn {turn}",
                                                      previous_response_id=previous[i]).id
                where[i].append(new_call())
        assert all(len(set(replicas)) == 1 for replicas in where.values()), where
    finally:
        for server in servers:
            server.stop()
