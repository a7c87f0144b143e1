"""Chat formats, torch-free: the tokenizer, the chat template, and each model family's output
parsers (tool calls, reasoning). Imported by the engine's server and by the gateway; it imports
neither (nor torch).

    load_tokenizer(path)            -> Tokenizer (encode/decode/chat template)
    chat.registry.chat_format_for(...)  -> a family's renderer and parsers (chat/registry.py)

See docs/design/chat-formats.md.
"""

from __future__ import annotations

from chat.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
