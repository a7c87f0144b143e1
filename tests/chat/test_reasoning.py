"""`<think>` reasoning split out of answers, on the real Qwen3 and DeepSeek-R1 templates and on
outputs written as the model cards show them."""

from __future__ import annotations

from pathlib import Path

import pytest

from chat.chat_template import ChatTemplate
from chat.output import TextOutputParser, parse_output
from chat.reasoning import ThinkStream, opens_reasoning, split_reasoning
from chat.registry import DEEPSEEK_R1, QWEN3, chat_format_for
from chat.tool_parsers import HermesToolParser

DATA = Path(__file__).parent / "data"
ASK = [{"role": "user", "content": "Give me a short introduction to large language models."}]
# the Qwen3 model card's thinking-mode answer, as the model writes it (ids decoded with specials)
QWEN3_ANSWER = ("<think>\nOkay, the user wants a short introduction to large language models."
                "\n</think>\n\nA large language model (LLM) is a neural network trained on text.")
QWEN3_REASONING = "Okay, the user wants a short introduction to large language models."
QWEN3_CONTENT = "A large language model (LLM) is a neural network trained on text."


@pytest.fixture(scope="module")
def qwen3_template() -> ChatTemplate:
    return ChatTemplate((DATA / "qwen3.jinja").read_text())


def _streamed(text: str, step: int, starts_in_reasoning: bool = False) -> tuple[str, str]:
    stream = ThinkStream(starts_in_reasoning)
    reasoning, content = [], []
    for i in range(0, len(text), step):
        delta = stream.feed(text[i:i + step])
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    last = stream.finish()
    return "".join(reasoning) + last.reasoning, "".join(content) + last.content


def test_qwen3_thinking_answer_splits_into_reasoning_and_content() -> None:
    split = split_reasoning(QWEN3_ANSWER)
    assert (split.reasoning, split.content) == (QWEN3_REASONING, QWEN3_CONTENT)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 1000])
def test_streaming_in_any_split_matches_the_whole_split(step: int) -> None:
    assert _streamed(QWEN3_ANSWER, step) == (QWEN3_REASONING, QWEN3_CONTENT)


def test_a_half_written_end_tag_is_held_back_until_it_completes() -> None:
    stream = ThinkStream()
    assert stream.feed("<think>\nHmm</thi").reasoning == "Hmm"
    rest = stream.feed("nk>\n\nYes.")
    assert (rest.reasoning, rest.content) == ("", "Yes.")


def test_qwen3_template_with_thinking_off_renders_an_empty_block_and_the_answer_is_content(
        qwen3_template: ChatTemplate) -> None:
    prompt = qwen3_template.render(ASK, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not QWEN3.starts_in_reasoning(prompt)
    assert split_reasoning("An LLM is a model.", QWEN3.starts_in_reasoning(prompt)).content == \
        "An LLM is a model."


def test_qwen3_template_with_thinking_on_leaves_the_block_to_the_model(
        qwen3_template: ChatTemplate) -> None:
    prompt = qwen3_template.render(ASK)
    assert prompt.endswith("<|im_start|>assistant\n") and not QWEN3.starts_in_reasoning(prompt)


def test_deepseek_r1_prompt_opens_the_block_so_the_answer_starts_in_reasoning() -> None:
    template = ChatTemplate((DATA / "deepseek_r1_distill_qwen.jinja").read_text())
    prompt = template.render(ASK, bos_token="<｜begin▁of▁sentence｜>", enable_thinking=True)
    # the distill's template writes past calls in DeepSeek's tokens: R1's format, with <think>
    assert opens_reasoning(prompt) and chat_format_for("qwen2", template.source) is DEEPSEEK_R1
    assert not opens_reasoning(template.render(ASK, enable_thinking=False))  # closed at once
    answer = "The user asks about LLMs.\n</think>\n\nLLMs predict the next token."
    for step in (1, 4, 1000):
        assert _streamed(answer, step, starts_in_reasoning=True) == (
            "The user asks about LLMs.", "LLMs predict the next token.")


def test_a_block_cut_by_max_tokens_stays_reasoning() -> None:
    assert split_reasoning("<think>\nStep one, step tw").reasoning == "Step one, step tw"
    assert split_reasoning("<think>\nStep one\n</th").reasoning == "Step one"


def test_think_tags_inside_the_answer_are_text() -> None:
    text = "Use the <think> tag to reason, then </think>."
    assert split_reasoning(text).content == text and split_reasoning(text).reasoning == ""


def test_reasoning_then_tool_call_parses_both_and_counts_reasoning_tokens(
        qwen3_template: ChatTemplate) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    answer = "<think>\nI should look the weather up.\n</think>\n\n" + call
    pieces = [([i], answer[i:i + 1]) for i in range(len(answer))]  # one character a token
    parser = TextOutputParser(ThinkStream(), HermesToolParser().stream())
    parsed = parse_output(parser, pieces)
    assert parsed.reasoning == "I should look the weather up." and parsed.content is None
    assert ([(c.name, c.arguments) for c in parsed.tool_calls]
            == [("get_weather", '{"city":"Paris"}')])
    # "<think>\n...</think>" and its newlines are reasoning; the call is not
    assert parsed.num_reasoning_tokens == len("<think>\nI should look the weather up.\n</think>")
