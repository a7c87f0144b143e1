"""A stream cut before its usage chunk is billed with the prompt count the upstream announced."""

from __future__ import annotations

from auth.principal import Principal
from gateway.backends.openai_compat import _announced_prompt
from gateway.canonical import Accumulator, CanonicalRequest, Message, PromptUsage, TextDelta
from gateway.settings import ModelSettings
from gateway.usage import build_record


def test_announced_prompt_is_read_from_the_replicas_headers_only_when_well_formed() -> None:
    assert _announced_prompt({"x-aigw-prompt-tokens": "38", "x-aigw-cached-tokens": "16"}) == \
        PromptUsage(38, 16)
    assert _announced_prompt({"x-aigw-prompt-tokens": "38"}) == PromptUsage(38, 0)
    assert _announced_prompt({}) is None
    assert _announced_prompt({"x-aigw-prompt-tokens": "many"}) is None


def test_a_cut_stream_bills_the_announced_prompt_and_the_text_received() -> None:
    request = CanonicalRequest("r1", "m", messages=[Message("user", "x" * 400)], stream=True)
    accumulator = Accumulator()
    accumulator.add(PromptUsage(38, 16))
    accumulator.add(TextDelta("Hello there, how are"))
    record = build_record(request, Principal(project="p", key_id="k", scopes=frozenset()), ModelSettings(name="m", endpoints=("http://127.0.0.1:1",)),
                          "e", accumulator, 499, 1.0)
    assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (38, 16, 5)
    assert accumulator.response().text == "Hello there, how are"
