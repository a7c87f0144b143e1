"""Llama 4's tool calls: pythonic lists (`[get_weather(city="Paris")]`), with or without the
`<|python_start|>` markers, and its JSON spelling; whole and streamed in any split; the forced-call
grammar; the format chosen for llama4 checkpoints."""

from __future__ import annotations

import orjson
import pytest

from chat.registry import HERMES, LLAMA4, chat_format_for
from chat.tokenizer import load_tokenizer
from chat.tool_parsers import Llama4PythonicToolParser, PythonicToolParser, get_tool_parser
from chat.tool_parsers.base import ParsedToolCalls
from engine.loader import default_model_path
from engine.structured_output import GrammarCompiler, OutputGrammar

NESTED = ('[search(q="a, b] (c)", filters={"tags": ["x", "y\'s"], "range": [-1, 2.5e3]}, '
          "exact=True, limit=None, note='say \"hi\"'), get_time()]")
NESTED_CALLS = [("search", {"q": "a, b] (c)",
                            "filters": {"tags": ["x", "y's"], "range": [-1, 2500.0]},
                            "exact": True, "limit": None, "note": 'say "hi"'}),
                ("get_time", {})]
ANSWERS = [  # (answer, its content, its calls) as Llama 4 may write them
    (NESTED, None, NESTED_CALLS),
    ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look.<|python_start|>[a(x=1)]<|python_end|> Done.', "Let me look. Done.",
     [("a", {"x": 1})]),
    ("\n  [f(s='''multi\nline)''', u='caf\\u00e9', n=-3, b=false)]\n", None,
     [("f", {"s": "multi\nline)", "u": "café", "n": -3, "b": False})]),
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "t", "parameters": {}}',
     None, [("get_weather", {"city": "Rome"}), ("t", {})]),
    ("[f(x=1), g(y=2),]", None, [("f", {"x": 1}), ("g", {"y": 2})]),  # a trailing comma
    ('[brave-search(q="x"), mcp.fetch(url="u")]', None,  # names Python would not take
     [("brave-search", {"q": "x"}), ("mcp.fetch", {"url": "u"})]),
    ("The weather is sunny.", "The weather is sunny.", []),
]


def _calls(parsed: ParsedToolCalls) -> list[tuple[str, object]]:
    return [(c.name, orjson.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.mark.parametrize(("answer", "content", "calls"), ANSWERS)
def test_calls_are_extracted_with_json_arguments(answer: str, content: str | None,
                                                 calls: list[tuple[str, object]]) -> None:
    parsed = Llama4PythonicToolParser().extract(answer)
    assert parsed.content == content and _calls(parsed) == calls
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)


@pytest.mark.parametrize(("answer", "content", "calls"), ANSWERS)
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streaming_split_anywhere_matches_whole_extraction(
        answer: str, content: str | None, calls: list[tuple[str, object]], step: int) -> None:
    stream = Llama4PythonicToolParser().stream()
    shown, streamed = "", []
    for i in range(0, len(answer), step):
        delta = stream.feed(answer[i:i + step])
        assert "<|python" not in delta.content and "[a(" not in delta.content
        shown += delta.content
        streamed += delta.tool_calls
    rest = stream.finish()
    shown, streamed = shown + rest.content, streamed + list(rest.tool_calls)
    assert shown == (content or "")
    assert [(c.name, orjson.loads(c.arguments)) for c in streamed] == calls


def test_each_call_is_released_when_its_element_of_the_list_ends() -> None:
    stream = PythonicToolParser().stream()
    assert stream.feed('[get_weather(city="Paris")').tool_calls == ()
    (first,) = stream.feed(", ").tool_calls
    assert first.name == "get_weather"
    assert stream.feed('get_time(tz="UTC")').tool_calls == ()
    (second,) = stream.feed("]").tool_calls
    assert second.name == "get_time" and stream.finish().content == ""


@pytest.mark.parametrize("text", [
    "[1, 2, 3]", "[]", "[f(1)]", "[f(x=g())]", "[f(x=y)]", "[obj.(x=1)]", "[f(**k)]", "[-f(x=1)]",
    "[f(x=1) g(y=2)]", "[f(x=1]", "[f(x={1: 2})]", "[f(x=b'raw')]", "[f(x=1j)]", "[f(x=1+2)]",
    "[f(x=f'{y}')]", "[f(x=" + "9" * 30 + ")]", "[f(x=" + "[" * 150 + "]" * 150 + ")]",
    "[f(x=1, x=2)]", "[see [1]]", "{not json}", '{"name": 3, "parameters": {}}',
    "[f(x=1)] is how you would call it",  # a list, then text: the calls and the text
    "<|python_start|>no list here",
])
def test_malformed_calls_stay_content(text: str) -> None:
    for parser in (Llama4PythonicToolParser(), PythonicToolParser()):
        parsed = parser.extract(text)
        if text.startswith("[f(x=1)] is"):
            assert parsed.content == " is how you would call it" and len(parsed.tool_calls) == 1
        else:
            assert parsed == ParsedToolCalls(content=text), text
        stream = parser.stream()
        shown = "".join(stream.feed(ch).content for ch in text) + stream.finish().content
        assert shown == (parsed.content or "")


def test_tool_names_with_hyphens_and_dots_are_calls() -> None:
    """OpenAI's tool names may hold "-", MCP clients name tools "server.tool"; Python would not."""
    parsed = PythonicToolParser().extract('[brave-search(q="x"), github.list_issues(repo="a/b")]')
    assert _calls(parsed) == [("brave-search", {"q": "x"}), ("github.list_issues", {"repo": "a/b"})]
    assert PythonicToolParser().extract("[a - f(x=1)]").tool_calls == ()  # an expression


def test_an_element_that_is_no_call_after_calls_is_content_and_the_calls_before_it_stay() -> None:
    parsed = PythonicToolParser().extract("[f(x=1), 3, g(y=2)]")
    assert _calls(parsed) == [("f", {"x": 1})] and parsed.content == " 3, g(y=2)]"


def test_the_plain_pythonic_parser_reads_no_json_calls() -> None:
    text = '{"name": "a", "parameters": {}}'
    assert PythonicToolParser().extract(text).content == text
    assert [c.name for c in Llama4PythonicToolParser().extract(text).tool_calls] == ["a"]


@pytest.mark.parametrize("cut", ['[f(x=1), g(y="Pa', "[f(x=1), ", '[f(x=1)', "[f(x=1)]<|python_e"])
def test_a_list_cut_by_max_tokens_keeps_its_complete_calls(cut: str) -> None:
    parsed = Llama4PythonicToolParser().extract(cut)
    assert [c.name for c in parsed.tool_calls] == ["f"] and parsed.content is None


def test_a_first_call_cut_by_max_tokens_is_text_unless_decoding_was_constrained_to_calls() -> None:
    cut = '[get_weather(city="Par'
    assert Llama4PythonicToolParser().extract(cut).content == cut
    assert Llama4PythonicToolParser().extract(cut, is_calls_only=True) == ParsedToolCalls(None)


def test_text_that_only_starts_like_the_marker_is_shown_once_it_is_not_one() -> None:
    stream = Llama4PythonicToolParser().stream()
    assert stream.feed("Hi <|python_").content == "Hi "
    assert stream.feed("x|>").content == "<|python_x|>"


def test_llama4_checkpoints_speak_the_pythonic_format() -> None:
    assert chat_format_for("llama4_text") is LLAMA4 and chat_format_for("llama4") is LLAMA4
    template = "{{ '<|header_start|>' + messages[0]['role'] + '<|header_end|>' }}"
    assert chat_format_for("llama", template) is LLAMA4  # the template says it first
    assert chat_format_for("llama") is HERMES
    assert isinstance(get_tool_parser(LLAMA4.tool_parser), Llama4PythonicToolParser)
    parser = LLAMA4.output_parser(uses_tools=True)
    out = parser.feed([1], '[get_weather(city="Paris")]') + parser.finish()
    assert [c.name for c in out.tool_calls] == ["get_weather"] and out.content == ""


@pytest.fixture(scope="module")
def compiler_and_tokenizer():  # type: ignore[no-untyped-def]
    tokenizer = load_tokenizer(default_model_path())
    return (GrammarCompiler(tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_ids),
            tokenizer)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city"]}
OPTIONAL_ONLY = {"type": "object", "$defs": {"Tz": {"type": "string", "pattern": "^[A-Z]+$"}},
                 "properties": {"tz": {"$ref": "#/$defs/Tz"}, "utc": {"type": "boolean"}}}


@pytest.mark.parametrize(("text", "is_admitted"), [
    ('[get_weather(city="Paris")]', True),
    ('[get_weather(city="Paris", days=3, unit="F")]', True),
    ('[get_weather(city="Paris", unit="F"), get_time()]', True),
    ('[get_time(utc=true), get_time(tz="UTC", utc=false)]', True),
    ('[get_weather(days=3)]', False),  # the required city is missing
    ('[get_weather(city="Paris", unit="K")]', False),
    ('[get_weather(city=3)]', False),
    ('[get_time(tz="utc")]', False),  # the $ref'd pattern holds
    ('[other(x=1)]', False),
    ('Sure. [get_time()]', False),
])
def test_the_forced_calls_grammar_admits_calls_that_follow_the_schemas(
        compiler_and_tokenizer, text: str, is_admitted: bool) -> None:  # type: ignore[no-untyped-def]
    compiler, tokenizer = compiler_and_tokenizer
    grammar = LLAMA4.calls_grammar([("get_weather", WEATHER), ("get_time", OPTIONAL_ONLY)])
    matcher = compiler.matcher(OutputGrammar.lark(grammar, "tools"))
    admitted = all(matcher.accept(t) for t in tokenizer.encode(text))
    assert admitted is is_admitted
    if is_admitted:
        assert Llama4PythonicToolParser().extract(text, is_calls_only=True).tool_calls


def test_the_single_call_grammar_admits_one_call() -> None:
    grammar = LLAMA4.calls_grammar([("get_time", None)], is_parallel=False)
    assert grammar.startswith('start: "[" call "]"')
    OutputGrammar.lark(grammar, "tools")


def test_a_forced_call_whose_parameters_python_cannot_name_is_decoded_as_llama4_json(
        compiler_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """`user-id=` is no Python keyword argument: the grammar writes Meta's JSON calls instead,
    which the llama4 parser reads."""
    compiler, tokenizer = compiler_and_tokenizer
    schema = {"type": "object",
              "properties": {"from": {"type": "string"}, "user-id": {"type": "integer"}},
              "required": ["from"]}
    grammar = LLAMA4.calls_grammar([("trips", schema)])
    text = ('{"name": "trips", "parameters": {"from": "Oslo", "user-id": 7}}; '
            '{"name": "trips", "parameters": {"from": "Rome"}}')
    matcher = compiler.matcher(OutputGrammar.lark(grammar, "tools"))
    assert all(matcher.accept(t) for t in tokenizer.encode(text))
    parsed = Llama4PythonicToolParser().extract(text, is_calls_only=True)
    assert (_calls(parsed)
            == [("trips", {"from": "Oslo", "user-id": 7}), ("trips", {"from": "Rome"})])
    for pythonic in ({"properties": {"to": {}}}, {"properties": {"from": {}}}):
        assert LLAMA4.calls_grammar([("trips", pythonic)]).startswith('start: "["')


def test_python_keywords_as_parameter_names_are_read() -> None:
    """An email tool's `from`: Python refuses `f(from=...)`, the parser reads it."""
    parsed = PythonicToolParser().extract('[send(from="a@b.c", to="d@e.f", note="from=1")]')
    assert _calls(parsed) == [("send", {"from": "a@b.c", "to": "d@e.f", "note": "from=1"})]
    assert PythonicToolParser().extract("[f(x=from)]").tool_calls == ()  # a keyword as a value


@pytest.mark.parametrize("text",
                         ["[Don't worry, it is fine.", "[Note to self] buy milk", '["a", "b"]'])
def test_text_that_opens_with_a_bracket_streams_as_soon_as_it_cannot_be_a_call(text: str) -> None:
    """A string or a second word where a call's name belongs: the answer is prose, shown at once
    (not held to the end of the answer)."""
    stream = Llama4PythonicToolParser().stream()
    assert stream.feed(text).content == text and stream.finish().content == ""
