"""Logprobs carry each token's own bytes: a byte-level token holding part of a UTF-8 character
(an emoji, a CJK character) is not U+FFFD, and its bytes join into the answer's text."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from engine import loader
from engine.server.token_bytes import token_bytes_of, token_string
from tests.engine.server.fakes import FakeEngine

REPLY = "用中文 🎉 héllo"


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    return loader.load_tokenizer(loader.default_model_path())


@pytest.fixture
def engine(smollm2_tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer=smollm2_tokenizer, reply=REPLY, max_model_len=8192)


def test_byte_level_tokens_give_their_own_bytes(smollm2_tokenizer: Any) -> None:
    token_bytes = token_bytes_of(smollm2_tokenizer)
    ids = smollm2_tokenizer.encode(REPLY + "<|im_end|>")
    assert b"".join(token_bytes(i) for i in ids).decode() == REPLY + "<|im_end|>"
    names = [token_string(token_bytes(i)) for i in ids]
    assert any(name.startswith("bytes:\\x") for name in names)  # the emoji is split
    assert "\ufffd" not in "".join(names)


def test_chat_logprob_bytes_join_into_the_answer(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.create(model=model, logprobs=True, top_logprobs=1,
                                                messages=[{"role": "user", "content": "hi"}])
    choice = completion.choices[0]  # (the fake's text decodes token by token: not compared)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    joined = bytes(b for entry in choice.logprobs.content for b in entry.bytes or ())
    assert joined.startswith(REPLY.encode())
    for entry in choice.logprobs.content:
        assert entry.top_logprobs[0].bytes == entry.bytes
        assert "\ufffd" not in entry.token


def test_completion_logprob_tokens_name_partial_characters_by_their_bytes(
        client: openai.OpenAI, model: str) -> None:
    completion = client.completions.create(model=model, prompt="x", logprobs=1, max_tokens=8)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert "\ufffd" not in "".join(logprobs.tokens)
    assert any(token.startswith("bytes:\\x") for token in logprobs.tokens)
    assert logprobs.top_logprobs is not None
    assert [list(top) for top in logprobs.top_logprobs] == [[t] for t in logprobs.tokens]
