"""The trace context a request carries upstream (`traceparent`, `tracestate`): a caller's trace is
continued, tracing off sends none, and a request the gateway does not sample (its own choice, the
caller's, or over the new-trace rate limit) still tells its upstream so (a `traceparent` with flags
00), so that a replica's parent-based sampler records nothing for it instead of starting a trace of
its own (an orphan replica-only trace per unsampled request)."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from aiohttp import web

from tests.gateway.conftest import MODEL, GatewayFactory, LoopThread, start_chat_upstream

BODY = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"id": "c1", "object": "chat.completion", "created": 0, "model": MODEL,
              "choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant", "content": "ok"}}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def _gateway_recording_traceparents(make_gateway: GatewayFactory, loop_thread: LoopThread
                                    ) -> tuple[str, list[str | None]]:
    """A gateway in front of an upstream that records each call's `traceparent`."""
    url, seen, _ = _gateway_recording_trace_headers(make_gateway, loop_thread)
    return url, seen


def _gateway_recording_trace_headers(make_gateway: GatewayFactory, loop_thread: LoopThread
                                     ) -> tuple[str, list[str | None], list[str | None]]:
    seen: list[str | None] = []
    states: list[str | None] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(request.headers.get("traceparent"))
        states.append(request.headers.get("tracestate"))
        return web.json_response(COMPLETION)

    _, upstream_url = start_chat_upstream(loop_thread, chat)
    gateway = make_gateway(models=[{"name": MODEL, "backend": "replica",
                                    "endpoints": [upstream_url]}])
    return gateway.url, seen, states


def test_a_request_not_sampled_sends_an_unsampled_traceparent_upstream(
        make_gateway: GatewayFactory, loop_thread: LoopThread,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_TRACE_SAMPLE_RATIO", "0")
    url, seen = _gateway_recording_traceparents(make_gateway, loop_thread)
    response = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10)
    assert response.status_code == 200 and "x-aigw-trace-id" not in response.headers
    [traceparent] = seen
    assert traceparent is not None
    version, trace_id, parent_id, flags = traceparent.split("-")
    assert version == "00" and int(trace_id, 16) and int(parent_id, 16)
    assert not int(flags, 16) & 1  # not sampled (W3C level 2 may set 0x02, "random trace id")


def test_a_callers_unsampled_decision_and_trace_id_are_passed_on(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    url, seen = _gateway_recording_traceparents(make_gateway, loop_thread)
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    response = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10,
                          headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-00"})
    assert response.status_code == 200 and "x-aigw-trace-id" not in response.headers
    [traceparent] = seen
    version, sent_trace_id, parent_id, flags = traceparent.split("-")
    assert (version, sent_trace_id, flags) == ("00", trace_id, "00")
    assert parent_id != "b7ad6b7169203331" and int(parent_id, 16) != 0


def test_tracing_off_sends_no_traceparent(make_gateway: GatewayFactory, loop_thread: LoopThread,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_TRACING", "0")
    url, seen = _gateway_recording_traceparents(make_gateway, loop_thread)
    assert httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10).status_code == 200
    assert seen == [None]


def test_new_traces_over_the_rate_limit_are_not_sampled_and_say_so_upstream(
        make_gateway: GatewayFactory, loop_thread: LoopThread,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """AIGW_TRACE_MAX_PER_S=2: a burst of 8 new requests gets 2 traces (plus what refills while
    it runs); the rest are answered and counted as usual, untraced, and tell the upstream so. A
    caller's sampled traceparent is continued whatever the limit."""
    monkeypatch.setenv("AIGW_TRACE_MAX_PER_S", "2")
    url, seen = _gateway_recording_traceparents(make_gateway, loop_thread)
    with httpx.Client(timeout=10) as client:
        started = time.monotonic()
        responses = [client.post(url + "/v1/chat/completions", json=BODY) for _ in range(8)]
        elapsed_s = time.monotonic() - started
        assert all(r.status_code == 200 for r in responses)
        num_traced = sum("x-aigw-trace-id" in r.headers for r in responses)
        assert 2 <= num_traced <= 2 + int(elapsed_s * 2) + 1
        sampled_upstream = [int(tp.rsplit("-", 1)[1], 16) & 1 for tp in seen if tp is not None]
        assert len(sampled_upstream) == 8 and sum(sampled_upstream) == num_traced
        assert len({tp.split("-")[1] for tp in seen if tp is not None}) == 8  # a trace id each
        caller_trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        continued = [client.post(url + "/v1/chat/completions", json=BODY, headers={
            "traceparent": f"00-{caller_trace_id}-00f067aa0ba902b7-01"}) for _ in range(4)]
    assert [r.headers.get("x-aigw-trace-id") for r in continued] == [caller_trace_id] * 4


def test_a_callers_tracestate_goes_upstream_with_the_continued_trace(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    url, _, states = _gateway_recording_trace_headers(make_gateway, loop_thread)
    caller = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
              "tracestate": "vendor=opaque"}
    assert httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10,
                      headers=caller).status_code == 200
    assert httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10).status_code == 200
    assert states == ["vendor=opaque", None]  # a new trace has no state to pass on


def test_a_callers_tracestate_goes_upstream_with_its_unsampled_decision(
        make_gateway: GatewayFactory, loop_thread: LoopThread) -> None:
    """W3C trace context: a received `tracestate` is sent on to outgoing requests, whatever the
    sampled flag (it was dropped when the caller's traceparent said flags 00)."""
    url, seen, states = _gateway_recording_trace_headers(make_gateway, loop_thread)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    caller = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-00", "tracestate": "vendor=opaque"}
    response = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10, headers=caller)
    assert response.status_code == 200 and "x-aigw-trace-id" not in response.headers
    [traceparent], [tracestate] = seen, states
    assert traceparent is not None and traceparent.split("-")[1::2] == [trace_id, "00"]
    assert tracestate == "vendor=opaque"


def test_a_malformed_tracestate_is_dropped_without_a_log_line_per_request(
        make_gateway: GatewayFactory, loop_thread: LoopThread,
        caplog: pytest.LogCaptureFixture) -> None:
    url, seen = _gateway_recording_traceparents(make_gateway, loop_thread)
    caller = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
              "tracestate": "bad key!!=x" * 200}
    with caplog.at_level(logging.WARNING):
        response = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10, headers=caller)
    assert response.status_code == 200
    assert response.headers["x-aigw-trace-id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]
