"""Stored Responses on the real default model (one replica, tests/contract/conftest.py), through a
gateway with two projects, driven by the real openai SDK: a conversation continued with
`previous_response_id`, streamed and not, whose turn n+1 finds all of turn n (its prompt and its
output) in the replica's prefix cache; what is stored validates against OpenAI's spec; another
project sees none of it and warms none of it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from gateway.metering.null_meter import NullMeter
from gateway.settings import GatewaySettings
from gateway.web.app import create_app
from tests.contract.openapi_schema import schema_errors
from tests.gateway.conftest import LoopThread, start_app
from tests.gateway.responses_store.test_stored_responses import TwoProjects

pytestmark = pytest.mark.slow
BLOCK_SIZE = 16  # the replica's KV block, in tokens: only whole blocks are shared


@pytest.fixture(scope="module")
def gateway(default_replica: Any, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[str, str]]:
    loop_thread = LoopThread()
    settings = GatewaySettings(health_interval_s=0.5, first_token_timeout_s=60, idle_timeout_s=30,
                               data_dir=Path(tmp_path_factory.mktemp("stored-responses")),
                               models=[default_replica])
    runner, url = loop_thread.run(start_app(create_app(
        settings, authenticator=TwoProjects(), meter=NullMeter())))
    yield url, default_replica.name
    loop_thread.run(runner.cleanup())
    loop_thread.close()


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _computed_tokens(response: Any) -> int:
    """The tokens of a turn the replica computed KV for, in whole blocks: its prompt and its
    output but the last token (sampled, never fed back)."""
    usage = response.usage
    return (usage.input_tokens + usage.output_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def _spec_errors(schema: str, body: Any) -> list[str]:
    return list(schema_errors(schema, body))


@pytest.mark.parametrize("stream", [False, True])
def test_each_turn_finds_the_whole_previous_conversation_in_the_prefix_cache(
        gateway: tuple[str, str], stream: bool) -> None:
    url, model = gateway
    client = _client(url, "a")
    topic = "streams" if stream else "rivers"  # (the two runs share no prefix past the template)

    def create(**kwargs: Any) -> Any:
        kwargs.update(model=model, temperature=0, max_output_tokens=8,
                      instructions=f"You answer questions about {topic}.")
        if not stream:
            return client.responses.create(**kwargs)
        with client.responses.create(stream=True, **kwargs) as events:
            last = list(events)[-1]  # response.completed, or .incomplete when cut by the limit
        assert last.type in ("response.completed", "response.incomplete")
        return last.response

    turns = [create(input=f"Name one famous {topic[:-1]}.")]
    turns.append(create(input="Where is it?", previous_response_id=turns[-1].id))
    for earlier, later in zip(turns, turns[1:], strict=False):
        assert later.previous_response_id == earlier.id
        assert later.usage.input_tokens > earlier.usage.input_tokens + earlier.usage.output_tokens
        # the whole previous turn, prompt and answer, came from the cache
        assert later.usage.input_tokens_details.cached_tokens == _computed_tokens(earlier), (
            earlier.usage, later.usage)
    http = client._client  # the SDK's own httpx client: raw bodies for the spec check
    headers = {"authorization": "Bearer a"}
    stored = http.get(f"{url}/v1/responses/{turns[-1].id}", headers=headers).json()
    items = http.get(f"{url}/v1/responses/{turns[-1].id}/input_items?order=asc&limit=100",
                     headers=headers).json()
    assert not _spec_errors("Response", stored) and not _spec_errors("ResponseItemList", items)
    replayed = http.get(f"{url}/v1/responses/{turns[-1].id}?stream=true", headers=headers).text
    events = [orjson.loads(block.split("data: ", 1)[1]) for block in replayed.split("\n\n")
              if block]
    assert events[-1]["response"] == stored
    assert not [error for event in events
                for error in _spec_errors("ResponseStreamEvent", event)]
    assert stored["output"][0]["content"][0]["text"] == turns[-1].output_text
    assert [item["role"] for item in items["data"]] == ["user", "assistant", "user"]
    assert items["data"][1]["content"][0]["text"] == turns[0].output_text
    if not stream:  # a later turn does not need the earlier ones
        client.responses.delete(turns[0].id)
        follow = create(input="Thanks.", previous_response_id=turns[-1].id)
        assert follow.usage.input_tokens_details.cached_tokens == _computed_tokens(turns[-1])


def test_another_project_neither_reads_nor_warms_the_conversation(gateway: tuple[str, str]) -> None:
    url, model = gateway
    mine, theirs = _client(url, "a"), _client(url, "b")
    first = mine.responses.create(model=model, input="Name one famous mountain.", temperature=0,
                                  max_output_tokens=8)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError):
        theirs.responses.create(model=model, input="Where is it?", previous_response_id=first.id)
    # B sends the same conversation whole: its own prompt cache holds none of A's blocks
    same = theirs.responses.create(model=model, temperature=0, max_output_tokens=1, input=[
        {"role": "user", "content": "Name one famous mountain."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Where is it?"}])
    assert same.usage.input_tokens_details.cached_tokens == 0
    second = mine.responses.create(model=model, input="Where is it?", temperature=0,
                                   max_output_tokens=1, previous_response_id=first.id)
    assert second.usage.input_tokens == same.usage.input_tokens  # the same prompt, rendered
    assert second.usage.input_tokens_details.cached_tokens == _computed_tokens(first)
