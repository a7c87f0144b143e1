"""Text completions (/v1/completions) through the openai SDK."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from engine.outputs import FinishReason, TokenLogprob
from engine.server.responses import completion_logprobs
from tests.engine.server.fakes import FAKE_LOGPROB, FakeEngine
from tests.engine.server.test_chat import sse_events


def test_string_prompt_completes_with_usage(client: openai.OpenAI, fake_engine: FakeEngine,
                                            model: str) -> None:
    completion = client.completions.create(model=model, prompt="Once upon")
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert completion.choices[0].text == fake_engine.reply
    assert completion.choices[0].finish_reason == "stop"
    assert fake_engine.calls[0].prompt_token_ids == list(b"Once upon")
    assert completion.usage is not None and completion.usage.prompt_tokens == len("Once upon")


def test_token_id_prompts_and_n_give_prompt_major_choices(
        client: openai.OpenAI, fake_engine: FakeEngine, model: str) -> None:
    completion = client.completions.create(model=model, prompt=[[72, 105], [79, 107, 33]], n=2,
                                           max_tokens=2)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    prompts = {call.request_id.rsplit("-", 1)[1]: call.prompt_token_ids
               for call in fake_engine.calls}
    assert prompts == {"0": [72, 105], "1": [72, 105], "2": [79, 107, 33], "3": [79, 107, 33]}
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 2 + 3  # each prompt counted once
    assert completion.usage.completion_tokens == 4 * 2


def test_completion_logprobs_have_openai_shape(client: openai.OpenAI, model: str) -> None:
    completion = client.completions.create(model=model, prompt="x", logprobs=2, max_tokens=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["H", "e", "l"]
    assert logprobs.token_logprobs == [-0.25, -0.25, -0.25]
    assert logprobs.text_offset == [0, 1, 2]
    assert logprobs.top_logprobs is not None and list(logprobs.top_logprobs[0]) == ["H", "b"]


def test_completion_top_logprobs_hold_the_sampled_token(client: openai.OpenAI, model: str) -> None:
    # OpenAI: "The API will always return the logprob of the sampled token, so there may be up
    # to logprobs+1 elements"; logprobs=0 gave empty dicts
    completion = client.completions.create(model=model, prompt="x", logprobs=0, max_tokens=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens
    assert logprobs.top_logprobs == [{token: FAKE_LOGPROB} for token in logprobs.tokens]


def test_a_sampled_token_outside_the_top_comes_after_them() -> None:
    entry = TokenLogprob(ord("c"), -3.0, top=((ord("a"), -0.1), (ord("b"), -0.5)))
    logprobs, end = completion_logprobs([entry], lambda tid: bytes([tid]), first_offset=4)
    assert logprobs["top_logprobs"] == [{"a": -0.1, "b": -0.5, "c": -3.0}]
    assert (logprobs["text_offset"], end) == ([4], 5)


def test_streamed_text_offsets_equal_the_whole_answers_when_text_is_held_back(
        http: httpx.Client, fake_engine: FakeEngine, model: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the real detokenizer holds text back while it may still begin a stop string and releases
    # it with a later token; the stream counted offsets in the text sent so far: [0, 0, 2]
    steps = [(ord("a"), "", None), (ord("b"), "ab", None), (ord("c"), "c", FinishReason.LENGTH)]
    monkeypatch.setattr(fake_engine, "_script", lambda reply, params, limit: steps)
    body = {"model": model, "prompt": "x", "logprobs": 1, "max_tokens": 3}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        chunks = [orjson.loads(e) for e in sse_events(response)[:-1]]
    pieces = [choice for chunk in chunks for choice in chunk["choices"] if choice["logprobs"]]
    assert whole["text"] == "abc" and whole["logprobs"]["text_offset"] == [0, 1, 2]
    assert [o for piece in pieces for o in piece["logprobs"]["text_offset"]] == [0, 1, 2]


def test_streamed_completion_concatenates_to_the_reply(http: httpx.Client, fake_engine: FakeEngine,
                                                       model: str) -> None:
    body = {"model": model, "prompt": "x", "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == fake_engine.reply
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 1


def test_empty_prompt_is_rejected(http: httpx.Client, model: str) -> None:
    for prompt in ("", [], [[]], ["a", ""]):
        response = http.post("/v1/completions", json={"model": model, "prompt": prompt})
        assert response.status_code == 400, prompt


def test_out_of_vocabulary_token_ids_are_rejected(http: httpx.Client, model: str) -> None:
    response = http.post("/v1/completions", json={"model": model, "prompt": [1, 99999]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
