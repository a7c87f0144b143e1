"""Running the configured guardrails on one request: `Guardrails.for_request` picks the guards
that apply (by model and project), `RequestGuards` runs them.

    guards = guardrails.for_request(canonical)          # None: no guard applies
    await guards.check_request(canonical)               # after admission, before dispatch
    await guards.guard_attempt(attempt)                 # the answer's events, through the scanners

`guard_attempt` replaces the attempt's events by guarded ones: each choice's text and reasoning
go through a chain of `ResponseScanner`s (one per guard, per choice and kind) as they arrive;
`Finish` events wait for the held text, which is flushed when the `Usage` arrives (or the stream
ends). A block raised while flushing comes after that `Usage`, so a blocked answer is metered
with the upstream's own count; a block in the middle stops the upstream (the prompt is then
counted, the completion estimated from what was received, as for any stream cut short).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from gateway.guardrails.base import (
    GuardedRequest,
    Guardrail,
    GuardrailBlocked,
    ResponseScanner,
    TextPart,
)
from gateway.guardrails.settings import GuardrailSettings
from gateway.request.canonical import (
    CanonicalEvent,
    CanonicalRequest,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from gateway.request.dispatch import Attempt
from gateway.request.errors import UpstreamUnavailable
from gateway.routing.base import Router
from gateway.settings import GatewaySettings
from gateway.upstream.retry_budget import RetryBudget
from gateway.upstream.wait_timer import Watchdog

if TYPE_CHECKING:
    from gateway.fleet.endpoints import Fleet

log = logging.getLogger("aigw.guardrails")


class Guardrails:
    """Every configured guard, and what they did (for /metrics: blocks by guard and stage,
    requests whose text a request guard rewrote)."""

    def __init__(self, guards: Sequence[tuple[GuardrailSettings, Guardrail]]) -> None:
        self._guards = list(guards)
        self.num_blocked: dict[tuple[str, str], int] = {}
        self.num_rewritten: dict[str, int] = {}

    def for_request(self, request: CanonicalRequest, principal: Any = None
                    ) -> RequestGuards | None:
        """The guards that apply to `request`; a model guard's calls are billed to `principal`
        (None: not metered)."""
        on_request, on_response = [], []
        for settings, guard in self._guards:
            if settings.applies_to(request.model, request.project):
                if "request" in settings.stages:
                    on_request.append(guard)
                if "response" in settings.stages:
                    on_response.append(guard)
        if not on_request and not on_response:
            return None
        return RequestGuards(self, on_request, on_response, principal)

    def count_block(self, blocked: GuardrailBlocked) -> None:
        key = (blocked.guardrail, blocked.stage)
        self.num_blocked[key] = self.num_blocked.get(key, 0) + 1


# kinds whose texts are `prompt` and `extra_prompts` (an embeddings request's inputs too: a guard
# on a model applies to what is embedded as much as to what is generated)
_PROMPT_KINDS = ("completion", "embedding")


def _parts_of(request: CanonicalRequest) -> list[TextPart]:
    parts = [TextPart(message.role, message.content) for message in request.messages]
    if request.kind in _PROMPT_KINDS:
        parts.append(TextPart("prompt", request.prompt))
        parts += [TextPart("prompt", p) for p in request.extra_prompts if isinstance(p, str)]
    return parts


def _write_back(request: CanonicalRequest, parts: list[TextPart]) -> bool:
    """The guards' texts back into the request; True if any changed."""
    changed = False
    num_messages = len(request.messages)
    for index, part in enumerate(parts[:num_messages]):
        message = request.messages[index]
        if part.text != message.content:
            request.messages[index] = dataclasses.replace(message, content=part.text)
            changed = True
    if request.kind in _PROMPT_KINDS:
        prompts = iter(parts[num_messages:])
        text = next(prompts).text
        if text != request.prompt:
            request.prompt, changed = text, True
        for index, prompt in enumerate(request.extra_prompts):
            if isinstance(prompt, str):
                text = next(prompts).text
                if text != prompt:
                    request.extra_prompts[index], changed = text, True
    if changed:
        request.rendered_prompt = None  # (rendered at admission from the text before masking)
    return changed


class RequestGuards:
    def __init__(self, owner: Guardrails, on_request: list[Guardrail],
                 on_response: list[Guardrail], principal: Any = None) -> None:
        self._owner = owner
        self._principal = principal
        self._on_request = on_request
        self._on_response = on_response
        self._rewrites = any(guard.rewrites_response for guard in on_response)
        self._view: GuardedRequest | None = None

    async def check_request(self, request: CanonicalRequest) -> None:
        """Run the request guards (raises GuardrailBlocked); masked texts are written back."""
        view = self._view = self._guarded(request)
        for guard in self._on_request:
            before = [part.text for part in view.parts]
            try:
                await guard.check_request(view)
            except GuardrailBlocked as blocked:
                self._owner.count_block(blocked)
                raise
            except Exception as exc:  # noqa: BLE001 - a guard's own bug fails closed
                raise self._failed(guard.name, "request", exc) from None
            if before != [part.text for part in view.parts]:
                self._owner.num_rewritten[guard.name] = self._owner.num_rewritten.get(guard.name,
                                                                                      0) + 1
        _write_back(request, view.parts)

    def _guarded(self, request: CanonicalRequest) -> GuardedRequest:
        return GuardedRequest(request.model, request.project, _parts_of(request),
                              request.cache_salt, self._principal, request.request_id,
                              request.observer)

    def body_masker(self) -> Callable[[str], str] | None:
        """What the request guards that mask (`mask_text`) do to a text, for the request log's
        copy of the body; None when none masks."""
        maskers = [mask for guard in self._on_request
                   if (mask := getattr(guard, "mask_text", None)) is not None]
        if not maskers:
            return None

        def mask_all(text: str) -> str:
            for mask in maskers:
                text = mask(text)
            return text
        return mask_all

    async def guard_attempt(self, attempt: Attempt, request: CanonicalRequest) -> None:
        """The attempt's events through the response scanners, from its first event on (a
        block there raises here; the caller releases the attempt, which closes the upstream)."""
        if not self._on_response:
            return
        if self._view is None:
            self._view = self._guarded(request)
        guarded = self._events(attempt.first_event, attempt.events)
        attempt.events = guarded
        try:
            attempt.first_event = await anext(guarded)
        except StopAsyncIteration:
            raise UpstreamUnavailable("the upstream ended the answer before any event") from None

    async def _events(self, first: CanonicalEvent, inner: AsyncIterator[CanonicalEvent]
                      ) -> AsyncIterator[CanonicalEvent]:
        chains: dict[tuple[bool, int], list[ResponseScanner]] = {}
        finishes: list[Finish] = []
        event: CanonicalEvent | None = first
        try:
            while event is not None:
                if isinstance(event, TextDelta | ReasoningDelta):
                    key = (isinstance(event, ReasoningDelta), event.choice)
                    chain = chains.get(key)
                    if chain is None:
                        chain = chains[key] = self._new_chain()
                    text = await self._run(chain, event.text, final=False)
                    if text or (isinstance(event, TextDelta) and event.logprobs is not None
                                and not self._rewrites):
                        yield self._delta(event, text)
                elif isinstance(event, Finish):
                    finishes.append(event)
                elif isinstance(event, ToolCallDelta):  # the choice's held text goes first
                    for delta in await self._flush(chains, event.choice):
                        yield delta
                    yield event
                elif isinstance(event, Usage):
                    try:
                        tail = await self._flush(chains)
                    except GuardrailBlocked:
                        yield event  # metered with the upstream's count, then the block
                        raise
                    for delta in tail:
                        yield delta
                    for finish in finishes:
                        yield finish
                    finishes.clear()
                    yield event
                else:
                    yield event
                event = await anext(inner, None)
            for delta in await self._flush(chains):
                yield delta
            for finish in finishes:
                yield finish
        finally:
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()

    def _new_chain(self) -> list[ResponseScanner]:
        assert self._view is not None
        chain = []
        for guard in self._on_response:
            scanner = guard.scan_response(self._view)
            if scanner is not None:
                chain.append(scanner)
        return chain

    async def _run(self, chain: list[ResponseScanner], text: str, final: bool) -> str:
        try:
            for scanner in chain:
                if text:
                    text = await scanner.feed(text)
                if final:
                    text += await scanner.finish()
        except GuardrailBlocked as blocked:
            self._owner.count_block(blocked)
            raise
        except Exception as exc:  # noqa: BLE001 - a scanner's own bug fails closed
            raise self._failed(type(scanner).__name__, "response", exc) from None
        return text

    def _failed(self, name: str, stage: str, exc: Exception) -> GuardrailBlocked:
        log.error("guardrail %s failed on the %s", name, stage, exc_info=exc)
        blocked = GuardrailBlocked(name, stage, "the guardrail failed")
        self._owner.count_block(blocked)
        return blocked

    async def _flush(self, chains: dict[tuple[bool, int], list[ResponseScanner]],
                     only_choice: int | None = None) -> list[CanonicalEvent]:
        """What the scanners hold, as deltas (of one choice, or of all); their chains end
        (text after this, e.g. after a tool call, gets fresh scanners)."""
        deltas: list[CanonicalEvent] = []
        for key in [k for k in chains if only_choice is None or k[1] == only_choice]:
            is_reasoning, choice = key
            text = await self._run(chains.pop(key), "", final=True)
            if text:
                deltas.append(ReasoningDelta(text, choice) if is_reasoning
                              else TextDelta(text, choice))
        return deltas

    def _delta(self, event: TextDelta | ReasoningDelta, text: str) -> CanonicalEvent:
        if isinstance(event, ReasoningDelta):
            return event if text == event.text else ReasoningDelta(text, event.choice)
        if text == event.text and not self._rewrites:
            return event
        return TextDelta(text, event.choice)  # (its logprobs would show the original tokens)


def build_chain(settings: GatewaySettings, fleet: Fleet, router: Router, budget: RetryBudget,
                watchdog: Watchdog, meter: Any = None) -> Guardrails | None:
    """The configured guardrails (a model guard's calls routed like the pipeline's and metered
    to `meter`); None when none is configured. (Their settings were checked when the config was
    read.)"""
    if not settings.guardrails:
        return None
    from gateway.guardrails import build_guardrails
    from gateway.guardrails.completer import make_completer

    return Guardrails(build_guardrails(settings.guardrails,
                                       make_completer(fleet, router, settings, budget, watchdog,
                                                      meter)))
