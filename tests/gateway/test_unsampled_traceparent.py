"""A request the gateway does not sample still tells its upstream so (a `traceparent` with flags
00), so that a replica's parent-based sampler records nothing for it instead of starting a trace of
its own (an orphan replica-only trace per unsampled request)."""

from __future__ import annotations

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
    seen: list[str | None] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(request.headers.get("traceparent"))
        return web.json_response(COMPLETION)

    _, upstream_url = start_chat_upstream(loop_thread, chat)
    gateway = make_gateway(models=[{"name": MODEL, "backend": "replica", "endpoints": [upstream_url]}])
    return gateway.url, seen


def test_a_request_not_sampled_sends_an_unsampled_traceparent_upstream(
        make_gateway: GatewayFactory, loop_thread: LoopThread,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_TRACE_SAMPLE_RATIO", "0")
    url, seen = _gateway_recording_traceparents(make_gateway, loop_thread)
    response = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10)
    assert response.status_code == 200 and "x-aigw-trace-id" not in response.headers
    [traceparent] = seen
    assert traceparent is not None and traceparent.startswith("00-") and traceparent.endswith("-00")


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
