"""The replica backend over the real upstream transport (LeanTransport, no wrappers): batched SSE
reading keeps every token, merges what arrived together, and still reports a cut stream as an
error."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from bench.mock_upstream import MockConfig, MockState, create_mock_app
from gateway.backends.openai_compat import _merged
from gateway.dialects import OpenAIChat, OpenAICompletions
from gateway.fleet.endpoints import Fleet
from gateway.request.canonical import (
    Accumulator,
    CanonicalRequest,
    Finish,
    Message,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from gateway.request.errors import UpstreamUnavailable
from gateway.settings import GatewaySettings
from gateway.upstream.lean_transport import LeanTransport
from gateway.upstream.transport import MockResponse, MockTransport, UpstreamRequest
from tests.gateway.conftest import MODEL, LoopThread, start_app


def test_merging_joins_adjacent_text_and_argument_pieces_only() -> None:
    events = [TextDelta("a"), TextDelta("b"), ToolCallDelta(0, "c", "f", "{"),
              ToolCallDelta(0, None, None, "}"), ToolCallDelta(1, "d", "g", ""), Finish("stop")]
    assert _merged(events) == [TextDelta("ab"), ToolCallDelta(0, "c", "f", "{}"),
                               ToolCallDelta(1, "d", "g", ""), Finish("stop")]


async def _stream(upstream: str, stream: bool = True) -> list[object]:
    settings = GatewaySettings(auth_enabled=False,
                               models=[{"name": MODEL, "endpoints": [upstream]}])
    transport = LeanTransport()
    try:
        route = Fleet(settings, transport).get(MODEL)
        assert route is not None
        request = CanonicalRequest("r", MODEL, messages=[Message("user", "hi")], stream=stream)
        return [e async for e in route.backend.stream(request, route.endpoints[0])]
    finally:
        await transport.aclose()


def test_batched_stream_keeps_every_token_and_usage(loop_thread: LoopThread) -> None:
    runner, url = loop_thread.run(start_app(create_mock_app(MockState(MockConfig(num_tokens=50)))))
    try:
        events = loop_thread.run(_stream(url))
    finally:
        loop_thread.run(runner.cleanup())
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == "tok " * 50
    assert events[-2:] == [Finish("stop"), Usage(1, 50, 0)]


def test_batched_stream_cut_mid_way_is_an_error(loop_thread: LoopThread) -> None:
    config = MockConfig(num_tokens=50, fail_mode="mid_stream", fail_after_tokens=10)
    runner, url = loop_thread.run(start_app(create_mock_app(MockState(config))))
    try:
        with pytest.raises(UpstreamUnavailable):
            loop_thread.run(_stream(url))
    finally:
        loop_thread.run(runner.cleanup())


def _sse(*chunks: dict[str, object]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_n_choices_keep_their_own_text_tool_calls_and_finish_and_render_as_openai_choices() -> None:
    """An upstream asked for n=2 interleaves its choices; each keeps its own deltas (merged only
    within a choice), ends with its own Finish, and both dialects render them in order."""
    body = _sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]},
        {"choices": [{"index": 1, "delta": {"content": "Bon"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        {"choices": [{"index": 1, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {
            "name": "f", "arguments": "{}"}}]}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}})
    sent: list[UpstreamRequest] = []

    async def answer(request: UpstreamRequest) -> MockResponse:
        sent.append(request)
        return MockResponse(200, body)

    request = CanonicalRequest("r", MODEL, messages=[Message("user", "hi")], stream=True, n=2)

    async def run() -> list[object]:
        settings = GatewaySettings(auth_enabled=False,
                                   models=[{"name": MODEL, "endpoints": ["http://u:1"]}])
        route = Fleet(settings, MockTransport(answer)).get(MODEL)
        assert route is not None
        return [e async for e in route.backend.stream(request, route.endpoints[0])]

    events = asyncio.run(run())
    assert orjson.loads(sent[0].body or b"")["n"] == 2
    assert events[-3:] == [Finish("stop", None, 0), Finish("tool_calls", None, 1), Usage(5, 7, 0)]
    accumulator = Accumulator()
    for event in events:
        accumulator.add(event)  # type: ignore[arg-type]
    response = accumulator.response()
    assert (response.text, response.finish_reason) == ("Hello", "stop")
    assert [(o.text, o.tool_calls[0].name) for o in response.others] == [("Bon", "f")]
    chat = OpenAIChat().render(request, response)
    assert ([(c["index"], c["finish_reason"]) for c in chat["choices"]]
            == [(0, "stop"), (1, "tool_calls")])
    encoder = OpenAIChat().encoder(request)
    streamed = encoder.start() + b"".join(encoder.event(e) for e in events[:-3])  # type: ignore[arg-type]
    streamed += encoder.finish(response)
    chunks = [orjson.loads(line[6:]) for line in streamed.split(b"\n\n")
              if line.startswith(b"data: {")]
    roles = [c["choices"][0]["index"] for c in chunks
             if c["choices"] and "role" in c["choices"][0]["delta"]]
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]]
    assert roles == [0, 1] and finishes == [(0, "stop"), (1, "tool_calls")]
    completion = CanonicalRequest("r", MODEL, kind="completion", prompt="hi", n=2)
    assert ([c["index"] for c in OpenAICompletions().render(completion, response)["choices"]]
            == [0, 1])
