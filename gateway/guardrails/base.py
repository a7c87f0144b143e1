"""The guardrail contract: a check on the request before it is sent upstream and a scanner over
the answer as it streams.

    class MyGuard(Guardrail):                       # registered under `aigw.guardrails`
        async def check_request(self, request: GuardedRequest) -> None:
            ...                                     # mask: rewrite part.text; block: raise
        def scan_response(self, request: GuardedRequest) -> ResponseScanner | None:
            return MyScanner()                      # one per choice (and per text kind)

A guard blocks by raising `GuardrailBlocked` (400 `guardrail_blocked` before the answer starts;
after a stream started, the dialect's error event ends it). A request guard may rewrite the texts
it is given (the PII guard's masking); the chain writes changed texts back into the request.
A `ResponseScanner` is a transducer over one choice's text: `feed` returns the text to send now
(it may hold a tail back, to see a match that spans two deltas), `finish` the rest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.request.errors import GatewayError

GUARDRAIL_BLOCKED = "guardrail_blocked"


class GuardrailBlocked(GatewayError):
    """A guardrail refused the request or its answer (400 `guardrail_blocked`)."""

    status = 400
    code = GUARDRAIL_BLOCKED

    def __init__(self, guardrail: str, stage: str, reason: str) -> None:
        super().__init__(f"blocked by guardrail {guardrail!r} ({stage}): {reason}")
        self.guardrail = guardrail
        self.stage = stage


@dataclass(slots=True)
class TextPart:
    """One text of the request: a message's content (`role`) or a completion prompt ("prompt")."""

    role: str
    text: str


@dataclass(slots=True)
class GuardedRequest:
    """What guards see of a request: its model, project and texts, in order."""

    model: str
    project: str | None
    parts: list[TextPart] = field(default_factory=list)
    cache_salt: str | None = None  # the tenant's prompt-cache salt (for a classifier call)
    # who a classifier call is billed to (auth.principal.Principal; None: not metered) and the
    # request it guards (its usage records are named after it)
    principal: Any = None
    request_id: str = ""
    # what telemetry is told of the guarded request (gateway/request/observer.py): a classifier
    # call's routing and upstream call, and its usage (`on_usage`), belong to that request
    observer: Any = None


# (model, [(role, content)], max_tokens, the guarded request) -> the model's answer text, the
# call metered to the request's principal; raises GatewayError (a route that does not exist, an
# upstream failure)
Complete = Callable[[str, list[tuple[str, str]], int, GuardedRequest], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class GuardContext:
    """What the gateway lends a guard: `complete` asks a model configured behind the gateway."""

    complete: Complete


class ResponseScanner(ABC):
    """One choice's answer text, in order. Contract: `feed` is called with each new piece and
    returns the text to send now (a prefix of everything fed so far, possibly rewritten); `finish`
    is called once at the end and returns everything still held. Either raises GuardrailBlocked."""

    @abstractmethod
    async def feed(self, text: str) -> str: ...

    @abstractmethod
    async def finish(self) -> str: ...


class Guardrail(ABC):
    """A configured guard. `options` is the guard's own table in the config (validated by the
    constructor: a ValueError names what is wrong); `context` lends it the gateway's models."""

    rewrites_response = False  # True when the scanner may change text (logprobs are then dropped)

    def __init__(self, name: str, options: Mapping[str, Any], context: GuardContext) -> None:
        self.name = name
        self.context = context

    @abstractmethod
    async def check_request(self, request: GuardedRequest) -> None:
        """Check (and maybe rewrite) the request's texts; raise GuardrailBlocked to refuse it."""

    @abstractmethod
    def scan_response(self, request: GuardedRequest) -> ResponseScanner | None:
        """A fresh scanner for one choice of this request's answer; None: answers pass."""

    def block(self, stage: str, reason: str) -> GuardrailBlocked:
        return GuardrailBlocked(self.name, stage, reason)


def option(options: Mapping[str, Any], name: str, kind: type | tuple[type, ...],
           default: Any) -> Any:
    """`options[name]` if it is a `kind`, `default` when absent; a ValueError otherwise."""
    value = options.get(name, default)
    if not isinstance(value, kind) or isinstance(value, bool) and kind in (int, float):
        raise ValueError(f"guardrail option {name!r} must be {getattr(kind, '__name__', kind)}")
    return value


def check_known_options(name: str, options: Mapping[str, Any], known: set[str]) -> None:
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"guardrail {name!r}: unknown options {sorted(unknown)} "
                         f"(known: {sorted(known)})")
