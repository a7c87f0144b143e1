"""The Hermes tool-call parser, whole and streamed."""

from __future__ import annotations

import orjson
import pytest

from chat.tool_parsers import HermesToolParser, get_tool_parser
from chat.tool_parsers.base import ParsedToolCalls, StreamDelta, arguments_schema
from contracts.output_grammar import OutputGrammar

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_single_call_is_extracted_with_json_string_arguments() -> None:
    parsed = HermesToolParser().extract(WEATHER)
    assert parsed.content is None
    (call,) = parsed.tool_calls
    assert call.name == "get_weather"
    assert orjson.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and len(call.id) == 29


def test_several_calls_and_surrounding_text_are_kept_in_order() -> None:
    text = ("Let me check.<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\n"
            "<tool_call>  {\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}  </tool_call>")
    parsed = HermesToolParser().extract(text)
    assert parsed.content == "Let me check.\n"
    assert [c.name for c in parsed.tool_calls] == ["a", "b"]
    assert orjson.loads(parsed.tool_calls[1].arguments) == {"x": 1}
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_malformed_call_stays_content() -> None:
    text = "<tool_call>{not json}</tool_call>"
    parsed = HermesToolParser().extract(text)
    assert parsed.tool_calls == () and parsed.content == text


@pytest.mark.parametrize("end", ["", "\n", "\n<", "\n</tool_ca"])
def test_unterminated_call_is_parsed_at_the_end(end: str) -> None:
    """max_tokens may end an answer before or inside the end tag; the call's JSON is whole."""
    parsed = HermesToolParser().extract('<tool_call>{"name": "a", "arguments": {"k": 2}}' + end)
    assert [c.name for c in parsed.tool_calls] == ["a"] and parsed.content is None


def test_plain_text_without_calls_is_untouched() -> None:
    parsed = HermesToolParser().extract("Just text < with a bracket")
    assert parsed.content == "Just text < with a bracket" and parsed.tool_calls == ()


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streaming_in_any_split_matches_whole_extraction(step: int) -> None:
    text = "Sure.<tool_call>{\"name\":\"a\",\"arguments\":{\"q\":\"<x>\"}}</tool_call> done <"
    stream = HermesToolParser().stream()
    content, names = "", []
    for start in range(0, len(text), step):
        delta = stream.feed(text[start:start + step])
        content += delta.content
        names += [c.name for c in delta.tool_calls]
    rest = stream.finish()
    content += rest.content
    names += [c.name for c in rest.tool_calls]
    whole = HermesToolParser().extract(text)
    assert content == whole.content and names == [c.name for c in whole.tool_calls]


@pytest.mark.parametrize("text", [
    "\n<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\n",  # calls and whitespace
    " \n",  # whitespace alone, no call: it is the answer
    "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\n ok \n",  # text after a call
])
def test_streaming_shows_whitespace_around_calls_only_as_whole_extraction_does(text: str) -> None:
    for step in (1, 3, 1000):
        stream = HermesToolParser().stream()
        content = "".join(stream.feed(text[i:i + step]).content for i in range(0, len(text), step))
        content += stream.finish().content
        assert content == (HermesToolParser().extract(text).content or "")


def test_a_streamed_newline_after_a_call_is_not_sent_as_content() -> None:
    stream = HermesToolParser().stream()
    delta = stream.feed('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>')
    assert [c.name for c in delta.tool_calls] == ["a"]
    assert stream.feed("\n").content == ""
    assert stream.finish() == StreamDelta()


@pytest.mark.parametrize("cut", ["<", "<tool_ca", "<tool_call>", '<tool_call>\n{"name": "get_wea'])
def test_a_call_cut_off_after_complete_calls_is_dropped_not_shown(cut: str) -> None:
    """max_tokens ending the model's next call (a forced call with parallel calls allowed) leaves
    the complete calls and no text, whole and streamed."""
    text = WEATHER + "\n" + cut
    whole = HermesToolParser().extract(text)
    assert whole.content is None and [c.name for c in whole.tool_calls] == ["get_weather"]
    for step in (1, 4, 1000):
        stream = HermesToolParser().stream()
        deltas = ([stream.feed(text[i:i + step]) for i in range(0, len(text), step)]
                  + [stream.finish()])
        assert "".join(d.content for d in deltas) == ""
        assert [c.name for d in deltas for c in d.tool_calls] == ["get_weather"]


def test_a_calls_only_answer_cut_inside_its_first_call_is_no_text() -> None:
    """Decoding constrained to calls (tool_choice required / named) and cut by max_tokens: the
    fragment is no call and no text; an unconstrained answer keeps it as text."""
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert HermesToolParser().extract(cut, is_calls_only=True) == ParsedToolCalls(content=None)
    stream = HermesToolParser().stream(is_calls_only=True)
    assert stream.feed(cut).content == "" and stream.finish() == StreamDelta()
    assert HermesToolParser().extract(cut).content == cut


def test_a_tag_start_after_text_that_follows_a_call_stays_text() -> None:
    parsed = HermesToolParser().extract(WEATHER + " Is 3 < 4 <")
    assert parsed.content == " Is 3 < 4 <" and len(parsed.tool_calls) == 1
    assert HermesToolParser().extract("no call <tool_ca").content == "no call <tool_ca"


def test_streaming_holds_back_a_possible_tag_start() -> None:
    stream = HermesToolParser().stream()
    assert stream.feed("Hi <tool_ca").content == "Hi "
    assert stream.feed("r").content == "<tool_car"


def test_forced_call_arguments_are_objects_whose_local_refs_point_into_their_own_schema() -> None:
    """pydantic's nested models are `$defs` + "#/$defs/X" refs: inside the calls grammar's
    schema they must point below the call's arguments, not at the grammar schema's root."""
    nested = {"type": "object", "$defs": {"Loc": {"type": "object", "properties": {
        "path": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}}}}},
              "properties": {"at": {"$ref": "#/$defs/Loc"},
                             "enum": {"enum": [{"$ref": "#/data"}]}}}  # a property named "enum"
    rebased = arguments_schema(nested, "/x/arguments")
    assert rebased["properties"]["at"] == {"$ref": "#/x/arguments/$defs/Loc"}
    assert rebased["$defs"]["Loc"]["properties"]["kids"]["items"] == {"$ref": "#/x/arguments"}
    assert rebased["properties"]["enum"] == {"enum": [{"$ref": "#/data"}]}  # data is kept
    assert arguments_schema({"properties": {}}, "")["type"] == "object"  # no array arguments
    grammar = HermesToolParser().calls_grammar([("other", {"type": "object"}), ("find", nested)])
    # compiles (it raised: Pointer '/$defs/Loc' does not exist)
    OutputGrammar.lark(grammar, "tools")


def test_unknown_format_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="hermes"):
        get_tool_parser("nope")
