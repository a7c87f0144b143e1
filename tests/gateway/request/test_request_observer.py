"""The request's observer (gateway/request/observer.py) is told each fact of a request once, in
the pipeline's order, by the step that makes it; the tracing observer's CLIENT span is the one
whose id the upstream received."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.request.observer import UpstreamCallObserver
from gateway.telemetry import middleware
from gateway.telemetry.observers import RequestMetrics, RequestTracing
from tests.gateway.conftest import MODEL, GatewayFactory, wait_until

BODY = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


class _Told:
    """What each request's observer was told, by method name, in order."""

    def __init__(self) -> None:
        self.facts: list[list[str]] = []


def _recording(kind: type[RequestMetrics], told: list[str]) -> type[RequestMetrics]:
    names = ("on_authenticated", "on_admitting", "on_admitted", "on_routed", "on_fallback",
             "on_refused", "on_upstream_call", "on_first_token", "on_cache_turn", "on_settled",
             "on_usage")

    def wrap(name: str) -> Any:
        def method(self: Any, *args: Any) -> Any:
            told.append(name)
            result = getattr(kind, name)(self, *args)
            if name == "on_upstream_call" and result is not None:
                told.append("traceparent" if "traceparent" in args[0].headers else "no traceparent")
            return result
        return method

    return type(f"Recording{kind.__name__}", (kind,),
                {"__slots__": (), **{name: wrap(name) for name in names}})


@pytest.fixture
def told(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Told]:
    recorded = _Told()
    original = middleware._observe

    def observe(*args: Any) -> RequestMetrics:
        observer = original(*args)
        facts: list[str] = []
        recorded.facts.append(facts)
        observer.__class__ = _recording(type(observer), facts)  # (same slots: a subclass)
        return observer

    monkeypatch.setattr(middleware, "_observe", observe)
    yield recorded


@pytest.mark.parametrize("stream", [False, True])
def test_each_step_tells_the_observer_once_in_the_pipelines_order(
        make_gateway: GatewayFactory, told: _Told, stream: bool) -> None:
    gateway = make_gateway()
    response = httpx.post(gateway.url + "/v1/chat/completions", json={**BODY, "stream": stream},
                          timeout=10)
    assert response.status_code == 200
    assert wait_until(lambda: told.facts and "on_settled" in told.facts[-1])
    expected = ["on_authenticated", "on_admitting", "on_admitted", "on_routed",
                "on_upstream_call", "traceparent"]
    if stream:
        expected.append("on_first_token")
    assert told.facts[-1] == [*expected, "on_settled"]


def test_a_refused_request_is_told_its_authentication_and_nothing_after(
        make_gateway: GatewayFactory, told: _Told) -> None:
    gateway = make_gateway()
    response = httpx.post(gateway.url + "/v1/chat/completions",
                          json={**BODY, "model": "no-such-model"}, timeout=10)
    assert response.status_code == 404
    assert told.facts[-1] == ["on_authenticated"]


def test_the_upstream_call_observer_ends_its_span(make_gateway: GatewayFactory,
                                                  told: _Told) -> None:
    gateway = make_gateway()
    calls: list[UpstreamCallObserver] = []
    original = RequestTracing.on_upstream_call

    def keep(self: RequestTracing, upstream: Any) -> UpstreamCallObserver | None:
        call = original(self, upstream)
        if call is not None:
            calls.append(call)
        return call

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RequestTracing, "on_upstream_call", keep)
        response = httpx.post(gateway.url + "/v1/chat/completions",
                              json={**BODY, "stream": True}, timeout=10)
    assert response.status_code == 200
    (call,) = calls
    assert wait_until(lambda: getattr(call, "end_ns", None) is not None)
    assert getattr(call, "status_code", None) == 200
    assert getattr(call, "first_line_ns", None) is not None
    assert getattr(call, "exception", None) is None
