"""The one internal form every dialect translates to and from.

    client JSON --dialect.parse--> CanonicalRequest --backend.stream--> CanonicalEvent*
                --dialect--> client

A backend yields, in order: at most one `PromptUsage` (when the upstream announces the prompt's
count as it starts answering), any number of `TextDelta` / `ReasoningDelta` / `ToolCallDelta`
(reasoning: a reasoning model's thinking, apart from its answer), then one `Finish` per
choice, then one `Usage` (the backend guarantees a `Usage`, counting tokens itself if the upstream
gave none; it covers every choice). Events carry their `choice` (0 unless the client asked for
`n` > 1, which only the OpenAI chat and completions dialects do). `Accumulator` folds the events
into a `CanonicalResponse` (choice 0, the others in its `others`) for non-streaming answers and
for metering.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.request.observer import NULL_OBSERVER, RequestObserver

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "error"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # role == "tool": the call this result answers
    name: str | None = None
    reasoning: str = ""  # role == "assistant": an earlier turn's reasoning, sent back
    # Anthropic's cache_control on the message's blocks, as JSON text (a native Anthropic
    # upstream gets it back on the message's block; other upstreams cache prefixes themselves)
    cache_control: str | None = None


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)  # JSON schema


@dataclass(slots=True)
class CanonicalRequest:
    """One client request, dialect-free. `kind` picks the upstream route (chat, completion or
    embedding: an embedding request's inputs are `prompt` / `prompt_token_ids` and
    `extra_prompts`, as a completion's several prompts; it has no choices to generate)."""

    request_id: str
    model: str
    kind: Literal["chat", "completion", "embedding"] = "chat"
    messages: list[Message] = field(default_factory=list)
    prompt: str = ""  # kind == "completion"
    prompt_token_ids: list[int] | None = None  # kind == "completion", a prompt given as token ids
    # kind == "completion": the prompts after the first (OpenAI's several prompts in one request),
    # each a string or token ids; each prompt gets `n` choices, prompt i's at i*n .. i*n + n - 1
    extra_prompts: list[str | list[int]] = field(default_factory=list)
    # kind == "completion": each choice's text (and logprobs) starts with its prompt
    echo: bool = False
    # kind == "embedding": OpenAI's `dimensions` (None: the model's) and `encoding_format`
    embedding_dimensions: int | None = None
    encoding_format: Literal["float", "base64"] = "float"
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None  # OpenAI form: "auto"|"none"|"required"|{...}
    # False: at most one call (None: the upstream's default)
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None  # per choice
    n: int = 1  # choices to generate (OpenAI `n`), each up to max_tokens
    logprobs: bool = False  # return each sampled token's log probability (OpenAI dialects only)
    top_logprobs: int = 0  # ... and this many most likely alternatives per position
    # structured output in OpenAI chat's form ({"type": "json_object"} or {"type": "json_schema",
    # "json_schema": {"name", "schema"?, "strict"?, "description"?}}); None: free text
    response_format: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # None: no top-k (forwarded to upstreams that take it: vLLM-style)
    presence_penalty: float | None = None  # OpenAI's, -2..2 (None: not sent)
    frequency_penalty: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    # reasoning models: OpenAI's reasoning_effort ("none", "minimal", "low", "medium", "high");
    # and the upstream chat template's extra variables (vLLM's chat_template_kwargs: Qwen3's
    # enable_thinking; Anthropic's `thinking` maps onto it)
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stream: bool = False
    include_usage: bool = False  # OpenAI stream_options.include_usage as the client asked
    # the answer continues the last (assistant) message's text: Anthropic prefill
    continue_final_message: bool = False
    user: str | None = None  # the caller's end user (OpenAI `user`, Anthropic metadata.user_id)
    session_id: str | None = None  # `x-session-id` header: optional routing affinity
    # OpenAI's prompt_cache_key: the routing affinity key, ahead of session_id and user
    prompt_cache_key: str | None = None
    # the scheduling class ("priority", "default", "flex"): as asked (OpenAI service_tier; None:
    # "auto"), then, after authentication, the one used (the project's default when unasked).
    # Our replicas schedule by it (contracts/replica_protocol.py); the answer echoes it
    service_tier: str | None = None
    # what the usage record is labelled with (gateway/request/usage_tags.py)
    tags: tuple[str, ...] = ()
    usage_session: str | None = None
    # how long the client asked the prompt's prefix to stay cached after the request, in seconds
    # (Anthropic cache_control ttl "5m" / "1h", OpenAI prompt_cache_retention); None: not asked.
    # Our replicas get it as KV retention, clamped (gateway/request/retention.py)
    cache_retention_s: float | None = None
    # set after authentication (gateway/request/retention.py): the KV retention our replicas are
    # asked for, (seconds, session retention id); (0.0, None): none
    kv_retention: tuple[float, str | None] = (0.0, None)
    project: str | None = None  # set after authentication (metering, routing)
    # set at admission: the (prompt, completion) tokens reserved, before any expected cache hit;
    # what an answer too large to read is billed (gateway/request/pipeline.py)
    admitted_tokens: tuple[int, int] = (0, 0)
    # set after authentication: the key's models (None: every one); a fallback skips the others
    allowed_models: frozenset[str] | None = None
    cache_salt: str | None = None  # set after authentication: auth.cache_salt.cache_salt_for
    # set after authentication: sampled for the request log (gateway/request_logs/), its body kept
    is_logged: bool = False
    # (tokenizer path, prompt token ids) when the gateway rendered the prompt at admission (a
    # token limit applies: gateway/request/pipeline.py); the prefix router hashes these, not a new
    # render
    rendered_prompt: tuple[str, list[int]] | None = None
    # what telemetry is told of this request (gateway/request/observer.py): set by the pipeline
    # from the middleware's; routing, fallbacks and the backend's upstream call tell it too
    observer: RequestObserver = NULL_OBSERVER

    @property
    def num_prompts(self) -> int:
        return 1 + len(self.extra_prompts)

    @property
    def num_choices(self) -> int:
        """Choices the answer carries: `n` for each prompt."""
        return self.n * self.num_prompts

    def text_length(self) -> int:
        """Characters of prompt text (a cheap input to token estimates)."""
        num_chars = len(self.prompt)
        if self.extra_prompts:  # (no generator for the usual one prompt)
            num_chars += sum(len(p) for p in self.extra_prompts if isinstance(p, str))
        for message in self.messages:
            num_chars += len(message.content)
            for call in message.tool_calls:
                num_chars += len(call.arguments) + len(call.name)
        for tool in self.tools:
            num_chars += len(tool.name) + len(tool.description) + len(str(tool.parameters))
        return num_chars


def estimate_num_tokens(num_chars: int) -> int:
    """The documented fallback when no tokenizer is known: ~4 characters per token, at least 1."""
    return max(1, (num_chars + 3) // 4)


def estimate_prompt_tokens(request: CanonicalRequest) -> int:
    """An admission-time estimate: text tokens plus ~4 tokens of chat framing per message (a
    prompt of token ids counts exactly)."""
    num_id_tokens = (sum(len(p) for p in request.extra_prompts if isinstance(p, list))
                     if request.extra_prompts else 0)
    if request.prompt_token_ids is not None:
        num_id_tokens += len(request.prompt_token_ids)
    num_chars = request.text_length()
    if num_id_tokens and not num_chars:
        return num_id_tokens
    return num_id_tokens + estimate_num_tokens(num_chars) + 4 * len(request.messages)


@dataclass(frozen=True, slots=True)
class TextDelta:
    """`logprobs`: the upstream's own OpenAI logprobs object for this delta's tokens, passed
    through as is (chat form `{"content": [...]}` or the legacy completions form, as `kind` is);
    the text may then be empty (a token that completes no character yet)."""

    text: str
    choice: int = 0
    logprobs: Any = None


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """A piece of the model's reasoning (vLLM's and DeepSeek's `reasoning_content`)."""

    text: str
    choice: int = 0


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of tool call `index`; `id` and `name` arrive on its first piece only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    choice: int = 0


@dataclass(frozen=True, slots=True)
class Finish:
    reason: FinishReason
    stop_sequence: str | None = None  # reason == "stop": the client's stop string that matched
    choice: int = 0


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # part of prompt_tokens served from the prefix cache
    reasoning_tokens: int = 0  # part of completion_tokens spent reasoning

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class PromptUsage:
    """The prompt's exact count, known when the upstream starts answering (our replicas announce
    it in the stream's headers): Anthropic's `message_start` reports it, and a stream cut before
    its `Usage` is billed with it. At most one, first."""

    prompt_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EmbeddingVectors:
    """An embedding request's answer: one vector per input, in input order, each as float32
    little-endian bytes (contracts/embeddings.py writes them in the client's encoding_format)."""

    vectors: tuple[bytes, ...]


CanonicalEvent = (TextDelta | ReasoningDelta | ToolCallDelta | Finish | Usage | PromptUsage
                  | EmbeddingVectors)
# folded into the answer's end, never sent alone
FOLDED_EVENTS = (Finish, Usage, PromptUsage, EmbeddingVectors)


@dataclass(slots=True)
class CanonicalResponse:
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stop_sequence: str | None = None  # the stop string that ended the text, when known
    others: tuple[CanonicalResponse, ...] = ()  # choices 1..n-1 (n > 1), in order; no usage
    logprobs: list[Any] | None = None  # each TextDelta's logprobs object, in order, if any came
    reasoning: str = ""  # the ReasoningDeltas' text
    embeddings: tuple[bytes, ...] | None = None  # kind == "embedding": EmbeddingVectors.vectors


class Accumulator:
    """Folds events into a `CanonicalResponse`; `num_events` counts what has been seen. Choice 0
    is folded here; any other choice into an Accumulator of its own (`others`)."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._logprobs: list[Any] | None = None
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, arguments...]
        self.finish_reason: FinishReason | None = None
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None
        self.prompt_usage: PromptUsage | None = None
        self.embeddings: tuple[bytes, ...] | None = None
        self.num_events = 0
        self.num_generated_deltas = 0  # this choice's non-empty text, reasoning, tool-call deltas
        self.others: dict[int, Accumulator] = {}  # choice -> its events (n > 1)

    def add(self, event: CanonicalEvent) -> None:
        self.num_events += 1
        if not isinstance(event, Usage | PromptUsage | EmbeddingVectors) and event.choice:
            other = self.others.get(event.choice)
            if other is None:
                other = self.others[event.choice] = Accumulator()
            other._fold(event)
        else:
            self._fold(event)

    def _fold(self, event: CanonicalEvent) -> None:
        if isinstance(event, TextDelta):
            self.num_generated_deltas += bool(event.text)
            self._text.append(event.text)
            if event.logprobs is not None:
                if self._logprobs is None:
                    self._logprobs = []
                self._logprobs.append(event.logprobs)
        elif isinstance(event, ReasoningDelta):
            self.num_generated_deltas += bool(event.text)
            self._reasoning.append(event.text)
        elif isinstance(event, ToolCallDelta):
            self.num_generated_deltas += bool(event.name or event.arguments)
            parts = self._calls.setdefault(event.index, ["", ""])
            if event.id:
                parts[0] = event.id
            if event.name:
                parts[1] = event.name
            parts.append(event.arguments)
        elif isinstance(event, Finish):
            self.finish_reason = event.reason
            self.stop_sequence = event.stop_sequence
        elif isinstance(event, PromptUsage):
            self.prompt_usage = event
        elif isinstance(event, EmbeddingVectors):
            self.embeddings = event.vectors
        else:
            self.usage = event

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def num_generated_chars(self) -> int:
        """Characters generated so far over every choice: text, tool names and arguments (what a
        stream cut before its usage estimates its completion from)."""
        return sum(self.num_generated_chars_by_choice)

    @property
    def num_generated_chars_by_choice(self) -> list[int]:
        """`num_generated_chars` of each choice seen, in `choices` order."""
        own = sum(map(len, self._text)) + sum(map(len, self._reasoning))
        if self._calls:
            own += sum(len(part) for parts in self._calls.values() for part in parts[1:])
        if not self.others:
            return [own]
        return [own, *(self.others[choice].num_generated_chars for choice in sorted(self.others))]

    @property
    def num_generated_deltas_by_choice(self) -> list[int]:
        """`num_generated_deltas` of each choice seen, in `choices` order: each such delta holds
        at least one generated token, so a cut stream's completion is at least this many."""
        return [self.num_generated_deltas, *(self.others[choice].num_generated_deltas
                                             for choice in sorted(self.others))]

    @property
    def num_first_text_chars_by_choice(self) -> list[int]:
        """The length of each choice's first text delta (0 if none came), in `choices` order:
        with `echo`, that delta is the choice's prompt and its first token."""
        own = len(self._text[0]) if self._text else 0
        return [own, *(self.others[choice].num_first_text_chars_by_choice[0]
                       for choice in sorted(self.others))]

    @property
    def choices(self) -> list[int]:
        """The choices seen: 0, then the others in order."""
        return [0, *sorted(self.others)]

    def response(self) -> CanonicalResponse:
        calls = [ToolCall(id=p[0] or f"call_{i}", name=p[1], arguments="".join(p[2:]) or "{}")
                 for i, p in sorted(self._calls.items())] if self._calls else []
        others = (tuple(self.others[c].response() for c in sorted(self.others)) if self.others
                  else ())
        return CanonicalResponse(text=self.text, tool_calls=calls, finish_reason=self.finish_reason,
                                 usage=self.usage, stop_sequence=self.stop_sequence, others=others,
                                 logprobs=self._logprobs, reasoning="".join(self._reasoning),
                                 embeddings=self.embeddings)
