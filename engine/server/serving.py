"""ServingContext: what the OpenAI handlers share (engine, settings, metrics), and their steps.

A handler reads as: parse body -> check model -> sampling params -> prompt ids -> context check
-> `fanout()` -> respond (JSON or SSE).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import orjson
import pydantic
from aiohttp import web

from chat.output import OutputParser
from chat.registry import ChatFormat, chat_format_for
from chat.render import ChatPrompt, PromptRenderer
from contracts.output_grammar import OutputGrammar, check_finite
from contracts.replica_errors import (
    ContextLengthExceeded,
    InvalidRequestError,
    LatencyTargetError,
    NotFoundError,
)
from contracts.replica_protocol import ChatCompletionRequest, CompletionRequest, per_choice_params
from contracts.sampling_params import SamplingParams, SamplingParamsError
from engine.outputs import PromptTooLongError
from engine.server.fanout import FanOut, SubRequest
from engine.server.metrics import ReplicaMetrics
from engine.server.settings import ReplicaServerSettings
from engine.server.typedefs import ServedEngine

Body = TypeVar("Body", bound=pydantic.BaseModel)
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")


@dataclass
class ServingContext:
    engine: ServedEngine
    settings: ReplicaServerSettings
    metrics: ReplicaMetrics
    started_at_s: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.engine.model_config.model_id, *self.settings.served_model_aliases)

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", param="model",
                                code="model_not_found")

    def sampling_params(self, req: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
        """The body's SamplingParams; invalid values are 400s (a stop token id outside the
        vocabulary too: the sampler indexes the logits with it). When a chat's `tool_choice`
        demands a call ("required" or a named function), decoding is constrained to the model's
        tool-call format (this grammar wins over a `response_format`: the answer is calls, not
        text): one call to the named function, or one or more (one with `parallel_tool_calls:
        false`) for "required". Called in a worker thread: it also builds any grammar's matcher
        for the engine (`prepare_grammar`), so the engine thread only copies it."""
        try:
            params = req.to_sampling_params()
            vocab_size = self.engine.model_config.vocab_size
            if params.stop_token_ids and max(params.stop_token_ids) >= vocab_size:
                raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})",
                                          param="stop_token_ids")
            if isinstance(req, ChatCompletionRequest) and req.forced_functions:
                params = replace(params, grammar=self._forced_calls_grammar(req))
            if params.grammar is not None:
                self.engine.prepare_grammar(params.grammar, req.cache_salt)
            return params
        except orjson.JSONEncodeError:  # orjson writes 254 levels (and reads 1024)
            raise InvalidRequestError("tools: a function's parameters schema is nested too deeply",
                                      param="tools") from None
        except SamplingParamsError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from exc

    def _forced_calls_grammar(self, req: ChatCompletionRequest) -> OutputGrammar:
        is_parallel = req.parallel_tool_calls is not False and req.tool_choice == "required"
        for tool in req.forced_functions:
            check_finite(tool.function.parameters, "tools")
        grammar = self.chat_format.calls_grammar(
            [(tool.function.name, tool.function.parameters) for tool in req.forced_functions],
            is_parallel, self.settings.tool_parser)
        return OutputGrammar.lark(grammar, "tools")

    @functools.cached_property
    def chat_format(self) -> ChatFormat:
        """The checkpoint's chat format (chat/registry.py: architecture + template sniffing)."""
        tokenizer = self.engine.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        return chat_format_for(self.engine.model_config.architecture,
                               getattr(template, "source", None),
                               getattr(tokenizer, "token_to_id", None))

    @functools.cached_property
    def renderer(self) -> PromptRenderer:
        """The checkpoint's prompt renderer (chat/render.py), the gateway's too."""
        return PromptRenderer(self.engine.tokenizer, self.chat_format)

    def harmony(self) -> Any:
        """gpt-oss's harmony encoding (chat/harmony.py; loaded once per process)."""
        return self.renderer.harmony()

    def render_prompt(self, req: ChatCompletionRequest, max_tokens: int | None) -> ChatPrompt:
        """The chat prompt in the checkpoint's format (called in a worker thread). A body that
        carries the gateway's `prompt_token_ids` under this replica's render id is not rendered
        again (chat/render.py); with another render id (another tokenizer or template loaded
        there), the messages are."""
        renderer = self.renderer
        ids = req.prompt_token_ids
        if ids is not None and req.prompt_render_id == renderer.render_id:
            vocab_size = self.engine.model_config.vocab_size
            if min(ids) < 0 or max(ids) >= vocab_size:  # (two C calls: ids are many)
                raise InvalidRequestError(f"prompt_token_ids must be in [0, {vocab_size})",
                                          param="prompt_token_ids")
            self.metrics.count_prompt_render("gateway")
            return renderer.given(ids)
        self.metrics.count_prompt_render("replica")
        return renderer.render(req, max_tokens=max_tokens, max_model_len=self.engine.max_model_len)

    def new_output_parser(self, req: ChatCompletionRequest, prompt_text: str) -> OutputParser:
        """One choice's answer parser: reasoning and, when the request uses tools, tool calls."""
        return self.chat_format.output_parser(
            prompt_text=prompt_text, uses_tools=req.uses_tools,
            calls_only=bool(req.forced_functions), tool_parser=self.settings.tool_parser,
            harmony=self.harmony)

    @asynccontextmanager
    async def fanout(self, request: web.Request, request_id: str, prompts: list[list[int]],
                     params: SamplingParams, *, cache_salt: str | None, param: str,
                     retention: tuple[float, str | None] = (0.0, None), priority: int = 0
                     ) -> AsyncIterator[FanOut]:
        """Started engine requests, `params.n` per prompt, ids `{request_id}-{choice}` when
        there are several; closed (aborting any still running) on exit. `retention`: the
        body's KV retention (seconds, id: ChatCompletionRequest.retention); `priority`: its
        scheduling class (ChatCompletionRequest.priority_class)."""
        num_choices = len(prompts) * params.n
        subs = [
            SubRequest(index=i, prompt_token_ids=prompts[i // params.n],
                       request_id=request_id if num_choices == 1 else f"{request_id}-{i}",
                       params=per_choice_params(params, i % params.n))
            for i in range(num_choices)
        ]
        self.check_admission(priority, subs, cache_salt)
        fanout = FanOut(self.engine, subs, metrics=self.metrics, cache_salt=cache_salt,
                        trace_headers=trace_headers(request.headers), retention=retention,
                        priority=priority)
        try:
            try:
                await fanout.start()
            except PromptTooLongError as exc:
                raise ContextLengthExceeded(str(exc), param=param) from exc
            except SamplingParamsError as exc:  # a grammar refused in the engine thread
                raise InvalidRequestError(str(exc), param=exc.param) from exc
            yield fanout
        finally:
            await fanout.aclose()
            release_holds = getattr(self.engine, "release_holds", None)
            if release_holds is not None:  # (admitted requests that never started)
                release_holds(sub.request_id for sub in subs)

    def check_admission(self, priority: int, subs: list[SubRequest],
                        cache_salt: str | None) -> None:
        """LatencyTargetError (429, before any engine request starts) when the engine predicts
        that queueing would break the class's TTFT target (engine/admission.py), counting what the
        prefix cache holds of the prompts; engines without admission control or without a TTFT
        target admit everything. Admitted, the engine holds the prompts as pending until each
        engine request starts (AsyncEngine.admit; released in fanout's exit otherwise)."""
        admit = getattr(self.engine, "admit", None)
        targets = getattr(self.engine, "latency_targets_ms", (None, None))
        if admit is None or targets[0] is None:
            return
        cached = getattr(self.engine, "num_cached_prefix_tokens", None)
        num_cached = (sum(cached(sub.prompt_token_ids, cache_salt) for sub in subs)
                      if cached is not None else 0)
        admission = admit(priority, {sub.request_id: len(sub.prompt_token_ids) for sub in subs},
                          num_cached)
        if admission.is_admitted:
            return
        self.metrics.count_refused(priority)
        raise LatencyTargetError(
            f"The replica is over its latency target: the predicted queueing delay "
            f"({admission.queue_ms:.0f} ms) and prefill would take this request's time to first "
            f"token to {admission.ttft_ms:.0f} ms, beyond its service tier's target of "
            f"{admission.target_ms:.0f} ms. Retry after {admission.retry_after_s} s.",
            retry_after_s=admission.retry_after_s, predicted_queue_ms=round(admission.queue_ms))


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}


async def parse_body(request: web.Request, model: type[Body]) -> Body:
    """The JSON body validated as `model`; InvalidRequestError names the first bad field."""
    raw = await request.read()  # raises HTTPRequestEntityTooLarge over client_max_size
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        return model.model_validate(payload)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        loc = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        raise InvalidRequestError(f"{loc}: {message}" if loc else message,
                                  param=loc or None) from exc
