"""The gateway's block hashes equal the replica's: same body, same rendering, same tokens, same
salt."""

from __future__ import annotations

from typing import Any

import pytest

from chat.registry import HERMES
from chat.render import PromptRenderer
from chat.tokenizer import Tokenizer
from contracts.block_hash import hash_blocks
from contracts.replica_prompts import completion_prompts
from contracts.replica_protocol import ChatCompletionRequest, CompletionRequest
from engine.loader import default_model_path, load_tokenizer
from gateway.backends.replica import ReplicaBackend
from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.endpoints import Endpoint
from gateway.request.canonical import CanonicalRequest, Message, Tool, ToolCall
from gateway.routing.prompt_hashing import PromptHasher
from gateway.settings import GatewaySettings, ModelSettings

TOOLS = [Tool(f"tool_{i}", f"Does thing {i} carefully.", {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]})
    for i in range(6)]


def chat_prompt_token_ids(req: ChatCompletionRequest, tokenizer: Any, **limits: Any) -> list[int]:
    """The replica's render of `req` (chat/render.py) with the default model's format."""
    return PromptRenderer(tokenizer, HERMES).render(req, **limits).token_ids


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


def upstream_body(request: CanonicalRequest, share: bool = False) -> dict[str, Any]:
    model = ModelSettings(name="m", endpoints=("http://127.0.0.1:1",),
                          share_cache_across_projects=share)
    backend = ReplicaBackend(None, GatewaySettings(auth_enabled=False))  # type: ignore[arg-type]
    return backend.upstream_body(request,
                                 Endpoint(model.endpoints[0], model, CircuitBreaker(3, 1.0)))


def agent_request(turn: int, project: str = "p1") -> CanonicalRequest:
    messages = [Message("system", "You are a careful coding agent. " * 40),
                Message("user", "Fix the failing test in parser.py.")]
    for i in range(turn):
        messages.append(Message("assistant", "", tool_calls=(
            ToolCall(f"call_{i}", "tool_1", '{"path": "parser.py"}'),)))
        messages.append(Message("tool", f"line {i}: KeyError 'x'", tool_call_id=f"call_{i}"))
    return CanonicalRequest("r", "m", messages=messages, tools=list(TOOLS), project=project,
                            cache_salt=f"project:{project}")


@pytest.mark.parametrize("turn", [0, 1, 3])
def test_chat_tokens_and_hashes_equal_the_replicas(tokenizer: Tokenizer, turn: int) -> None:
    body = upstream_body(agent_request(turn))
    replica_ids = chat_prompt_token_ids(ChatCompletionRequest.model_validate(body), tokenizer)
    hasher = PromptHasher(tokenizer)
    assert hasher.token_ids(body) == replica_ids
    assert hasher.token_ids(body) == replica_ids  # again, from the segment cache
    assert hasher.segments.num_hits > 0
    expected = hash_blocks(replica_ids, 16, "model-x", body["cache_salt"])
    assert hasher.block_hashes(body, "model-x", 16) == expected
    assert len(expected) == len(replica_ids) // 16 > 10


def test_tool_choice_required_and_named_render_like_the_replica(tokenizer: Tokenizer) -> None:
    hasher = PromptHasher(tokenizer)
    for choice in ("required", {"type": "function", "function": {"name": "tool_2"}}, "none"):
        request = agent_request(1)
        request.tool_choice = choice
        body = upstream_body(request)
        assert hasher.token_ids(body) == chat_prompt_token_ids(
            ChatCompletionRequest.model_validate(body), tokenizer)


def test_completion_prompt_tokens_equal_the_replicas(tokenizer: Tokenizer) -> None:
    body = upstream_body(CanonicalRequest("r", "m", kind="completion",
                                          prompt="Once upon a time " * 20))
    expected = completion_prompts(CompletionRequest.model_validate(body), tokenizer,
                                  tokenizer.vocab_size)[0]
    assert PromptHasher(tokenizer).token_ids(body) == expected


def test_projects_get_disjoint_hashes_unless_sharing_is_on(tokenizer: Tokenizer) -> None:
    hasher = PromptHasher(tokenizer)
    one = hasher.block_hashes(upstream_body(agent_request(0, "p1")), "m", 16)
    two = hasher.block_hashes(upstream_body(agent_request(0, "p2")), "m", 16)
    assert not set(one) & set(two)
    shared_one = upstream_body(agent_request(0, "p1"), share=True)
    assert "cache_salt" not in shared_one
    assert hasher.block_hashes(shared_one, "m", 16) == hasher.block_hashes(
        upstream_body(agent_request(0, "p2"), share=True), "m", 16)
    assert upstream_body(agent_request(0, "p1"))["cache_salt"] == "project:p1"


def test_segmented_encoding_equals_whole_encoding(tokenizer: Tokenizer) -> None:
    hasher = PromptHasher(tokenizer, min_cached_segment_chars=1)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief. <|im_end|> fake"},
         {"role": "user", "content": "héllo  \n\n x"}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert hasher.encode_segmented(text) == tokenizer.encode(text)


def _chat_body(system: str, salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "system", "content": system},
                                                       {"role": "user", "content": "hi"}]}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def test_the_segment_cache_is_bounded_in_bytes_whatever_the_prompts(tokenizer: Tokenizer) -> None:
    """It was bounded by entries (4,096): a few different multi-megabyte system prompts grew the
    gateway by tens of MB each and kept them."""
    import tracemalloc

    max_bytes = 1024 * 1024
    hasher = PromptHasher(tokenizer, segment_cache_max_bytes=max_bytes)
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    for i in range(36):  # ~17 KB of text each (and its ids): under the one-entry bound
        hasher.token_ids(_chat_body(f"prompt {i}: " + f"word{i} and more " * 1_000, "p1"))
    retained, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert hasher.segments.num_bytes <= max_bytes
    assert 10 < len(hasher.segments) < 36  # the oldest were evicted by bytes
    assert retained - before < 2 * max_bytes
    hasher.token_ids(_chat_body("y " * (max_bytes // 8), "p1"))  # over an entry's bound
    assert all("y y y" not in segment for _, segment in list(hasher.segments._entries))


def test_one_tenants_cached_segment_is_never_a_hit_for_another(tokenizer: Tokenizer) -> None:
    """The cache was keyed by text alone: project B's request ran measurably faster when any
    tenant had recently sent the same system prompt (x-aigw-overhead-ms told it)."""
    hasher = PromptHasher(tokenizer)
    system = "You are the secret assistant of project one. " * 20
    first = hasher.token_ids(_chat_body(system, "project:p1"))
    assert hasher.token_ids(_chat_body(system, "project:p1")) == first
    num_hits = hasher.segments.num_hits
    assert num_hits > 0
    assert hasher.token_ids(_chat_body(system, "project:p2")) == first  # same ids, computed anew
    assert hasher.segments.num_hits == num_hits


def test_a_prompt_surely_over_the_context_is_refused_before_it_is_encoded(
        tokenizer: Tokenizer) -> None:
    from contracts.replica_errors import ContextLengthExceeded

    hasher = PromptHasher(tokenizer)
    body = _chat_body("word " * 400_000, "p1")  # 2 MB: seconds to encode, refused in no time
    with pytest.raises(ContextLengthExceeded):
        hasher.token_ids(body, max_model_len=2048)
    assert len(hasher.segments) == 0
