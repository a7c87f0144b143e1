"""DeepSeek's chat formats: calls in its special tokens (V3/R1 and V3.1 syntax) and `<think>`
reasoning, on the checkpoints' own templates (tests/chat/data/deepseek_v3*.jinja)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from chat.chat_template import ChatTemplate
from chat.output import parse_output
from chat.registry import DEEPSEEK_R1, DEEPSEEK_V3, DEEPSEEK_V3_1, HERMES, chat_format_for
from chat.tokenizer import load_tokenizer
from chat.tool_parsers import DeepSeekV3ToolParser, DeepSeekV31ToolParser, get_tool_parser
from engine.loader import default_model_path
from engine.structured_output import GrammarCompiler, OutputGrammar

DATA = Path(__file__).parent / "data"
SPECIALS = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
EOS = "<｜end▁of▁sentence｜>"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALLS = [{"name": "get_weather", "arguments": {"city": "Paris"}},
         {"name": "search", "arguments": {"q": "météo \"Rome\"", "filters": {"n": [1, 2]}}}]
# vLLM's deepseekv3 parser documents the model's output in this shape; the text before the
# calls is what the model may say first
V3_ANSWER = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
             "get_current_weather\n```json\n{\"location\": \"Beijing\"}\n```<｜tool▁call▁end｜>\n"
             "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```json\n"
             "{\"location\": \"Shanghai\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
# DeepSeek-V3.1's model card: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS...`
V31_ANSWER = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
              "{\"city\": \"Paris\"}<｜tool▁call▁end｜>"
              "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
              "{\"city\": \"Rome\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


@pytest.fixture(scope="module")
def v3() -> ChatTemplate:
    return ChatTemplate((DATA / "deepseek_v3.jinja").read_text())


@pytest.fixture(scope="module")
def v31() -> ChatTemplate:
    return ChatTemplate((DATA / "deepseek_v3_1.jinja").read_text())


def _r1_source(v3: ChatTemplate) -> str:
    """R1's template is V3's with a generation prompt that opens the think block."""
    source = v3.source.replace("{{'<｜Assistant｜>'}}{% endif %}",
                               "{{'<｜Assistant｜><think>\\n'}}{% endif %}")
    assert source != v3.source
    return source


def test_the_template_chooses_the_deepseek_format(v3: ChatTemplate, v31: ChatTemplate) -> None:
    assert chat_format_for("deepseek_v3", v3.source) is DEEPSEEK_V3
    assert chat_format_for("deepseek_v3", v31.source) is DEEPSEEK_V3_1
    assert chat_format_for("deepseek_v3", _r1_source(v3)) is DEEPSEEK_R1
    assert chat_format_for("qwen2", _r1_source(v3)) is DEEPSEEK_R1  # a template says it first
    assert chat_format_for("deepseek_v3") is DEEPSEEK_V3
    assert chat_format_for("deepseek_v3", None, {"<｜tool▁sep｜>": 128814}.get) is DEEPSEEK_V3
    assert chat_format_for("deepseek_v3", None, {}.get) is HERMES  # a tiny test vocabulary


def _history(calls: list[dict[str, object]]) -> list[dict[str, object]]:
    return [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{i}", "type": "function",
                 "function": {"name": c["name"],
                              "arguments": orjson.dumps(c["arguments"]).decode()}}
                for i, c in enumerate(calls)]},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_1"])
def test_the_parser_reads_back_the_calls_the_template_writes(
        name: str, v3: ChatTemplate, v31: ChatTemplate) -> None:
    template = v3 if name == "deepseek_v3" else v31
    text = template.render(_history(CALLS), TOOLS, special_tokens=SPECIALS)
    turn = text.split("<｜User｜>Weather?<｜Assistant｜>", 1)[1].split(EOS, 1)[0]
    turn = turn.removeprefix("</think>")  # V3.1 closes the (empty) think block first
    parsed = get_tool_parser(chat_format_for("deepseek_v3",
                                             template.source).tool_parser).extract(turn)
    assert parsed.content is None
    assert [(c.name, orjson.loads(c.arguments)) for c in parsed.tool_calls] == [
        (c["name"], c["arguments"]) for c in CALLS]


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_1"])
def test_tools_go_into_the_system_prompt_in_the_templates_own_syntax(
        name: str, v3: ChatTemplate, v31: ChatTemplate) -> None:
    template = v3 if name == "deepseek_v3" else v31
    messages = [{"role": "system", "content": "Be brief."}, *_history(CALLS)]
    text = template.render(messages, TOOLS, special_tokens=SPECIALS)
    system = text.removeprefix(SPECIALS["bos_token"]).split("<｜User｜>", 1)[0]
    assert system.startswith("Be brief.\n\n## Tools\n") and "### get_weather\n" in system
    assert '"required": ["city"]' in system
    assert ("```json" in system) is (name == "deepseek_v3")
    assert "<tool_call>" not in text  # not the Hermes fallback


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_streaming_in_any_split_matches_whole_extraction(step: int) -> None:
    stream = DeepSeekV3ToolParser().stream()
    content, calls = "", []
    for i in range(0, len(V3_ANSWER), step):
        delta = stream.feed(V3_ANSWER[i:i + step])
        assert "｜" not in delta.content  # no marker, nor a part of one, is ever shown
        content += delta.content
        calls += delta.tool_calls
    rest = stream.finish()
    content, calls = content + rest.content, calls + list(rest.tool_calls)
    whole = DeepSeekV3ToolParser().extract(V3_ANSWER)
    assert content == whole.content == "Let me check."
    assert [orjson.loads(c.arguments) for c in calls] == [
        {"location": "Beijing"}, {"location": "Shanghai"}]
    assert [c.name for c in whole.tool_calls] == ["get_current_weather"] * 2


def test_v31_calls_are_extracted_and_a_call_completes_when_its_end_token_arrives() -> None:
    stream = DeepSeekV31ToolParser().stream()
    first_end = V31_ANSWER.index("<｜tool▁call▁end｜>")
    delta = stream.feed(V31_ANSWER[:first_end])
    assert delta.tool_calls == () and delta.content == ""
    delta = stream.feed(V31_ANSWER[first_end:])
    assert [orjson.loads(c.arguments) for c in delta.tool_calls] == [{"city": "Paris"},
                                                                     {"city": "Rome"}]
    assert stream.finish().content == ""


@pytest.mark.parametrize("cut", ["\n```<｜tool▁call▁e", "\n```", ""])
def test_a_call_cut_by_max_tokens_after_its_json_is_parsed(cut: str) -> None:
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n"
            "{\"k\": 2}" + cut)
    parsed = DeepSeekV3ToolParser().extract(text)
    assert [c.name for c in parsed.tool_calls] == ["a"] and parsed.content is None


def test_a_malformed_call_stays_content_and_plain_text_is_untouched() -> None:
    bad = "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{city: Paris}<｜tool▁call▁end｜>"
    parsed = DeepSeekV31ToolParser().extract(bad)
    assert parsed.tool_calls == () and parsed.content == bad
    assert DeepSeekV3ToolParser().extract("a ｜ b <｜").content == "a ｜ b <｜"


def test_v31_thinking_reasons_then_calls_and_without_thinking_answers(v31: ChatTemplate) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = v31.render(ask, TOOLS, special_tokens=SPECIALS, thinking=True)
    assert prompt.endswith("<｜Assistant｜><think>") and DEEPSEEK_V3_1.starts_in_reasoning(prompt)
    answer = "The user wants Paris.</think>" + V31_ANSWER.split("<｜tool▁call▁begin｜>get_weather"
                                                               "<｜tool▁sep｜>{\"city\": "
                                                               "\"Rome\"}")[0]
    parser = DEEPSEEK_V3_1.output_parser(prompt_text=prompt, uses_tools=True)
    pieces = [([i], answer[i:i + 5]) for i in range(0, len(answer), 5)]
    out = parse_output(parser, pieces)
    assert out.reasoning == "The user wants Paris." and out.content is None
    assert [orjson.loads(c.arguments) for c in out.tool_calls] == [{"city": "Paris"}]
    assert 0 < out.num_reasoning_tokens < len(pieces)
    plain = v31.render(ask, TOOLS, special_tokens=SPECIALS)  # thinking is off by default
    assert (plain.endswith("<｜Assistant｜></think>")
            and not DEEPSEEK_V3_1.starts_in_reasoning(plain))
    out = parse_output(DEEPSEEK_V3_1.output_parser(prompt_text=plain, uses_tools=True),
                       [([1], "It is sunny.")])
    assert out.content == "It is sunny." and out.reasoning is None


@pytest.fixture(scope="module")
def smollm2():  # type: ignore[no-untyped-def]
    return load_tokenizer(default_model_path())


def _accepts(compiler: GrammarCompiler, grammar: str, text: str, tokenizer) -> bool:  # type: ignore[no-untyped-def]
    matcher = compiler.matcher(OutputGrammar.lark(grammar, "tools"))
    return all(matcher.accept(t) for t in tokenizer.encode(text))


def test_forced_calls_grammars_admit_the_formats_calls_only(smollm2) -> None:  # type: ignore[no-untyped-def]
    compiler = GrammarCompiler(smollm2.backend, smollm2.vocab_size, smollm2.eos_token_ids)
    schema = TOOLS[0]["function"]["parameters"]  # type: ignore[index]
    v3_call = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
               "```json\n{\"city\":\"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    v3 = DEEPSEEK_V3.calls_grammar([("get_weather", schema)])
    assert _accepts(compiler, v3, v3_call, smollm2)
    assert not _accepts(compiler, v3, v3_call.replace('"Paris"}', '"Paris","x":1}'), smollm2)
    assert DeepSeekV3ToolParser().extract(v3_call).tool_calls[0].name == "get_weather"
    r1 = DEEPSEEK_R1.calls_grammar([("get_weather", schema)], is_parallel=False)
    assert _accepts(compiler, r1, "<think>\nParis.\n</think>\n\n" + v3_call, smollm2)
    v31_call = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                "{\"city\":\"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    v31 = DEEPSEEK_V3_1.calls_grammar([("get_weather", schema)])
    assert _accepts(compiler, v31, v31_call, smollm2)
    assert not _accepts(compiler, v31, v3_call, smollm2)
