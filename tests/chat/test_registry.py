"""The registry picks a checkpoint's chat format from its template, then its architecture; forced
tool calls get that format's grammar, which closes the tool's parameter object."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from chat.registry import HARMONY, HERMES, QWEN3, chat_format_for
from chat.tokenizer import load_tokenizer
from chat.tool_parsers.base import arguments_schema
from engine.loader import default_model_path
from engine.structured_output import GrammarCompiler, OutputGrammar

DATA = Path(__file__).parent / "data"
# what LangChain sends for a pydantic tool: no additionalProperties anywhere
LANGCHAIN_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "description": "The city"},
    "unit": {"type": "object", "properties": {"name": {"type": "string"}}}},
    "required": ["city"]}


@pytest.fixture(scope="module")
def smollm2():  # type: ignore[no-untyped-def]
    return load_tokenizer(default_model_path())


def test_formats_follow_the_template_first_and_the_architecture_second(smollm2) -> None:  # type: ignore[no-untyped-def]
    qwen3 = (DATA / "qwen3.jinja").read_text()
    assert chat_format_for("qwen3", qwen3) is QWEN3
    assert chat_format_for("qwen3_moe", qwen3) is QWEN3
    assert chat_format_for("gpt_oss", (DATA / "gpt_oss.jinja").read_text()) is HARMONY
    assert chat_format_for("llama", smollm2.chat_template.source) is HERMES  # SmolLM2
    no_think = qwen3.replace("<think>", "").replace("</think>", "")  # an Instruct-2507 template
    assert chat_format_for("qwen3", no_think) is HERMES
    assert chat_format_for("gpt_oss") is HARMONY and chat_format_for("qwen3_moe") is QWEN3
    # a gpt_oss checkpoint whose vocabulary is not harmony's (a tiny test tokenizer)
    assert chat_format_for("gpt_oss", None, smollm2.token_to_id) is HERMES
    assert chat_format_for("gpt_oss", None, {"<|channel|>": 200005}.get) is HARMONY
    assert chat_format_for("some_new_family") is HERMES


def test_a_forced_calls_schema_is_closed_unless_it_says_otherwise() -> None:
    closed = arguments_schema(LANGCHAIN_SCHEMA, "")
    assert closed["additionalProperties"] is False
    assert closed["properties"]["unit"]["additionalProperties"] is False  # a record below it too
    assert "additionalProperties" not in closed["properties"]["city"]
    open_ = arguments_schema({**LANGCHAIN_SCHEMA, "additionalProperties": True}, "")
    assert open_["additionalProperties"] is True
    free_map = arguments_schema({"type": "object", "properties": {
        "tags": {"type": "object", "additionalProperties": {"type": "string"}}}}, "")
    assert free_map["properties"]["tags"]["additionalProperties"] == {"type": "string"}


def _accepts(compiler: GrammarCompiler, grammar: str, text: str, tokenizer) -> bool:  # type: ignore[no-untyped-def]
    matcher = compiler.matcher(OutputGrammar.lark(grammar, "tools"))
    return all(matcher.accept(t) for t in tokenizer.encode(text))


def test_a_think_formats_forced_call_may_reason_first_and_cannot_add_keys(smollm2) -> None:  # type: ignore[no-untyped-def]
    compiler = GrammarCompiler(smollm2.backend, smollm2.vocab_size, smollm2.eos_token_ids)
    grammar = QWEN3.calls_grammar([("get_weather", LANGCHAIN_SCHEMA)], is_parallel=False)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _accepts(compiler, grammar, call, smollm2)
    assert not _accepts(compiler, grammar, call.replace(": ", ":"), smollm2)  # spaced as tojson
    assert _accepts(compiler, grammar, "<think>\nThe user wants Paris.\n</think>\n\n" + call,
                    smollm2)
    extra = call.replace('"Paris"}', '"Paris", "country": "FR"}')
    assert not _accepts(compiler, grammar, extra, smollm2)
    assert not _accepts(compiler, HERMES.calls_grammar([("get_weather", LANGCHAIN_SCHEMA)]),
                        "<think>\nx\n</think>\n\n" + call, smollm2)
    assert orjson.loads(grammar.split("%json ", 1)[1].rsplit(" ", 2)[0])  # the schema is JSON
