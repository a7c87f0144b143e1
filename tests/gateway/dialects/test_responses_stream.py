"""The Responses stream encoder: the final response lists its output items in the order (and with
the ids) they were streamed, so `response.completed.output[i]` is the item of `output_index` i."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.dialects import OpenAIResponses
from gateway.request.canonical import (
    Accumulator,
    CanonicalRequest,
    Finish,
    Message,
    TextDelta,
    ToolCallDelta,
    Usage,
)


def _events(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[len(b"data: "):]) for line in data.split(b"\n")
            if line.startswith(b"data: ")]


def _stream(events: list[Any]) -> list[dict[str, Any]]:
    request = CanonicalRequest("r1", "m", messages=[Message("user", "hi")], stream=True)
    encoder = OpenAIResponses().encoder(request)
    accumulator = Accumulator()
    out = encoder.start()
    for event in events:
        accumulator.add(event)
        if isinstance(event, TextDelta | ToolCallDelta):
            out += encoder.event(event)
    return _events(out + encoder.finish(accumulator.response()))


def test_call_then_text_completes_with_the_items_in_streamed_order() -> None:
    streamed = _stream([ToolCallDelta(0, "call_a", "f", '{"x":1}'), TextDelta("Done."),
                        Finish("tool_calls"), Usage(3, 4)])
    done = [e for e in streamed if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in done] == [0, 1]
    final = streamed[-1]
    assert final["type"] == "response.completed"
    assert final["response"]["output"] == [e["item"] for e in done]
    assert [item["type"] for item in final["response"]["output"]] == ["function_call", "message"]


def test_text_again_after_a_call_is_a_new_item_with_its_own_id() -> None:
    streamed = _stream([TextDelta("Let me see."), ToolCallDelta(0, "call_a", "f", "{}"),
                        TextDelta("Done."), Finish("tool_calls"), Usage(3, 4)])
    output = streamed[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call", "message"]
    assert len({item["id"] for item in output}) == 3
    assert output[2]["content"][0]["text"] == "Done."
    added = [e["item"]["id"] for e in streamed if e["type"] == "response.output_item.added"]
    assert added == [item["id"] for item in output]
