"""A client that hangs up aborts its engine requests at once (streamed or not)."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from tests.engine.server.conftest import ServerThread
from tests.engine.server.fakes import FakeEngine

WAIT_S = 10.0  # upper bound for the server to notice; the test passes as soon as it does


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(reply="tick " * 2000, token_delay_s=0.01, max_model_len=20000)


def test_disconnect_mid_stream_aborts_the_engine_request(http: httpx.Client,
                                                         engine: FakeEngine) -> None:
    body = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "go"}]}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        received = [next(events) for _ in range(4)]  # the role chunk and three tokens
    assert [orjson.loads(e[6:])["choices"][0]["delta"]["content"] for e in received] == [
        "", "t", "i", "c"]
    wait_for_aborts(engine, 1)
    assert engine.aborted == [engine.calls[0].request_id]


def wait_for_aborts(engine: FakeEngine, num_aborts: int) -> None:
    """Block until the fake has recorded `num_aborts` aborts, or WAIT_S has passed."""
    deadline = time.monotonic() + WAIT_S
    while len(engine.aborted) < num_aborts and time.monotonic() < deadline:
        engine.aborted_event.wait(0.05)


def test_disconnect_of_a_non_streaming_request_aborts_every_choice(
        server: ServerThread, engine: FakeEngine) -> None:
    body = {"model": "fake-model", "n": 2, "messages": [{"role": "user", "content": "go"}]}
    with httpx.Client(base_url=server.base_url) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=body, timeout=0.5)
    wait_for_aborts(engine, 2)
    assert sorted(engine.aborted) == sorted(call.request_id for call in engine.calls)
    assert len(engine.aborted) == 2


def test_an_aborted_request_still_leaves_its_replica_span_and_is_counted(
        http: httpx.Client, engine: FakeEngine) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    body = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "go"}]}
    with http.stream("POST", "/v1/chat/completions", json=body,
                     headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        [next(events) for _ in range(4)]
    wait_for_aborts(engine, 1)
    deadline = time.monotonic() + WAIT_S
    while not (spans := http.get("/debug/traces", params={"trace_id": trace_id}).json()["spans"]):
        assert time.monotonic() < deadline, "no replica span for the aborted request"
        time.sleep(0.05)
    by_name = {s["name"]: s for s in spans}
    root = by_name["replica.generate"]
    assert root["parent_span_id"] == "00f067aa0ba902b7" and root["status"] == "UNSET"
    assert root["attributes"]["gen_ai.response.finish_reasons"] == ["abort"]
    assert root["attributes"]["gen_ai.usage.output_tokens"] >= 3
    assert by_name["engine.decode"]["parent_span_id"] == root["span_id"]
    assert 'aigw_replica_requests_total{finish_reason="abort"' in http.get("/metrics").text
