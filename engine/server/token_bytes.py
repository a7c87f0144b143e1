"""Each token's raw bytes, for OpenAI logprobs (`bytes`, and `token` when the bytes are not text).

A byte-level BPE token may hold part of a UTF-8 character (an emoji or a CJK character is often
two or three tokens). Decoding such a token alone gives U+FFFD, whose bytes are not the token's,
so the bytes come from the vocabulary itself:

  - a tokenizer that knows them (`token_bytes(id)`, e.g. the tests' byte tokenizer) says so;
  - a byte-level BPE (`tokenizers` ByteLevel decoder, GPT-2's byte -> character table) spells
    them in its token string;
  - a SentencePiece byte-fallback token is `<0xNN>`;
  - anything else (special tokens, other decoders) is its decoded text in UTF-8.

As OpenAI does, a token whose bytes are not valid UTF-8 is named `bytes:\\xNN...`.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable
from typing import Any

from chat.gguf_vocab import byte_alphabet

TokenBytes = Callable[[int], bytes]  # token id -> its raw bytes

_BYTE_OF_CHAR = {char: byte for byte, char in byte_alphabet().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_TABLES: weakref.WeakKeyDictionary[Any, TokenBytes] = weakref.WeakKeyDictionary()


def token_bytes_of(tokenizer: Any) -> TokenBytes:
    """The (memoized) token id -> bytes function of `tokenizer` (the vocabulary is fixed)."""
    table = _TABLES.get(tokenizer)
    if table is None:
        table = _TABLES[tokenizer] = _table(tokenizer)
    return table


def token_string(raw: bytes) -> str:
    """OpenAI's `token`: the text, or `bytes:\\xNN...` for bytes that are not whole UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def _table(tokenizer: Any) -> TokenBytes:
    known = getattr(tokenizer, "token_bytes", None)
    backend = getattr(tokenizer, "backend", None)
    is_byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
    added = set(backend.get_added_tokens_decoder()) if backend is not None else set()
    @functools.cache
    def lookup(token_id: int) -> bytes:
        if known is not None:
            return bytes(known(token_id))
        if backend is not None and token_id not in added:
            piece = backend.id_to_token(token_id)
            if piece is not None:
                if is_byte_level and all(char in _BYTE_OF_CHAR for char in piece):
                    return bytes(_BYTE_OF_CHAR[char] for char in piece)
                fallback = _BYTE_FALLBACK.fullmatch(piece)
                if fallback is not None:
                    return bytes([int(fallback.group(1), 16)])
        return str(tokenizer.decode([token_id])).encode("utf-8")

    return lookup
