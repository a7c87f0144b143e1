"""Request bodies map onto SamplingParams with OpenAI's semantics."""

from __future__ import annotations

from contracts.replica_protocol import ChatCompletionRequest, CompletionRequest, per_choice_params
from contracts.sampling_params import SamplingParams

USER = [{"role": "user", "content": "hi"}]


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    both = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": USER, "max_tokens": 5, "max_completion_tokens": 9})
    legacy = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "max_tokens": 5})
    assert both.to_sampling_params().max_tokens == 9
    assert legacy.to_sampling_params().max_tokens == 5


def test_defaults_are_openai_defaults() -> None:
    params = ChatCompletionRequest.model_validate({"model": "m", "messages": USER}
                                                  ).to_sampling_params()
    assert (params.temperature, params.top_p, params.max_tokens, params.n) == (1.0, 1.0, None, 1)
    assert (params.logprobs, params.top_logprobs, params.stop) == (False, 0, ())


def test_single_stop_string_becomes_a_tuple() -> None:
    body = {"model": "m", "messages": USER, "stop": "END"}
    assert ChatCompletionRequest.model_validate(body).to_sampling_params().stop == ("END",)


def test_completion_logprobs_count_means_top_logprobs() -> None:
    zero = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 0})
    three = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 3})
    assert (zero.to_sampling_params().logprobs, zero.to_sampling_params().top_logprobs) == (True, 0)
    assert three.to_sampling_params().top_logprobs == 3
    none = CompletionRequest.model_validate({"model": "m", "prompt": "x"}).to_sampling_params()
    assert none.logprobs is False


def test_per_choice_params_offset_the_seed_and_split_n() -> None:
    params = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": USER, "n": 3, "seed": 100}).to_sampling_params()
    assert [(p.seed, p.n) for p in (per_choice_params(params, i) for i in range(3))] == [
        (100, 1), (101, 1), (102, 1)]
    unseeded = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "n": 2})
    assert per_choice_params(unseeded.to_sampling_params(), 1).seed is None
    edge = SamplingParams(seed=(1 << 63) - 1, n=2)  # seed + choice wraps within 64 signed bits
    assert [per_choice_params(edge, i).seed for i in range(2)] == [(1 << 63) - 1, -(1 << 63)]


def test_tool_choice_none_keeps_tools_out() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    off = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": USER, "tools": tools, "tool_choice": "none"})
    auto = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": tools})
    assert not off.uses_tools and auto.uses_tools
