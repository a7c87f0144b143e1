"""Tokenizers for tests that drive the fake engine with a family's real chat format: a byte-level
one carrying the real Qwen3 template, and gpt-oss's o200k_harmony ids through openai-harmony."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import chat.harmony
from chat.gguf_vocab import byte_alphabet
from chat.tokenizer import Tokenizer as ChatTokenizer

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3.jinja").read_text()


def qwen3_like_tokenizer() -> ChatTokenizer:
    """Byte-level, one token per byte, plus Qwen3's added tokens; the real Qwen3 template."""
    alphabet = byte_alphabet()
    backend = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    im_end = backend.token_to_id("<|im_end|>")
    return ChatTokenizer(backend, chat_template=QWEN3_TEMPLATE, bos_token_id=None,
                         eos_token_id=im_end)


class HarmonyTokenizer:
    """gpt-oss's o200k_harmony ids, through openai-harmony's own encoder."""

    eos_token_ids = (200002, 200012)  # <|return|>, <|call|>
    vocab_size = 201088
    max_token_bytes = None

    def __init__(self) -> None:
        self.encoding = chat.harmony.load_encoding()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.encoding.encode(text, allowed_special="all"))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.encoding.decode(list(ids)))

    def token_to_id(self, token: str) -> int | None:
        ids = self.encode(token)
        return ids[0] if len(ids) == 1 and self.encoding.is_special_token(ids[0]) else None
