"""Tool-call parsers, one per model family's output format, behind `ToolParser` (base.py).

    get_tool_parser("hermes")                 -> a parser by format name

Which format a checkpoint speaks is chat/registry.py's choice (template, then architecture).

ChatML families (Llama-architecture SmolLM2, Qwen, Mixtral/OLMoE fine-tunes) speak the Hermes
format; DeepSeek-V3/R1 and V3.1 their own (deepseek.py); Llama 4 pythonic lists of calls
(`[get_weather(city="Paris")]`, pythonic.py); a family with its own format registers here.
"""

from __future__ import annotations

from collections.abc import Callable

from chat.tool_parsers.base import (
    ParsedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallStream,
    ToolParser,
    new_tool_call_id,
)
from chat.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from chat.tool_parsers.hermes import HermesToolParser
from chat.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser

__all__ = [
    "ParsedToolCalls", "StreamDelta", "ToolCall", "ToolCallStream", "ToolParser",
    "HermesToolParser", "DeepSeekV3ToolParser", "DeepSeekV31ToolParser", "PythonicToolParser",
    "Llama4PythonicToolParser", "new_tool_call_id", "get_tool_parser", "TOOL_PARSERS",
]

TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,  # DeepSeek-V3 and -R1
    "deepseek_v3_1": DeepSeekV31ToolParser,
    "pythonic": PythonicToolParser,  # Llama 3.2, ToolACE
    "llama4_pythonic": Llama4PythonicToolParser,  # Llama 4 (also its JSON calls)
}


def get_tool_parser(name: str) -> ToolParser:
    """A new parser for the format `name`; KeyError names the known formats."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise KeyError(f"unknown tool parser {name!r}; known: {sorted(TOOL_PARSERS)}") from None
