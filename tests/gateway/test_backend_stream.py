"""The replica backend over the real aiohttp transport (no wrappers): batched SSE reading keeps
every token, merges what arrived together, and still reports a cut stream as an error."""

from __future__ import annotations

import pytest

from bench.mock_upstream import MockConfig, MockState, create_mock_app
from gateway.backends.openai_compat import _merged
from gateway.canonical import CanonicalRequest, Finish, Message, TextDelta, ToolCallDelta, Usage
from gateway.endpoints import Fleet
from gateway.errors import UpstreamUnavailable
from gateway.settings import GatewaySettings
from gateway.transport import AiohttpTransport
from tests.gateway.conftest import MODEL, LoopThread, start_app


def test_merging_joins_adjacent_text_and_argument_pieces_only() -> None:
    events = [TextDelta("a"), TextDelta("b"), ToolCallDelta(0, "c", "f", "{"),
              ToolCallDelta(0, None, None, "}"), ToolCallDelta(1, "d", "g", ""), Finish("stop")]
    assert _merged(events) == [TextDelta("ab"), ToolCallDelta(0, "c", "f", "{}"),
                               ToolCallDelta(1, "d", "g", ""), Finish("stop")]


async def _stream(upstream: str, stream: bool = True) -> list[object]:
    settings = GatewaySettings(auth_enabled=False, models=[{"name": MODEL, "endpoints": [upstream]}])
    transport = AiohttpTransport()
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
