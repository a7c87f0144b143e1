"""Text completions (/v1/completions) through the openai SDK."""

from __future__ import annotations

import httpx
import openai
import orjson

from tests.server.fakes import FakeEngine
from tests.server.test_chat import sse_events


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
    prompts = {call.request_id.rsplit("-", 1)[1]: call.prompt_token_ids for call in fake_engine.calls}
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
