"""A prompt whose byte length alone proves it cannot fit is refused before it is encoded: encoding
megabytes took seconds and stalled every running stream of the replica (an 8 MB prompt: 20 s)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from chat.registry import HERMES
from chat.render import PromptRenderer
from chat.tokenizer import Tokenizer
from contracts.replica_errors import ContextLengthExceeded
from contracts.replica_prompts import completion_prompts
from contracts.replica_protocol import ChatCompletionRequest, CompletionRequest
from engine.loader import default_model_path, load_tokenizer

MAX_MODEL_LEN = 1456


def chat_prompt_token_ids(req: ChatCompletionRequest, tokenizer: Any, **limits: Any) -> list[int]:
    """The replica's render of `req` (chat/render.py) with the default model's format."""
    return PromptRenderer(tokenizer, HERMES).render(req, **limits).token_ids


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


class _NoBigEncodes:
    """The tokenizer, except that encoding a long text fails the test."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert len(text) < 100_000, "a prompt sure not to fit was encoded"
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_a_chat_prompt_megabytes_over_the_context_is_refused_without_encoding(tokenizer):
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "q7 " * 1_000_000}]})
    with pytest.raises(ContextLengthExceeded) as refused:
        chat_prompt_token_ids(req, _NoBigEncodes(tokenizer), max_tokens=4,
                              max_model_len=MAX_MODEL_LEN)
    assert refused.value.param == "messages"
    assert "at least" in str(refused.value) and f"is {MAX_MODEL_LEN} tokens" in str(refused.value)


def test_a_completion_prompt_megabytes_over_the_context_is_refused_without_encoding(tokenizer):
    req = CompletionRequest.model_validate({"model": "m", "prompt": ["hi", "é " * 1_000_000]})
    with pytest.raises(ContextLengthExceeded):
        completion_prompts(req, _NoBigEncodes(tokenizer), tokenizer.vocab_size, max_tokens=None,
                           max_model_len=MAX_MODEL_LEN)


def test_prompts_that_may_fit_are_encoded_as_before(tokenizer):
    messages = [{"role": "user", "content": "Say hi " * 100}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    bounded = chat_prompt_token_ids(req, tokenizer, max_tokens=4, max_model_len=MAX_MODEL_LEN)
    assert bounded == chat_prompt_token_ids(req, tokenizer) == tokenizer.encode_chat(messages)


def test_max_token_bytes_is_a_lower_bound_on_the_token_count(tokenizer):
    assert tokenizer.max_token_bytes is not None
    rnd = random.Random(3)
    alphabet = ["a", "z", " ", "  ", "\n", "\n\n", "    ", "é", "世界", "🌍", "0", "123", ".",
                "<|im_end|>", " " * 81, "\t", "the", " the"]
    for _ in range(200):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 300)))
        num_tokens = len(tokenizer.encode(text))
        assert num_tokens >= len(text.encode("utf-8")) // tokenizer.max_token_bytes, text
