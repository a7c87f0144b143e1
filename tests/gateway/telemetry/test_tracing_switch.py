"""Tracing off (AIGW_TRACING=0) is a path chosen once: no trace on a request, while the metrics
still count it; tracing on still records each request's trace and builds its spans when read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.telemetry import middleware
from gateway.telemetry.keys import TELEMETRY
from gateway.telemetry.request_trace import RequestTrace
from tests.gateway.conftest import MODEL, GatewayFactory, wait_until

BODY = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def traces_started(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RequestTrace]]:
    """Every RequestTrace the gateway starts (tracing on, sampled)."""
    started: list[RequestTrace] = []
    original = middleware._observe

    def recording(*args: Any) -> Any:
        observer = original(*args)
        if observer.trace is not None:  # (the request's observer: its trace, when sampled)
            started.append(observer.trace)
        return observer

    monkeypatch.setattr(middleware, "_observe", recording)
    yield started


def _requests_counted(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("aigw_requests_total{") and 'status="200"' in line
               and "chat/completions" in line)


def _routing_decisions_counted(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("aigw_routing_decisions_total{"))


def _traffic(url: str) -> list[httpx.Response]:
    plain = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10)
    streamed = httpx.post(url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=10)
    assert plain.status_code == streamed.status_code == 200
    assert b"[DONE]" in streamed.content
    return [plain, streamed]


def test_tracing_off_starts_no_trace_and_still_counts_requests(
        make_gateway: GatewayFactory, traces_started: list[RequestTrace],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_TRACING", "0")
    gateway = make_gateway()
    responses = _traffic(gateway.url)
    assert traces_started == [] and gateway.app[TELEMETRY].spans.recent() == []
    assert all("x-aigw-trace-id" not in r.headers for r in responses)
    assert _requests_counted(gateway.url) == 2
    assert _routing_decisions_counted(gateway.url) == 2  # counted, never traced


def test_tracing_on_traces_each_request(make_gateway: GatewayFactory,
                                        traces_started: list[RequestTrace],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_TRACING", "1")
    gateway = make_gateway()
    responses = _traffic(gateway.url)
    assert [r.headers["x-aigw-trace-id"] for r in responses] == [
        f"{t.context.trace_id:032x}" for t in traces_started]
    assert all(t._spans is None for t in traces_started)  # no span built until read
    buffer = gateway.app[TELEMETRY].spans
    for response in responses:  # (the trace is handed over just after the answer is sent)
        trace_id = response.headers["x-aigw-trace-id"]
        assert wait_until(lambda trace_id=trace_id: buffer.trace(trace_id))
        names = [s["name"] for s in buffer.trace(trace_id)]
        assert names.count("POST /v1/chat/completions") == 1 and names.count("gateway.route") == 1
    assert _requests_counted(gateway.url) == 2
