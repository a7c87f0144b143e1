"""The GGUF-built tokenizer and chat template against transformers' GGUF tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chat.chat_template import ChatTemplate
from chat.tokenizer import Tokenizer, load_tokenizer
from engine.loader import default_model_path

TEXTS = [
    "Hello, world! How are you doing today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Prices: 12345 and 3.14159, year 2024-11-29, phone +1 (555) 010-9999.",
    "Emoji 🤗🚀 and accents: café, naïve, Ærøskøbing, Ελληνικά, русский.",
    "中文分词测试，日本語のテキスト、한국어 문장.",
    "  leading spaces,\t\ttabs,   runs   of    spaces\n\n\nand newlines   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>y<jupyter_code>z",
    "I'm sure they'll say it's what we've done'",
    "",
    " ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a color."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one, in French?"}],
    [{"role": "user", "content": "Bonjour 🤗"}, {"role": "assistant", "content": "Salut !"}],
]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(gguf_path) -> Tokenizer:
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def reference(transformers_gguf_tokenizer):
    """transformers' tokenizer of the same GGUF file (the session's, tests/conftest.py)."""
    return transformers_gguf_tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, reference, text):
    assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=True) == reference.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_and_matches_transformers(tokenizer, reference, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids) == reference.decode(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == reference.decode(
        ids, skip_special_tokens=True)


def test_special_tokens_are_matched_whole(tokenizer):
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("a<|im_end|>b") == tokenizer.encode("a") + [2] + tokenizer.encode("b")
    assert tokenizer.convert_ids_to_tokens([1, 2, 0]) == ["<|im_start|>", "<|im_end|>",
                                                          "<|endoftext|>"]
    assert tokenizer.special_token_ids == frozenset(range(17))
    assert tokenizer.decode([1, 31530, 2], skip_special_tokens=True) == tokenizer.decode([31530])


def test_smollm2_special_ids(tokenizer, reference):
    assert tokenizer.vocab_size == 49152 == len(reference)
    assert tokenizer.bos_token_id == reference.bos_token_id == 1
    assert tokenizer.eos_token_ids == (2, 0)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(tokenizer, reference, conversation,
                                            add_generation_prompt):
    ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = reference.apply_chat_template(conversation, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert tokenizer.encode_chat(conversation, add_generation_prompt=add_generation_prompt) == \
        reference.apply_chat_template(conversation, tokenize=True,
                                      add_generation_prompt=add_generation_prompt,
                                      return_dict=False)


def test_content_parts_are_joined_as_text(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                          {"type": "text", "text": "world"}]}]
    plain = [{"role": "user", "content": "Hello\nworld"}]
    assert tokenizer.apply_chat_template(parts) == tokenizer.apply_chat_template(plain)


def test_smollm2_template_ignores_tools_so_the_fallback_renders_them(tokenizer):
    assert not tokenizer.chat_template.reads_tools
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>" in prompt
    assert "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    without_system = tokenizer.apply_chat_template([{"role": "user", "content": "Weather?"}],
                                                   tools=[WEATHER_TOOL])
    assert without_system.startswith("<|im_start|>system\n# Tools\n")
    assert "get_weather" in without_system


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_tool_calls_and_results_render_as_hermes_blocks(tokenizer, arguments):
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rainy"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL])
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in prompt
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
            "<tool_response>\nrainy\n</tool_response><|im_end|>") in prompt
    assert messages[1]["content"] is None  # the caller's messages are not modified


def test_template_that_reads_tools_gets_them_unchanged():
    source = ("{% if tools %}{% for t in tools %}[{{ t.function.name }}|{{ t | tojson }}]"
              "{% endfor %}{% endif %}{% for m in messages %}{{ m.role }}:{{ m.content }};"
              "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}"
              "{% endfor %}")
    template = ChatTemplate(source)
    assert template.reads_tools
    rendered = template.render(
        [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"a": "<é>"}'}}]}],
        tools=[WEATHER_TOOL])
    assert rendered == f"[get_weather|{json.dumps(WEATHER_TOOL)}]assistant:;" + '{"a": "<é>"}'


def test_rendering_env_matches_transformers():
    transformers_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}"
        "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}\n  {{ ns.n }}. {{ m.content | tojson }}"
        "\n{% endfor %}{% if add_generation_prompt %}{{ bos_token }}go{% endif %}"
        "{{ dict(a=1) | tojson(indent=2) }}")
    messages = [{"role": "user", "content": "<b>é</b>"}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "ok"}]
    theirs, _ = transformers_utils.render_jinja_template(
        [messages], chat_template=source, add_generation_prompt=True, bos_token="<s>")
    assert ChatTemplate(source).render(messages, special_tokens={"bos_token": "<s>"}) == theirs[0]


def test_raise_exception_raises_template_error():
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([])


def test_tokenizer_loads_without_importing_torch_or_the_engine(gguf_path):
    code = ("import sys; from chat import load_tokenizer; "
            "import chat.registry, chat.harmony, chat.output, chat.reasoning; "
            f"t = load_tokenizer({str(gguf_path)!r}); assert t.encode('hi'); "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "assert not any(m.split('.')[0] in ('engine', 'gateway') for m in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr


def test_continue_final_message_matches_transformers(tokenizer, reference):
    """Prefill: the prompt stops right after the assistant's partial text."""
    conversation = [{"role": "user", "content": "Name a color."},
                    {"role": "assistant", "content": "The color is"}]
    ours = tokenizer.apply_chat_template(conversation, continue_final_message=True)
    assert ours == reference.apply_chat_template(conversation, tokenize=False,
                                                 continue_final_message=True)
    assert ours.endswith("<|im_start|>assistant\nThe color is")


def test_continue_final_message_edge_cases():
    trimming = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ "
                            "m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% "
                            "endif %}")
    user = {"role": "user", "content": "hi"}
    assert trimming.render([user, {"role": "assistant", "content": " Sure "}],
                           continue_final_message=True) == "<user>hi</user><assistant>Sure"
    # nothing to continue: a plain generation prompt
    assert trimming.render([user, {"role": "assistant", "content": "  "}],
                           continue_final_message=True) == "<user>hi</user><assistant>"
    hiding = ChatTemplate("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    with pytest.raises(ValueError, match="cannot be continued"):
        hiding.render([user, {"role": "assistant", "content": "x"}], continue_final_message=True)
