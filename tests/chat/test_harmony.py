"""gpt-oss's harmony format through openai-harmony, offline: the o200k vocabulary built from local
ranks (harmony checks the file's SHA-256), prompts that match the checkpoint's own template,
answers parsed from token ids as the model card shows them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chat import harmony
from chat.chat_template import ChatTemplate
from chat.output import parse_output
from chat.registry import HARMONY, chat_format_for, harmony_calls_grammar
from chat.special_tokens import collect_eos_token_ids
from contracts.output_grammar import OutputGrammar

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def encoding():  # type: ignore[no-untyped-def]
    return harmony.load_encoding()


def _ids(encoding, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return list(encoding.encode(text, allowed_special="all"))


def test_the_vocabulary_file_is_built_from_a_tokenizers_byte_level_vocab_and_passes_harmonys_hash(
        tmp_path: Path) -> None:
    """In a fresh process with an empty cache and no quicktok fallback: the ranks come from a
    gpt-oss-style tokenizer vocabulary (ids = ranks, GPT-2 byte spelling)."""
    code = (
        "import chat.harmony as h\n"
        "from chat.gguf_vocab import byte_alphabet\n"
        "ranks = h.ranks_from_quicktok(); h.ranks_from_quicktok = lambda: None\n"
        "a = byte_alphabet()\n"
        "vocab = {''.join(a[b] for b in t): i for i, t in enumerate(ranks)}\n"
        "vocab['<|channel|>'] = 200005\n"
        "enc = h.load_encoding(vocab)\n"
        "assert enc.decode_utf8(enc.encode('héllo wörld')) == 'héllo wörld'\n")
    env = {k: v for k, v in os.environ.items() if k != harmony.ENCODINGS_BASE_ENV}
    env[harmony.CACHE_DIR_ENV] = str(tmp_path)
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "tiktoken" / harmony.O200K_FILE).stat().st_size > 2_000_000


def test_without_any_local_vocabulary_the_error_says_where_to_get_one(tmp_path: Path,
                                                                      monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(harmony, "ranks_from_quicktok", lambda: None)
    monkeypatch.setenv(harmony.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(harmony.ENCODINGS_BASE_ENV, raising=False)
    with pytest.raises(harmony.HarmonyUnavailable, match="tokenizer.json"):
        harmony._encodings_dir(None)


@pytest.mark.parametrize("messages, tools", [
    ([{"role": "user", "content": "What is 2 + 2?"}], None),
    ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather?"}],
     [WEATHER]),
])
def test_prompts_match_the_checkpoints_own_template(encoding, messages, tools) -> None:  # type: ignore[no-untyped-def]
    template = ChatTemplate((DATA / "gpt_oss.jinja").read_text())
    expected = template.render(messages, tools=tools, add_generation_prompt=True)
    assert encoding.decode_utf8(harmony.render_prompt(encoding, messages, tools)) == expected


def test_reasoning_effort_reaches_the_system_message(encoding) -> None:  # type: ignore[no-untyped-def]
    ids = harmony.render_prompt(encoding, [{"role": "user", "content": "Hi"}],
                                reasoning_effort="high")
    assert "\nReasoning: high\n" in encoding.decode_utf8(ids)
    with pytest.raises(ValueError, match="reasoning_effort"):
        harmony.render_prompt(encoding, [{"role": "user", "content": "Hi"}],
                              reasoning_effort="extreme")


def test_a_tool_round_trip_renders_the_call_and_its_result_on_the_commentary_channel(  # type: ignore[no-untyped-def]
        encoding) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 20}'}]
    text = encoding.decode_utf8(harmony.render_prompt(encoding, messages, [WEATHER]))
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json'
            '<|message|>{"city":"Paris"}<|call|>') in text
    assert ('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
            '{"temp_c": 20}<|end|><|start|>assistant') in text


# the model card's example answer, in harmony's own documentation form
ANSWER = ("<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple arithmetic. "
          "Provide answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        "<|message|>{\"city\": \"Tokyo\"}<|call|>")


def test_analysis_is_reasoning_and_final_is_content_token_by_token(encoding) -> None:  # type: ignore[no-untyped-def]
    ids = _ids(encoding, ANSWER)
    parser = HARMONY.output_parser(harmony=lambda: encoding)
    parsed = parse_output(parser, [([i], "") for i in ids])
    assert parsed.reasoning == 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
    assert parsed.content == "2 + 2 = 4." and parsed.tool_calls == ()
    analysis = ANSWER[:ANSWER.index("<|start|>")]
    assert parsed.num_reasoning_tokens == len(_ids(encoding, analysis))


def test_a_commentary_message_to_a_function_is_a_tool_call(encoding) -> None:  # type: ignore[no-untyped-def]
    ids = _ids(encoding, CALL)
    parsed = parse_output(HARMONY.output_parser(uses_tools=True, harmony=lambda: encoding),
                          [(ids[i:i + 3], "") for i in range(0, len(ids), 3)])
    assert parsed.reasoning == "Need to use function get_weather."
    assert ([(c.name, c.arguments) for c in parsed.tool_calls]
            == [("get_weather", '{"city":"Tokyo"}')])
    assert parsed.content is None


def test_a_call_cut_by_max_tokens_is_dropped_and_an_unfinished_answer_keeps_its_text(  # type: ignore[no-untyped-def]
        encoding) -> None:
    cut = _ids(encoding, CALL)[:-4]
    parsed = parse_output(HARMONY.output_parser(uses_tools=True, harmony=lambda: encoding),
                          [(cut, "")])
    assert parsed.tool_calls == () and parsed.reasoning == "Need to use function get_weather."
    unfinished = _ids(encoding, ANSWER)[:-3]  # max_tokens ended the final message
    content = parse_output(HARMONY.output_parser(harmony=lambda: encoding),
                           [(unfinished, "")]).content
    assert content and "2 + 2 = 4.".startswith(content) and content != "2 + 2 = 4."


def test_harmony_checkpoints_are_recognised_and_stop_on_return_and_call_not_end() -> None:
    template = (DATA / "gpt_oss.jinja").read_text()
    assert chat_format_for("gpt_oss", template) is HARMONY
    assert chat_format_for("llama", template) is HARMONY  # the template decides
    vocab = {"<|return|>": 200002, "<|channel|>": 200005, "<|end|>": 200007, "<|call|>": 200012,
             "<|endoftext|>": 199999}
    assert collect_eos_token_ids([200002, 200007], vocab.get) == (200002, 200012, 199999)


def test_the_forced_call_grammar_compiles() -> None:
    grammar = harmony_calls_grammar([("get_weather", WEATHER["function"]["parameters"])])
    assert OutputGrammar.lark(grammar, "tools").kind == "lark"
    assert '"commentary to=functions.get_weather "' in grammar
