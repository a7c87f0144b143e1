"""OpenAI request bodies at the replica's edge (pydantic v2), mapped onto `SamplingParams`.

Types are checked strictly (a string is not a number); value ranges are checked once, by
`SamplingParams`, whose `SamplingParamsError` the server answers with 400. Unknown fields are
ignored, as OpenAI-compatible servers do (logit_bias included); `parallel_tool_calls: false`
keeps at most one tool call; response_format `json_object` / `json_schema` constrain decoding
(engine/structured_output.py). `cache_salt` is our (and vLLM's) extension: requests with
different salts never share prefix-cache blocks; at most MAX_CACHE_SALT_BYTES UTF-8 bytes (the
salt is part of every prefix-cache and grammar-cache key); `bounded_cache_salt` is what a sender
makes of a longer one.

KV retention (engine/kv_cache/retention.py): `cache_retention_s` (our extension: seconds, the
gateway sends it) or OpenAI's `prompt_cache_retention` ("in_memory": 5 minutes, "24h") asks the
replica to keep the prompt's cached blocks from eviction that long after the request ends (clamped
to the replica's `--kv-retention-max-s`); `cache_retention_id` (ours) or `prompt_cache_key` names
the session, whose next retention replaces this one.

Priority classes (engine/scheduler.py): `priority` (vLLM's field: an int, lower is scheduled first;
the gateway sends it) or OpenAI's `service_tier` (SERVICE_TIER_PRIORITY: "priority" -1, "default" 0,
"flex" 1; "fast" is "priority", "auto" and "scale" are "default") picks the request's class.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from contracts.output_grammar import OutputGrammar
from contracts.sampling_params import SamplingParams

# OpenAI's prompt_cache_retention values, in seconds ("in_memory": its caches live 5-10 minutes)
PROMPT_CACHE_RETENTION_S = {"in_memory": 300.0, "24h": 86_400.0}

# OpenAI's service_tier classes -> the engine's scheduling priority (lower first)
SERVICE_TIER_PRIORITY = {"priority": -1, "default": 0, "flex": 1}
SERVICE_TIER_ALIASES = {"fast": "priority", "auto": "default", "scale": "default"}
MAX_ABS_PRIORITY = 1000
# a cache_salt's UTF-8 bytes: the gateway's salts are `project:<name>` (72 bytes at most) or
# `key:<project>:<key id>`; a longer one (a JWT's long `sub`) is sent as its digest
MAX_CACHE_SALT_BYTES = 256


def bounded_cache_salt(salt: str) -> str:
    """`salt` when it is within MAX_CACHE_SALT_BYTES, else `digest:` and 32 hex digits of it
    (distinct salts stay distinct; the digest is far shorter than the bound)."""
    raw = salt.encode("utf-8", "surrogatepass")
    if len(raw) <= MAX_CACHE_SALT_BYTES:
        return salt
    return "digest:" + hashlib.blake2b(raw, digest_size=16, person=b"aigw-long-salt").hexdigest()


def _check_salt_bytes(salt: str | None) -> str | None:
    if salt is not None and len(salt.encode("utf-8", "surrogatepass")) > MAX_CACHE_SALT_BYTES:
        raise ValueError(f"at most {MAX_CACHE_SALT_BYTES} UTF-8 bytes")
    return salt


CacheSalt = Annotated[str | None, Field(default=None, min_length=1),
                      AfterValidator(_check_salt_bytes)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class FunctionCallIn(_Body):
    name: str
    arguments: str


class ToolCallIn(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class SystemMessage(_Body):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Body):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallIn] | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an earlier turn's reasoning (templates may render it)


class ToolMessage(_Body):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the output always follows the schema: accepted, nothing to switch


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is json_schema")
        return self

    def grammar(self) -> OutputGrammar | None:
        """Raises OutputGrammarError (a SamplingParamsError) for a schema that cannot be
        compiled."""
        if self.type == "text":
            return None
        if self.type == "json_schema" and self.json_schema is not None \
                and self.json_schema.schema_ is not None:
            return OutputGrammar.json_schema(self.json_schema.schema_)
        return OutputGrammar.json_object()


# the chat template's own variables, which chat_template_kwargs cannot replace
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token", "unk_token", "pad_token", "special_tokens"})

MAX_CHOICES = 128  # engine requests one HTTP request may fan out into (prompts x n)


class _SamplingBody(_Body):
    """Fields shared by chat completions and completions."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    cache_salt: CacheSalt = None
    response_format: ResponseFormat | None = None
    cache_retention_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    cache_retention_id: str | None = Field(default=None, min_length=1, max_length=128)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_key: str | None = None
    priority: int | None = Field(default=None, ge=-MAX_ABS_PRIORITY, le=MAX_ABS_PRIORITY)
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None

    def priority_class(self) -> int:
        """The engine's scheduling class, lower first: `priority`, else `service_tier`'s, else 0."""
        if self.priority is not None:
            return self.priority
        tier = SERVICE_TIER_ALIASES.get(self.service_tier or "auto", self.service_tier or "")
        return SERVICE_TIER_PRIORITY[tier]

    def retention(self) -> tuple[float, str | None]:
        """(seconds to keep the prompt's blocks after the request, the session's retention id):
        `cache_retention_s`, else OpenAI's `prompt_cache_retention`, else 0 (none); the id is
        `cache_retention_id`, else a digest of `prompt_cache_key` (bounded whatever its length)."""
        retain_s = self.cache_retention_s
        if retain_s is None:
            retain_s = PROMPT_CACHE_RETENTION_S.get(self.prompt_cache_retention or "", 0.0)
        retention_id = self.cache_retention_id
        if retention_id is None and self.prompt_cache_key:
            digest = hashlib.blake2b(self.prompt_cache_key.encode("utf-8", "surrogatepass"),
                                     digest_size=16)
            retention_id = "key:" + digest.hexdigest()
        return retain_s, retention_id

    @model_validator(mode="after")
    def _check_streaming(self) -> _SamplingBody:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: bool, top_logprobs: int,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises SamplingParamsError for out-of-range values."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
            n=self.n,
            grammar=self.response_format.grammar() if self.response_format is not None else None,
        )


class ChatCompletionRequest(_SamplingBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False  # vLLM's extension: the answer continues the last message
    # reasoning models: gpt-oss's "Reasoning: <effort>" (none/minimal: low); "none" also turns a
    # think-style model's thinking off unless chat_template_kwargs says otherwise
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's extension: extra variables for the checkpoint's jinja template (Qwen3's
    # enable_thinking); the template's own variables (messages, tools, ...) cannot be replaced
    chat_template_kwargs: dict[str, Any] | None = None
    # ours: the prompt as the gateway rendered it (chat/render.py), used by a replica whose own
    # render id is `prompt_render_id` instead of rendering `messages` again; others ignore it
    prompt_token_ids: list[int] | None = Field(default=None, min_length=1)
    prompt_render_id: str | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message requires the last message to be the "
                             "assistant's")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice requires tools")
        reserved = RESERVED_TEMPLATE_VARIABLES & set(self.chat_template_kwargs or ())
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {sorted(reserved)}")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or ()}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names an unknown function "
                                 f"{self.tool_choice.function.name!r}")
        return self

    @property
    def uses_tools(self) -> bool:
        """True when tools go into the prompt and the output is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_kwargs(self) -> dict[str, Any]:
        """The template variables: chat_template_kwargs, plus `enable_thinking: false` for
        reasoning_effort "none" when the body does not set it."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
        return kwargs

    @property
    def forced_functions(self) -> list[ToolDef]:
        """The tools one of which the answer must call: all for "required", the named one for a
        named choice, none otherwise."""
        if self.tool_choice == "required":
            return list(self.tools or ())
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            return [tool for tool in self.tools or () if tool.function.name == name]
        return []

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_tokens
        if self.max_completion_tokens is not None:
            max_tokens = self.max_completion_tokens
        return self._sampling_params(max_tokens, self.logprobs, self.top_logprobs or 0)


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and (
            not self.prompt or any(isinstance(p, list) and not p for p in self.prompt)
        ):
            raise ValueError("prompt must not be empty")
        num_prompts = len(self.prompt) if isinstance(self.prompt, list) and not isinstance(
            self.prompt[0], int) else 1
        if num_prompts * self.n > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices (prompts x n) per request")
        return self

    def to_sampling_params(self) -> SamplingParams:
        logprobs = self.logprobs is not None
        # the echoed prompt comes with its tokens' logprobs; `max_tokens: 0` only scores the
        # prompt (it is computed even when the logprobs are not returned)
        prompt_logprobs = None
        if self.echo and (logprobs or self.max_tokens == 0):
            prompt_logprobs = self.logprobs or 0
        return self._sampling_params(self.max_tokens, logprobs, self.logprobs or 0, prompt_logprobs)


def per_choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """The params of one fanned-out engine request: n=1, and seed+choice when seeded (wrapped
    within the signed 64-bit range the seed is checked against: torch seeds no larger int)."""
    if params.seed is None:
        return replace(params, n=1)
    seed = (params.seed + choice + (1 << 63)) % (1 << 64) - (1 << 63)
    return replace(params, n=1, seed=seed)
