"""Model family -> chat format: how its prompts are rendered and its answers parsed.

    fmt = chat_format_for(architecture, chat_template_source)
    fmt.name             "hermes" | "qwen3" | "harmony" | "deepseek_v3" | "deepseek_r1"
                         | "deepseek_v3_1" | "llama4"
    fmt.reasoning        None | "think" | "harmony"
    fmt.output_parser(prompt_text=..., tools=..., calls_only=...)  -> OutputParser (chat/output.py)
    fmt.calls_grammar(functions, is_parallel)                      -> Lark text (forced tool_choice)

Chosen from the checkpoint: the template is sniffed first (it is what the model was trained
on), the architecture (config.json `model_type`) decides where the template says nothing:

| format        | rendered by | tool calls                                | reasoning |
| ------------- | ----------- | ----------------------------------------- | --------- |
| hermes        | jinja       | `<tool_call>{json}</tool_call>`           | none      |
| qwen3         | jinja       | `<tool_call>{json}</tool_call>`           | `<think>` |
| harmony       | harmony     | commentary `to=functions.NAME`            | analysis  |
| deepseek_v3   | jinja       | V3's (below)                              | none      |
| deepseek_r1   | jinja       | as deepseek_v3                            | `<think>` |
| deepseek_v3_1 | jinja       | V3.1's (below)                            | `<think>` |
| llama4        | jinja       | `[NAME(key=value, ...), ...]` (or JSON    | none      |
|               |             | `{"name", "parameters"}`)                 |           |

(jinja: the checkpoint's own template; harmony: the openai-harmony package, whose analysis channel
carries the reasoning; `<think>`: reasoning in `<think>...</think>`; V3's calls:
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and a ```json block, V3.1's:
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}`)

A template that writes `<|channel|>` is harmony; one that writes `<think>` has think-style
reasoning (Qwen3, Qwen3-MoE, DeepSeek-R1 distills, QwQ); a Qwen3 checkpoint whose template has no
`<think>` (Qwen3-Instruct-2507) has none. A template that writes `<｜tool▁sep｜>` is DeepSeek's:
V3.1's when the name comes before the separator, V3's (a ```json block) otherwise; with `<think>`
it reasons (R1, V3.1 with `thinking`). A template that writes Llama 4's `<|header_start|>` (or
a llama4 / llama4_text checkpoint) speaks Llama 4's pythonic calls. Adding a family (Gemma 3, Llama
4) is an entry in `_FAMILIES` plus, if its syntax is new, one parser module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from chat.output import OutputParser, TextOutputParser
from chat.reasoning import THINK_START, ThinkStream, opens_reasoning
from chat.tool_parsers import get_tool_parser
from chat.tool_parsers.base import arguments_schema

CHANNEL_TOKEN = "<|channel|>"  # harmony's header token: a template writing it is gpt-oss's
DEEPSEEK_SEP = "<｜tool▁sep｜>"  # DeepSeek's call separator: a template writing it is DeepSeek's
LLAMA4_HEADER = "<|header_start|>"  # Llama 4's turn header: a template writing it is Llama 4's
HarmonyLoader = Callable[[], Any]  # -> openai_harmony.HarmonyEncoding (chat.harmony.load_encoding)


@dataclass(frozen=True)
class ChatFormat:
    """One family's chat format. `tool_parser` names a format of chat/tool_parsers (unused by
    harmony, which parses calls itself); `reasoning` None means answers have no reasoning."""

    name: str
    renderer: str = "jinja"  # "jinja" (the checkpoint's template) or "harmony"
    tool_parser: str = "hermes"
    reasoning: str | None = None  # None, "think" or "harmony"

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        """The rendered prompt opened the reasoning block itself (DeepSeek-R1 style)."""
        return self.reasoning == "think" and opens_reasoning(prompt_text, THINK_START)

    def output_parser(self, *, prompt_text: str = "", uses_tools: bool = False,
                      calls_only: bool = False, tool_parser: str | None = None,
                      harmony: HarmonyLoader | None = None) -> OutputParser:
        """A parser for one answer. `prompt_text`: the rendered prompt (think formats look for
        an opened block); `tool_parser`: a format name overriding the family's (`--tool-parser`);
        `harmony`: loads the harmony encoding (harmony formats only)."""
        if self.renderer == "harmony":
            from chat.harmony import HarmonyOutputParser, load_encoding

            return HarmonyOutputParser((harmony or load_encoding)(), parse_tools=uses_tools)
        reasoning = (ThinkStream(self.starts_in_reasoning(prompt_text))
                     if self.reasoning == "think" else None)
        tools = (get_tool_parser(tool_parser or self.tool_parser).stream(calls_only)
                 if uses_tools else None)
        return TextOutputParser(reasoning, tools)

    def calls_grammar(self, functions: Sequence[tuple[str, dict[str, Any] | None]],
                      is_parallel: bool = True, tool_parser: str | None = None) -> str:
        """A Lark grammar (llguidance's dialect) admitting only calls to `functions`, in this
        format's syntax; for think formats the answer may reason first."""
        if self.renderer == "harmony":
            return harmony_calls_grammar(functions)
        grammar = get_tool_parser(tool_parser or self.tool_parser).calls_grammar(
            functions, is_parallel)
        if self.reasoning != "think":
            return grammar
        # an optional reasoning block before the calls (the rule `start` renamed `calls`)
        grammar = grammar.replace("start:", "calls:", 1)
        # one lexeme up to the first end tag (a lexer token cannot stop short of a longer match)
        return ('start: think? calls\n'
                'think: THINK /\\n*/\n'
                'THINK: "<think>" THINK_TEXT "</think>"\n'
                'THINK_TEXT: /(.|\\n)*/ & ~/(.|\\n)*<\\/think>(.|\\n)*/\n' + grammar)


def harmony_calls_grammar(functions: Sequence[tuple[str, dict[str, Any] | None]]) -> str:
    """gpt-oss's forced call: an optional analysis message, then one commentary message to one
    of `functions` whose JSON follows its schema, ended by `<|call|>` (harmony's stop token).
    The prompt ends with `<|start|>assistant`, so the answer starts at the channel header."""
    alternatives = []
    for i, (name, parameters) in enumerate(functions):
        schema = arguments_schema(parameters, "")
        schema["x-guidance"] = {"whitespace_flexible": False}
        header = orjson.dumps(f"commentary to=functions.{name} ").decode()
        alternatives.append(f'call{i}: <|channel|> {header} <|constrain|> "json" <|message|> '
                            f'%json {orjson.dumps(schema).decode()} <|call|>')
    calls = " | ".join(f"call{i}" for i in range(len(functions)))
    return ('start: analysis? call\n'
            'analysis: <|channel|> "analysis" <|message|> /(.|\\n)*/ <|end|> <|start|> '
            '"assistant"\n'
            f'call: {calls}\n' + "\n".join(alternatives) + "\n")


HERMES = ChatFormat("hermes")
QWEN3 = ChatFormat("qwen3", reasoning="think")
HARMONY = ChatFormat("harmony", renderer="harmony", tool_parser="harmony", reasoning="harmony")
DEEPSEEK_V3 = ChatFormat("deepseek_v3", tool_parser="deepseek_v3")
DEEPSEEK_R1 = ChatFormat("deepseek_r1", tool_parser="deepseek_v3", reasoning="think")
DEEPSEEK_V3_1 = ChatFormat("deepseek_v3_1", tool_parser="deepseek_v3_1", reasoning="think")
LLAMA4 = ChatFormat("llama4", tool_parser="llama4_pythonic")

# config.json model_type -> the family's format where its template does not say
_FAMILIES: dict[str, ChatFormat] = {
    "llama": HERMES,  # SmolLM2 and other ChatML Llama fine-tunes
    "qwen2": HERMES, "qwen2_moe": HERMES, "mixtral": HERMES, "olmoe": HERMES,
    "qwen3": QWEN3, "qwen3_moe": QWEN3,
    "gpt_oss": HARMONY,
    "deepseek_v3": DEEPSEEK_V3,
    "llama4": LLAMA4, "llama4_text": LLAMA4,
}
FORMATS = {f.name: f for f in (HERMES, QWEN3, HARMONY, DEEPSEEK_V3, DEEPSEEK_R1, DEEPSEEK_V3_1,
                               LLAMA4)}


def chat_format_for(architecture: str, chat_template: str | None = None,
                    token_to_id: Callable[[str], int | None] | None = None) -> ChatFormat:
    """The format of a checkpoint with this architecture and chat template source.
    `token_to_id`: its vocabulary's lookup; harmony is only chosen for a vocabulary that holds
    harmony's `<|channel|>` (or a template that writes it): a gpt_oss checkpoint with another
    tokenizer (a test's tiny one) cannot take o200k ids."""
    if chat_template is not None:
        if CHANNEL_TOKEN in chat_template:
            return HARMONY
        if DEEPSEEK_SEP in chat_template:
            return _deepseek_format(chat_template)
        if LLAMA4_HEADER in chat_template:
            return LLAMA4
        if THINK_START in chat_template:
            return QWEN3
        if architecture in ("qwen3", "qwen3_moe"):
            return HERMES  # a Qwen3 template without <think>: no reasoning
    family = _FAMILIES.get(architecture, HERMES)
    if family is HARMONY and token_to_id is not None and token_to_id(CHANNEL_TOKEN) is None:
        return HERMES
    if family is DEEPSEEK_V3 and token_to_id is not None and token_to_id(DEEPSEEK_SEP) is None:
        return HERMES  # a deepseek_v3 checkpoint with another vocabulary (a test's tiny one)
    return family


def _deepseek_format(chat_template: str) -> ChatFormat:
    """V3.1 renders `name + '<｜tool▁sep｜>' + arguments`; V3 and R1 `type + '<｜tool▁sep｜>' +
    name` and a ```json block. A template writing `<think>` reasons (R1, V3.1's `thinking`)."""
    if "```json" not in chat_template:
        return DEEPSEEK_V3_1
    return DEEPSEEK_R1 if THINK_START in chat_template else DEEPSEEK_V3
