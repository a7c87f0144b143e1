"""Tools in a DeepSeek prompt. DeepSeek's templates (V3, R1, V3.1) write past tool calls and tool
results in their own tokens but never read the `tools` variable: the tool list goes into the
system prompt as text, in the shape of DeepSeek-V3.1's model card ("## Tools" with one
"### NAME" section per tool), followed by the call syntax the template itself writes.

    rewrite = native_tools_rewriter(template_source)   # None: not a DeepSeek template
    chat = rewrite(messages, tools)                     # normalized messages, ready to render

Assistant calls keep their `tool_calls` (the templates concatenate `arguments`, so they are
passed as a JSON string) and an assistant turn of calls only gets content None (V3's template
writes calls only for such a turn).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

SEP = "<｜tool▁sep｜>"
_V3_SYNTAX = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_call_name\n"
              "```json\ntool_call_arguments\n```<｜tool▁call▁end｜>{{additional_tool_calls}}"
              "<｜tool▁calls▁end｜>")
_V31_SYNTAX = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>"
               "tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>")

Rewriter = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[dict[str, Any]]]


def native_tools_rewriter(source: str) -> Rewriter | None:
    """The rewrite for a DeepSeek template that does not read `tools`, else None."""
    if SEP not in source:
        return None
    syntax = _V3_SYNTAX if "```json" in source else _V31_SYNTAX

    def rewrite(chat: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        out = [_native_message(m) for m in chat]
        if tools:
            section = tools_section(tools, syntax)
            if out and out[0].get("role") == "system":
                system = out[0]["content"]
                out[0] = {**out[0], "content": f"{system}\n\n{section}" if system else section}
            else:
                out.insert(0, {"role": "system", "content": section})
        return out

    return rewrite


def tools_section(tools: list[dict[str, Any]], syntax: str) -> str:
    """The system prompt's tool list and the call syntax to answer with."""
    parts = ["## Tools\nYou have access to the following tools:\n"]
    for tool in tools:
        function = tool.get("function", tool)
        parts.append(f"### {function.get('name', '')}\n"
                     f"Description: {function.get('description', '')}\n\n"
                     "Parameters: "
                     f"{json.dumps(function.get('parameters', {}), ensure_ascii=False)}\n")
    parts.append("IMPORTANT: ALWAYS adhere to this exact format for tool use:\n" + syntax + "\n\n"
                 "Where:\n\n"
                 "- `tool_call_name` must be an exact match to one of the available tools\n"
                 "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
                 "Parameters Schema\n"
                 "- For multiple tool calls, chain them directly without separators or spaces")
    return "\n".join(parts)


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    native = []
    for call in calls:
        function = dict(call.get("function", call))
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):
            function["arguments"] = json.dumps(arguments, ensure_ascii=False)
        native.append({**call, "type": call.get("type", "function"), "function": function})
    content = message.get("content") or None
    return {**message, "content": content, "tool_calls": native}
