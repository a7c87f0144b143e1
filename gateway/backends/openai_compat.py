"""Any OpenAI-compatible upstream (vLLM, SGLang, llama.cpp server, Ollama, a hosted API).

Streams always ask for `stream_options.include_usage`, so usage is never lost; if an upstream still
sends none, tokens are counted here: with the model's tokenizer (`ModelSettings.tokenizer`, a
tokenizer.json) when configured, else `canonical.estimate_num_tokens` (~4 characters per token,
but at least one token per non-empty delta).
Endpoint URLs are origins (`http://host:port`); `/v1/...` paths are appended.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import AsyncIterator, Mapping
from functools import lru_cache
from typing import Any

import orjson

from chat.tokenizer import encode_ids
from contracts.usage_headers import CACHED_TOKENS_HEADER, PROMPT_TOKENS_HEADER
from gateway.backends.base import Backend
from gateway.backends.embeddings import embedding_body, read_embeddings
from gateway.fleet.endpoints import Endpoint
from gateway.request.canonical import (
    Accumulator,
    CanonicalEvent,
    CanonicalRequest,
    EmbeddingVectors,
    Finish,
    FinishReason,
    PromptUsage,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
    estimate_num_tokens,
    estimate_prompt_tokens,
)
from gateway.request.errors import (
    UpstreamOverloaded,
    UpstreamRejected,
    UpstreamThrottled,
    UpstreamUnavailable,
)
from gateway.upstream.transport import (
    PROBE_BODY_MAX_BYTES,
    UpstreamRequest,
    UpstreamResponse,
    read_error_body,
    send_observed,
)

log = logging.getLogger("aigw.gateway")

_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop", "length": "length", "tool_calls": "tool_calls", "function_call": "tool_calls",
    "content_filter": "content_filter", "eos": "stop",
}


class OpenAICompatBackend(Backend):
    name = "openai"
    # what embeddings are asked for upstream: None, the client's encoding_format (any upstream
    # takes "float"); our replicas get "base64" (a third of the bytes, no float printing)
    embedding_encoding: str | None = None

    def upstream_body(self, request: CanonicalRequest, endpoint: Endpoint) -> dict[str, Any]:
        body: dict[str, Any] = {"model": endpoint.model.upstream_name, "stream": request.stream}
        if request.kind == "chat":
            body["messages"] = [_message_json(m) for m in request.messages]
            if request.tools:
                body["tools"] = [{"type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": t.parameters}}
                    for t in request.tools]
            if request.tool_choice is not None:
                body["tool_choice"] = request.tool_choice
            if request.tools and request.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = request.parallel_tool_calls
            if request.response_format is not None:
                body["response_format"] = request.response_format
            if request.reasoning_effort is not None:
                body["reasoning_effort"] = request.reasoning_effort
            if request.chat_template_kwargs:
                body["chat_template_kwargs"] = request.chat_template_kwargs
        else:
            first = request.prompt if request.prompt_token_ids is None else request.prompt_token_ids
            body["prompt"] = [first, *request.extra_prompts] if request.extra_prompts else first
            if request.echo:
                body["echo"] = True
        if request.stream:
            body["stream_options"] = {"include_usage": True}
        for key in ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty",
                    "frequency_penalty"):
            value = getattr(request, key)
            if value is not None:
                body[key] = value
        if request.stop:
            body["stop"] = request.stop
        if request.n > 1:
            body["n"] = request.n
        salt = self.upstream_cache_salt(request, endpoint)
        if salt is not None:
            body["cache_salt"] = salt
        if request.logprobs:
            if request.kind == "chat":
                body["logprobs"] = True
                if request.top_logprobs:
                    body["top_logprobs"] = request.top_logprobs
            else:
                body["logprobs"] = request.top_logprobs  # the legacy API's form: an integer
        return body

    def upstream_cache_salt(self, request: CanonicalRequest, endpoint: Endpoint) -> str | None:
        """The `cache_salt` the upstream gets: a 32-hex digest of the tenant's salt (stable across
        gateways, so one tenant shares its own cache; the upstream never sees a project's name),
        unless the model shares its cache across projects or `send_cache_salt` is off."""
        model = endpoint.model
        if (not request.cache_salt or model.share_cache_across_projects
                or not model.send_cache_salt):
            return None
        return _salt_digest(request.cache_salt)

    def upstream_headers(self, request: CanonicalRequest, endpoint: Endpoint) -> dict[str, str]:
        return {"content-type": "application/json", "x-request-id": request.request_id,
                **endpoint.auth_headers}

    def embedding_body(self, request: CanonicalRequest, endpoint: Endpoint) -> dict[str, Any]:
        return embedding_body(request, endpoint, self.embedding_encoding)

    async def stream(self, request: CanonicalRequest,
                     endpoint: Endpoint) -> AsyncIterator[CanonicalEvent]:
        if request.kind == "embedding":
            async for event in self._embed(request, endpoint):
                yield event
            return
        path = "/v1/chat/completions" if request.kind == "chat" else "/v1/completions"
        try:
            payload = orjson.dumps(self.upstream_body(request, endpoint))
        except orjson.JSONEncodeError:  # orjson writes 254 levels, while a client's body is read up
            # to 1024: a JSON schema (response_format, tool parameters) nested deeper is refused
            raise UpstreamRejected("the request is nested too deeply to be forwarded (a JSON "
                                   "schema of more than ~250 levels)", status=400,
                                   code="invalid_request") from None
        upstream = UpstreamRequest("POST", endpoint.url + path, payload,
                                   self.upstream_headers(request, endpoint),
                                   self.settings.connect_timeout_s)
        call = request.observer.on_upstream_call(upstream)  # (a traced request's CLIENT span)
        response = await send_observed(self.transport, upstream, call)
        is_answered = False  # the whole answer read: its connection may serve another call
        try:
            if response.status >= 400:
                await _raise_for_status(response)
            accumulator = Accumulator()
            usage: Usage | None = None
            if request.stream:
                # yielded with the first chunk, not on the headers alone: the first event is
                # what commits the gateway to this upstream, and one that dies after its headers
                # must still be retried elsewhere
                announced = _announced_prompt(response.headers)
                async for event in _parse_stream(response, request.kind):
                    if announced is not None:
                        yield announced
                        announced = None
                    if isinstance(event, Usage):
                        usage = event
                        continue
                    accumulator.add(event)
                    if not isinstance(event, Finish):
                        yield event
                if announced is not None:  # a stream of no chunk at all
                    yield announced
            else:  # one body: parsed at once, then yielded (no generator per event)
                for event in _whole_events(await _read_json(
                        response, self.settings.max_upstream_answer_bytes), request.kind):
                    if isinstance(event, Usage):
                        usage = event
                        continue
                    accumulator.add(event)
                    if not isinstance(event, Finish):
                        yield event
            for choice in accumulator.choices:
                folded = accumulator.others[choice] if choice else accumulator
                yield Finish(folded.finish_reason or "stop", folded.stop_sequence, choice)
            is_answered = True
            yield usage or self._count_usage(request, endpoint, accumulator)
        except Exception as exc:
            if call is not None and response.status < 400:  # the body broke off
                call.on_failed(exc)
            raise
        finally:
            if is_answered:
                response.release()
            else:
                response.close()
            if call is not None:
                call.on_ended()

    async def _embed(self, request: CanonicalRequest, endpoint: Endpoint
                     ) -> AsyncIterator[CanonicalEvent]:
        """POST /v1/embeddings: EmbeddingVectors, Finish, Usage (the prompt's tokens only)."""
        upstream = UpstreamRequest("POST", endpoint.url + "/v1/embeddings",
                                   orjson.dumps(self.embedding_body(request, endpoint)),
                                   self.upstream_headers(request, endpoint),
                                   self.settings.connect_timeout_s)
        call = request.observer.on_upstream_call(upstream)
        response = await send_observed(self.transport, upstream, call)
        is_answered = False
        try:
            if response.status >= 400:
                await _raise_for_status(response)
            body = await _read_json(response, self.settings.max_upstream_answer_bytes)
            vectors = read_embeddings(body, request.num_prompts)
            is_answered = True
            yield EmbeddingVectors(vectors)
            yield Finish("stop")
            usage = body.get("usage") if isinstance(body, dict) else None
            num_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            if not isinstance(num_tokens, int) or num_tokens < 0:
                num_tokens = self.count_prompt_tokens(request, endpoint)
            yield Usage(num_tokens, 0)
        finally:
            if is_answered:
                response.release()
            else:
                response.close()
            if call is not None:
                call.on_ended()

    def _count_usage(self, request: CanonicalRequest, endpoint: Endpoint,
                     acc: Accumulator) -> Usage:
        response = acc.response()
        completion = "".join(choice.text + "".join(c.arguments for c in choice.tool_calls)
                             for choice in (response, *response.others))
        tokenizer_path = endpoint.model.tokenizer
        # without a tokenizer: ~4 characters a token, but at least one per non-empty delta (a
        # stream of digits is a token or two a delta, a quarter of what the characters say)
        num_completion_tokens = (len(encode_ids(_load_tokenizer(tokenizer_path), completion))
                                 if tokenizer_path
                                 else max(estimate_num_tokens(len(completion)),
                                          sum(acc.num_generated_deltas_by_choice)))
        return Usage(self.count_prompt_tokens(request, endpoint), num_completion_tokens)

    def count_prompt_tokens(self, request: CanonicalRequest, endpoint: Endpoint) -> int:
        """With the model's configured tokenizer (a tokenizer.json): the prompt text's tokens plus
        ~4 of chat framing a message; without one, the ~4-characters-a-token estimate."""
        tokenizer_path = endpoint.model.tokenizer
        if not tokenizer_path or request.prompt_token_ids is not None or any(
                isinstance(p, list) for p in request.extra_prompts):
            return estimate_prompt_tokens(request)  # (exact for prompts of token ids)
        tokenizer = _load_tokenizer(tokenizer_path)
        prompts = [request.prompt + "".join(m.content for m in request.messages),
                   *request.extra_prompts]
        return (sum(len(encode_ids(tokenizer, str(p))) for p in prompts)
                + 4 * len(request.messages))

    async def health(self, endpoint: Endpoint) -> bool:
        for path in ("/health", "/v1/models"):
            status = await self._get_status(endpoint, path)
            if status != 404:
                return status == 200
        return False

    async def context_length(self, endpoint: Endpoint) -> int | None:
        body = await self._get_json(endpoint, "/v1/models")
        for entry in (body or {}).get("data") or []:
            if isinstance(entry, dict) and entry.get("id") in (endpoint.model.upstream_name, None):
                value = entry.get("max_model_len") or entry.get("context_length")
                return int(value) if isinstance(value, int) and value > 0 else None
        return None

    async def _get_status(self, endpoint: Endpoint, path: str) -> int | None:
        try:
            response = await self.transport.send(UpstreamRequest(
                "GET", endpoint.url + path, headers=dict(endpoint.auth_headers),
                connect_timeout_s=self.settings.health_timeout_s))
        except Exception:  # noqa: BLE001 - health must not raise
            return None
        try:
            await response.read(PROBE_BODY_MAX_BYTES)
            return response.status
        except Exception:  # noqa: BLE001
            return None
        finally:
            response.close()

    async def _get_json(self, endpoint: Endpoint, path: str) -> Any:
        try:
            response = await self.transport.send(UpstreamRequest(
                "GET", endpoint.url + path, headers=dict(endpoint.auth_headers),
                connect_timeout_s=self.settings.health_timeout_s))
            try:
                return (orjson.loads(await response.read(PROBE_BODY_MAX_BYTES))
                        if response.status == 200 else None)
            finally:
                response.close()
        except Exception:  # noqa: BLE001 - must not raise
            return None


def _message_json(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    if message.reasoning:
        out["reasoning_content"] = message.reasoning
    return out


async def _raise_for_status(response: UpstreamResponse) -> None:
    """A 429 is `UpstreamThrottled` (retryable; its rate-limit headers kept). A 4xx (not
    401/403/408) is the request's fault: its OpenAI error passes through
    unchanged (status, type, code, param, message); anything else is `UpstreamUnavailable`
    (retryable). A 401/403 refuses the gateway's own credential (a replica secret or an upstream
    `api_key` out of step), never the caller's: passed on, it would tell a caller with a good
    key that theirs is bad."""
    if response.status < 400:
        return
    body = await read_error_body(response)
    if response.status in (401, 403):
        log.warning("upstream refused the gateway's credential (%d): %s", response.status,
                    body[:200].decode("utf-8", "replace"))
        raise UpstreamUnavailable(f"upstream failed: it refused the gateway's credential "
                                  f"({response.status})")
    if response.status == 429:
        log.warning("upstream throttled (429): %s", body[:200].decode("utf-8", "replace"))
        raise throttled(response.headers, body)
    if 400 <= response.status < 500 and response.status != 408:
        raise _rejected(response.status, body)
    log.warning("upstream answered %d: %s", response.status, body[:500].decode("utf-8", "replace"))
    raise UpstreamUnavailable(f"upstream failed: it answered {response.status}")


def _salt_digest(salt: str) -> str:
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16,
                           person=b"aigw-cache-salt").hexdigest()


THROTTLE_HEADERS = ("retry-after", "retry-after-ms")  # and every x-ratelimit-* header


def throttled(headers: Mapping[str, str], body: bytes = b"") -> UpstreamThrottled:
    """An upstream's 429 as UpstreamThrottled with its Retry-After / x-ratelimit-* headers (at
    most 32, each value at most 256 characters). Its message is not passed on: a hosted API's
    names the gateway's own account (OpenAI's: "... in organization org-..."). A replica's
    admission refusal (error code `latency_target`) is UpstreamOverloaded."""
    kept: dict[str, str] = {}
    for name, value in headers.items():
        lower = name.lower()
        if (lower in THROTTLE_HEADERS or lower.startswith("x-ratelimit-")) and len(kept) < 32:
            kept[lower] = value[:256]
    if _error_code(body) == LATENCY_TARGET_CODE:
        predicted = next((value for name, value in headers.items()
                          if name.lower() == PREDICTED_QUEUE_HEADER), "")
        return UpstreamOverloaded(
            "the model's replicas cannot start this request within its latency target; retry "
            f"after {kept.get('retry-after', '1')} s", kept,
            int(predicted) if predicted.isdigit() and len(predicted) <= 12 else None)
    return UpstreamThrottled("the model's upstream is rate limiting requests; retry later", kept)


LATENCY_TARGET_CODE = "latency_target"  # a replica's admission refusal (engine/server)
PREDICTED_QUEUE_HEADER = "x-aigw-predicted-queue-ms"


def _error_code(body: bytes) -> str | None:
    """The `error.code` of an OpenAI error body, if it has one (bounded: a refusal is small)."""
    if not body or len(body) > 16_384:
        return None
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _rejected(status: int, body: bytes) -> UpstreamRejected:
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        text = body[:500].decode("utf-8", "replace")
        return UpstreamRejected(f"upstream answered {status}: {text}", status=status)

    def text_or_none(key: str) -> str | None:
        value = error.get(key)
        return value if isinstance(value, str) and value else None

    return UpstreamRejected(error["message"], status=status,
                            code=text_or_none("code") or "upstream_rejected",
                            param=text_or_none("param"), error_type=text_or_none("type"))


def _announced_prompt(headers: Mapping[str, str]) -> PromptUsage | None:
    """The prompt usage our replicas announce in a stream's headers (contracts/usage_headers.py);
    None from any other upstream (or a malformed value)."""
    prompt_tokens = headers.get(PROMPT_TOKENS_HEADER)
    if prompt_tokens is None:
        return None
    try:
        return PromptUsage(int(prompt_tokens), int(headers.get(CACHED_TOKENS_HEADER, "0")))
    except ValueError:
        return None


def _chunk_events(chunk: dict[str, Any], kind: str) -> list[CanonicalEvent]:
    """The events of one chunk (or whole answer); UpstreamUnavailable when it is malformed (a
    choice, delta, call or usage of the wrong shape), never another exception."""
    try:
        return _read_chunk(chunk, kind)
    except (AttributeError, TypeError, ValueError) as exc:
        log.warning("upstream sent a malformed answer: %r (%s)", chunk, exc)
        raise UpstreamUnavailable("upstream sent a malformed answer") from None


def _read_chunk(chunk: dict[str, Any], kind: str) -> list[CanonicalEvent]:
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else str(error)
        raise UpstreamUnavailable(f"upstream error mid-stream: {message}")
    events: list[CanonicalEvent] = []
    for choice in chunk.get("choices") or ():
        index = choice.get("index") or 0
        if not isinstance(index, int) or index < 0:
            raise UpstreamUnavailable("upstream sent a choice with a bad index")
        logprobs = choice.get("logprobs") or None
        if kind == "chat":
            delta = choice.get("delta") or choice.get("message") or {}
            # vLLM and DeepSeek name it reasoning_content; newer vLLM and OpenRouter `reasoning`
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                events.append(ReasoningDelta(reasoning, index))
            content = _content_text(delta.get("content"))
            if content or logprobs:
                events.append(TextDelta(content, index, logprobs))
            for position, call in enumerate(delta.get("tool_calls") or ()):
                function = call.get("function") or {}
                call_index = call.get("index", position)
                if not isinstance(call_index, int) or call_index < 0:
                    raise UpstreamUnavailable("upstream sent a tool call with a bad index")
                events.append(ToolCallDelta(call_index, _str_or_none(call.get("id")),
                                            _str_or_none(function.get("name")),
                                            _arguments_text(function.get("arguments")), index))
        elif choice.get("text") or logprobs:
            events.append(TextDelta(choice.get("text") or "", index, logprobs))
        if choice.get("finish_reason"):
            reason = _FINISH_REASONS.get(choice["finish_reason"], "stop")
            matched = choice.get("stop_reason")  # vLLM: the stop string (or token id) that matched
            events.append(Finish(reason, matched if reason == "stop" and isinstance(matched, str)
                                 and matched else None, index))
    usage = chunk.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        completion_details = usage.get("completion_tokens_details") or {}
        events.append(Usage(int(usage.get("prompt_tokens") or 0),
                            int(usage.get("completion_tokens") or 0),
                            int(details.get("cached_tokens") or 0),
                            int(completion_details.get("reasoning_tokens") or 0)))
    return events


def _content_text(value: Any) -> str:
    """A message's content as text: a string, or (some upstreams) an array of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(part["text"] for part in value
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def _arguments_text(value: Any) -> str:
    """A call's arguments as JSON text: OpenAI's string, or (some upstreams) the object itself."""
    if value is None or isinstance(value, str):
        return value or ""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:  # e.g. nested deeper than orjson writes
        raise UpstreamUnavailable("upstream sent tool call arguments that are not JSON") from None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


async def _parse_stream(response: UpstreamResponse, kind: str) -> AsyncIterator[CanonicalEvent]:
    """SSE `data:` lines -> events; what arrived together is merged (fewer, larger deltas)."""
    calls: set[tuple[int, int]] = set()  # (choice, index) of the tool calls begun
    async for batch in response.line_batches():
        events: list[CanonicalEvent] = []
        for line in batch:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                for event in _merged(events):
                    yield event
                return
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError as exc:
                raise UpstreamUnavailable("upstream sent a malformed stream chunk") from exc
            events += _tool_call_pieces(_chunk_events(chunk, kind), calls)
        for event in _merged(events):
            yield event
    raise UpstreamUnavailable("upstream stream ended before [DONE]")


def _tool_call_pieces(events: list[CanonicalEvent], calls: set[tuple[int, int]]
                      ) -> list[CanonicalEvent]:
    """Tool-call pieces in OpenAI's form, which ToolCallDelta promises: an `id` on a call's first
    piece (one is made up when the upstream sent none: a client answers the call by it) and `id`
    and `name` on that piece only (some upstreams repeat them on every piece, which OpenAI
    clients would concatenate, "call_acall_a", and the Anthropic and Responses encoders would
    take for new calls). `calls` holds the (choice, index) of the calls begun so far."""
    out: list[CanonicalEvent] = []
    for event in events:
        if isinstance(event, ToolCallDelta):
            key = (event.choice, event.index)
            if key in calls:
                if not event.arguments:
                    continue
                event = ToolCallDelta(event.index, None, None, event.arguments, event.choice)
            elif not event.id:
                event = ToolCallDelta(event.index, f"call_{secrets.token_hex(12)}", event.name,
                                      event.arguments, event.choice)
            calls.add(key)
        out.append(event)
    return out


def _merged(events: list[CanonicalEvent]) -> list[CanonicalEvent]:
    """Adjacent text deltas (without logprobs), reasoning deltas, and adjacent argument pieces of
    one tool call, of one choice become one event."""
    out: list[CanonicalEvent] = []
    for event in events:
        last = out[-1] if out else None
        if (isinstance(event, TextDelta) and isinstance(last, TextDelta)
                and event.choice == last.choice and event.logprobs is None
                and last.logprobs is None):
            out[-1] = TextDelta(last.text + event.text, event.choice)
        elif (isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta)
              and event.choice == last.choice):
            out[-1] = ReasoningDelta(last.text + event.text, event.choice)
        elif (isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta)
              and event.index == last.index and event.choice == last.choice
              and not event.id and not event.name):
            out[-1] = ToolCallDelta(last.index, last.id, last.name,
                                    last.arguments + event.arguments, event.choice)
        else:
            out.append(event)
    return out


async def _read_json(response: UpstreamResponse, max_bytes: int) -> Any:
    """The whole answer as JSON; one over `max_bytes` raises `UpstreamAnswerTooLarge`."""
    try:
        return orjson.loads(await response.read(max_bytes))
    except orjson.JSONDecodeError as exc:
        raise UpstreamUnavailable("upstream sent malformed JSON") from exc


def _whole_events(body: Any, kind: str) -> list[CanonicalEvent]:
    if not isinstance(body, dict):
        raise UpstreamUnavailable("upstream sent malformed JSON")
    return _tool_call_pieces(_chunk_events(body, kind), set())


@lru_cache(maxsize=8)
def _load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)
