"""OpenAI legacy Completions: POST /v1/completions (prompts as text or token ids, one or several
in a request; `echo` forwarded: the upstream puts the prompt, and its logprobs, before each
choice)."""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.dialects import openai_common as common
from gateway.dialects.base import Dialect, StreamEncoder
from gateway.dialects.validate import InvalidParam, get_bool, get_int, get_str, need_object
from gateway.request.canonical import (
    CanonicalEvent,
    CanonicalRequest,
    CanonicalResponse,
    PromptUsage,
    TextDelta,
)


def _is_token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value))


def _parse_prompts(value: Any) -> list[str] | list[list[int]]:
    """The request's prompts, as OpenAI takes them: a string, an array of token ids, or an array
    of several strings or of several token-id arrays (not both)."""
    if isinstance(value, str) or _is_token_ids(value):
        return [value]
    if value is None:
        raise InvalidParam("prompt", "is required")
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return value
        if all(_is_token_ids(p) for p in value):
            return value
    raise InvalidParam("prompt", "expected a string, an array of token ids, or a non-empty array "
                       "of strings or of token-id arrays")


class OpenAICompletions(Dialect):
    name = "openai"

    def parse(self, body: Any, request_id: str) -> CanonicalRequest:
        body = need_object(body, "body")
        request = CanonicalRequest(request_id, get_str(body, "model", required=True,
                                                       allow_empty=False) or "", kind="completion")
        prompts: list[str | list[int]] = list(_parse_prompts(body.get("prompt")))
        first, *request.extra_prompts = prompts
        if isinstance(first, str):
            request.prompt = first
        else:
            request.prompt_token_ids = first
        request.echo = bool(get_bool(body, "echo"))
        common.parse_sampling(body, request, max_tokens_keys=("max_tokens",))
        if request.num_choices > common.MAX_NUM_CHOICES:
            raise InvalidParam("n", f"at most {common.MAX_NUM_CHOICES} choices (prompts x n) "
                               "in one request")
        top_logprobs = get_int(body, "logprobs", minimum=0, maximum=5)  # the legacy API's bound
        request.logprobs, request.top_logprobs = top_logprobs is not None, top_logprobs or 0
        if request.max_tokens is None:
            request.max_tokens = 16  # the legacy API's documented default
        return request

    def render(self, request: CanonicalRequest, response: CanonicalResponse) -> dict[str, Any]:
        return {"id": f"cmpl-{request.request_id}", "object": "text_completion",
                "created": int(time.time()), "model": request.model,
                "choices": [{"text": choice.text, "index": index,
                             "logprobs": common.joined_logprobs(choice.logprobs),
                             "finish_reason": choice.finish_reason or "stop"}
                            for index, choice in enumerate((response, *response.others))],
                "usage": common.usage_json(response.usage)}

    def encoder(self, request: CanonicalRequest) -> StreamEncoder:
        return _CompletionEncoder(request)

    def error_body(self, status: int, code: str, message: str, param: str | None = None,
                   error_type: str | None = None) -> dict[str, Any]:
        return common.error_body(status, code, message, param, error_type)


class _CompletionEncoder(StreamEncoder):
    def __init__(self, request: CanonicalRequest) -> None:
        self._request = request
        self._head = (b'data: {"id":"cmpl-' + request.request_id.encode()
                      + b'","object":"text_completion","created":' + str(int(time.time())).encode()
                      + b',"model":' + orjson.dumps(request.model) + b',"choices":[{"text":')

    def start(self, prompt: PromptUsage | None = None) -> bytes:
        return b""

    def event(self, event: CanonicalEvent) -> bytes:
        if not isinstance(event, TextDelta):
            return b""
        return (self._head + orjson.dumps(event.text) + b',"index":' + str(event.choice).encode()
                + b',"logprobs":' + common.logprobs_bytes(event.logprobs)
                + b',"finish_reason":null}]}\n\n')

    def finish(self, response: CanonicalResponse) -> bytes:
        out = b"".join(self._head + b'"","index":' + str(index).encode()
                       + b',"logprobs":null,"finish_reason":'
                       + orjson.dumps(choice.finish_reason or "stop") + b"}]}\n\n"
                       for index, choice in enumerate((response, *response.others)))
        if self._request.include_usage:
            out += common.sse_data({
                "id": f"cmpl-{self._request.request_id}", "object": "text_completion",
                "created": int(time.time()), "model": self._request.model, "choices": [],
                "usage": common.usage_json(response.usage)})
        return out + common.SSE_DONE

    def error(self, status: int, code: str, message: str) -> bytes:
        return common.sse_data(common.error_body(status, code, message))
