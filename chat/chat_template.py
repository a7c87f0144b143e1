"""Chat templates: render a conversation to the prompt text the model was trained on.

Rendering matches `transformers`' `apply_chat_template` (utils/chat_template_utils.py): a jinja2
`ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks` and the `loopcontrols`
extension; `raise_exception`, `strftime_now`, `dict` and `namespace` globals; a `tojson` filter
that does not escape HTML (`json.dumps(x, ensure_ascii=False, ...)`); a `{% generation %}` block
that renders its body; and the variables `messages`, `tools`, `documents`,
`add_generation_prompt` plus the tokenizer's `bos_token`, `eos_token`, `unk_token`, `pad_token`.

Before rendering, messages are normalised the way OpenAI-style servers do:
  - keys whose value is None are dropped (as transformers does), a missing `content` becomes "";
  - a content list of parts keeps its `{"type": "text"}` parts, joined with "\\n" (as vLLM does);
  - tool-call `arguments` given as a JSON string are parsed to a dict, so templates that write
    `arguments | tojson` do not double-encode them.

Tool fallback. A template that never reads the `tools` variable (SmolLM2's does not: it only
concatenates `role` and `content`) would silently drop tools, tool calls and tool results. For such
templates `render_chat` rewrites the conversation first, in the Hermes / Qwen2.5 format SmolLM2's
instruct data used, then renders it with the model's own template:
  - tools: a system section (appended to the first system message, or a new first system message)
    listing each tool as one JSON line inside `<tools></tools>`, and asking for calls as
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  - assistant `tool_calls`: appended to the content as `<tool_call>` JSON blocks;
  - `tool` messages: one user turn per run of consecutive results, each in `<tool_response>` tags.
Templates that do read `tools` get the normalised messages unchanged. DeepSeek's templates write
calls and results in their own tokens but not the tool list: chat/deepseek_prompt.py keeps
those and puts the tools in the system prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chat.deepseek_prompt import native_tools_rewriter

Message = Mapping[str, Any]

TOOLS_SYSTEM_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_SYSTEM_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks it; we
    don't)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore-prefixed attributes (as transformers does)."""

    def __setitem__(self, name: str, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")
        super().__setitem__(name, value)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplate:
    """A compiled chat template. Cheap to share; `render` is thread-safe."""

    def __init__(self, source: str) -> None:
        env = _environment()
        self.source = source
        self.template = env.from_string(source)
        self.reads_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
        # DeepSeek's templates write calls and results natively but not the tool list
        self._native_tools = None if self.reads_tools else native_tools_rewriter(source)

    def render(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, special_tokens: Mapping[str, str] | None = None,
               continue_final_message: bool = False, **extra: Any) -> str:
        """The prompt text. `extra` variables override the special-token variables.

        `continue_final_message` (transformers' option of that name; Anthropic's prefill): the
        text ends right after the last message's content instead of closing that turn, so that
        generation continues it; `add_generation_prompt` is then ignored. A last message without
        text leaves nothing to continue: the rest is rendered with a generation prompt. Raises
        ValueError when the template does not write the last message's text verbatim."""
        if continue_final_message:
            final = content_text(messages[-1].get("content")) if messages else ""
            if not final.strip():
                return self.render(messages[:-1], tools, True, special_tokens, **extra)
            text = self.render(messages, tools, False, special_tokens, **extra)
            for written in (final, final.strip()):
                end = text.rfind(written)
                if end >= 0:
                    return text[:end + len(written)]
            raise ValueError("the chat template does not write the final message's text, so it "
                             "cannot be continued")
        chat = [normalize_message(m) for m in messages]
        tool_list = [dict(t) for t in tools] if tools else None
        if self._native_tools is not None:
            chat = self._native_tools(chat, tool_list)
            tool_list = None
        elif not self.reads_tools:
            chat = _inline_tools(chat, tool_list)
            tool_list = None
        variables = {**(special_tokens or {}), **extra}
        return self.template.render(messages=chat, tools=tool_list, documents=None,
                                    add_generation_prompt=add_generation_prompt, **variables)


def content_text(content: Any) -> str:
    """A message content (string, list of parts, or None) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif part.get("type", "text") == "text":
            texts.append(part.get("text", ""))
    return "\n".join(texts)


def _parsed_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # the model wrote invalid JSON: show it as written
    return arguments


def _normalize_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    call = {k: v for k, v in call.items() if v is not None}
    if isinstance(call.get("function"), Mapping):
        function = dict(call["function"])
        function["arguments"] = _parsed_arguments(function.get("arguments", {}))
        call["function"] = function
    elif "arguments" in call:
        call["arguments"] = _parsed_arguments(call["arguments"])
    return call


def normalize_message(message: Message) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = content_text(out.get("content"))
    if "tool_calls" in out:
        out["tool_calls"] = [_normalize_tool_call(c) for c in out["tool_calls"]]
    return out


def tool_call_text(call: Mapping[str, Any]) -> str:
    """One call as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`."""
    function = call.get("function", call)
    body = {"name": function.get("name", ""), "arguments": function.get("arguments", {})}
    return f"<tool_call>\n{_tojson(body)}\n</tool_call>"


def _tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = "".join("\n" + _tojson(tool) for tool in tools)
    return TOOLS_SYSTEM_HEADER + lines + TOOLS_SYSTEM_FOOTER


def _inline_tools(chat: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Rewrite tools, tool calls and tool results into plain system/user/assistant text."""
    out: list[dict[str, Any]] = []
    for message in chat:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            parts = [message["content"]] if message["content"] else []
            parts += [tool_call_text(call) for call in message["tool_calls"]]
            rewritten = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append({**rewritten, "content": "\n".join(parts)})
        elif role == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_responses": True})
        else:
            out.append(message)
    for message in out:
        message.pop("_tool_responses", None)
    if tools:
        section = _tools_section(tools)
        if out and out[0].get("role") == "system":
            system = out[0]["content"]
            out[0] = {**out[0], "content": f"{system}\n\n{section}" if system else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
