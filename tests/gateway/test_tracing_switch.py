"""Tracing off (AIGW_TRACING=0) is a path chosen once: no span objects on a request, while the
metrics still count it; tracing on still makes the request's spans."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.keys import PIPELINE
from gateway.telemetry.hooks import CountedRouter, TracedRouter
from gateway.telemetry.lean_tracer import LeanTracer
from tests.gateway.conftest import MODEL, Gateway, GatewayFactory

BODY = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def span_starts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Names of every span any tracer starts (start_as_current_span goes through it too)."""
    names: list[str] = []
    original = LeanTracer.start_span

    def counting(self: LeanTracer, name: str, *args: object, **kwargs: object) -> object:
        names.append(name)
        return original(self, name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(LeanTracer, "start_span", counting)
    yield names


def _requests_counted(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("aigw_requests_total{") and 'status="200"' in line
               and "chat/completions" in line)


def _traffic(url: str) -> list[httpx.Response]:
    plain = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10)
    streamed = httpx.post(url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=10)
    assert plain.status_code == streamed.status_code == 200
    assert b"[DONE]" in streamed.content
    return [plain, streamed]


def test_tracing_off_starts_no_span_and_still_counts_requests(
        make_gateway: GatewayFactory, span_starts: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_TRACING", "0")
    gateway = make_gateway()
    responses = _traffic(gateway.url)
    assert span_starts == []
    assert all("x-aigw-trace-id" not in r.headers for r in responses)
    assert _requests_counted(gateway.url) == 2
    assert type(_pipeline_router(gateway)) is CountedRouter  # counts, never traces


def test_tracing_on_traces_each_request(make_gateway: GatewayFactory, span_starts: list[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_TRACING", "1")
    gateway = make_gateway()
    responses = _traffic(gateway.url)
    assert all(r.headers["x-aigw-trace-id"] for r in responses)
    assert span_starts.count("POST /v1/chat/completions") == 2
    assert span_starts.count("gateway.route") == 2
    assert _requests_counted(gateway.url) == 2
    assert isinstance(_pipeline_router(gateway), TracedRouter)


def _pipeline_router(gateway: Gateway) -> object:
    return gateway.app[PIPELINE].router
