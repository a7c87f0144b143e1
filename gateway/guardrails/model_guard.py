"""The model guard: asks a model configured behind the gateway (a Llama-Guard-style classifier)
whether the conversation is safe, and blocks when its answer says "unsafe".

    [[guardrails]]
    name = "llama-guard"
    type = "model"
    stages = ["request", "response"]
    [guardrails.options]
    model = "llama-guard-3-1b"          # one of `models`, called through the gateway's own routes
    unsafe_pattern = '^\\s*unsafe'      # searched in the classifier's answer (case-insensitive)
    max_tokens = 10
    on_error = "block"                  # a classifier that fails or times out: "block" or "allow"
    check_every_chars = 0               # streams: also classify every N new characters
    max_chars = 32768                   # the conversation's last characters that are sent

The request stage sends the request's messages (a completion prompt as one user message); the
response stage sends them followed by the answer as the assistant's turn: Llama Guard's chat
template then classifies the agent's last turn. The classifier call is routed, retried and
timed out like any request to that model, with the caller's prompt-cache salt, and metered to the
caller: one usage record per classifier call, at the classifier model's price, named
`<request id>/guard-<n>` and tagged `guardrail` (gateway/guardrails/completer.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from gateway.guardrails.base import (
    GuardContext,
    GuardedRequest,
    Guardrail,
    ResponseScanner,
    check_known_options,
    option,
)
from gateway.request.errors import GatewayError

log = logging.getLogger("aigw.guardrails")


class ModelGuard(Guardrail):
    def __init__(self, name: str, options: Mapping[str, Any], context: GuardContext) -> None:
        super().__init__(name, options, context)
        check_known_options(name, options, {"model", "unsafe_pattern", "max_tokens", "on_error",
                                            "check_every_chars", "max_chars"})
        self.model = option(options, "model", str, "")
        if not self.model:
            raise ValueError(f"guardrail {name!r}: `model` names the classifier's model")
        try:
            self.unsafe = re.compile(option(options, "unsafe_pattern", str, r"^\s*unsafe"),
                                     re.IGNORECASE)
        except re.error as exc:
            raise ValueError(f"guardrail {name!r}: bad unsafe_pattern: {exc}") from None
        self.max_tokens = option(options, "max_tokens", int, 10)
        self.on_error = option(options, "on_error", str, "block")
        self.check_every_chars = option(options, "check_every_chars", int, 0)
        self.max_chars = option(options, "max_chars", int, 32768)
        if self.on_error not in ("block", "allow"):
            raise ValueError(f"guardrail {name!r}: on_error must be 'block' or 'allow'")
        if self.max_tokens <= 0 or self.max_chars <= 0 or self.check_every_chars < 0:
            raise ValueError(f"guardrail {name!r}: max_tokens and max_chars must be > 0, "
                             "check_every_chars >= 0")

    async def classify(self, request: GuardedRequest, answer: str | None, stage: str) -> None:
        """Raise GuardrailBlocked if the classifier calls the conversation unsafe."""
        turns = [("user" if part.role == "prompt" else part.role, part.text)
                 for part in request.parts if part.text]
        if answer is not None:
            turns.append(("assistant", answer))
        turns = _last_chars(turns, self.max_chars)
        try:
            verdict = await self.context.complete(self.model, turns, self.max_tokens, request)
        except Exception as exc:  # noqa: BLE001 - GatewayError, or a backend's own bug
            log.warning("guardrail %s: the classifier %s failed: %s", self.name, self.model,
                        exc.message if isinstance(exc, GatewayError) else repr(exc))
            if self.on_error == "block":
                raise self.block(stage, "the safety classifier is unavailable") from None
            return
        if self.unsafe.search(verdict):
            category = verdict.strip().splitlines()[1:2]
            raise self.block(stage, "the safety classifier rated it unsafe"
                             + (f" ({category[0].strip()[:64]})" if category else ""))

    async def check_request(self, request: GuardedRequest) -> None:
        await self.classify(request, None, "request")

    def scan_response(self, request: GuardedRequest) -> ResponseScanner:
        return _ModelScanner(self, request)


def _last_chars(turns: list[tuple[str, str]], max_chars: int) -> list[tuple[str, str]]:
    """The turns cut to their last `max_chars` characters in all (the latest turns whole)."""
    kept: list[tuple[str, str]] = []
    budget = max_chars
    for role, text in reversed(turns):
        if budget <= 0:
            break
        kept.append((role, text[-budget:]))
        budget -= len(text)
    return kept[::-1]


class _ModelScanner(ResponseScanner):
    __slots__ = ("_guard", "_num_unchecked_chars", "_request", "_text")

    def __init__(self, guard: ModelGuard, request: GuardedRequest) -> None:
        self._guard = guard
        self._request = request
        self._text: list[str] = []
        self._num_unchecked_chars = 0

    async def feed(self, text: str) -> str:
        self._text.append(text)
        self._num_unchecked_chars += len(text)
        every = self._guard.check_every_chars
        if every and self._num_unchecked_chars >= every:
            self._num_unchecked_chars = 0
            await self._guard.classify(self._request, self._answer(), "response")
        return text

    def _answer(self) -> str:
        joined = "".join(self._text)[-self._guard.max_chars:]
        self._text = [joined]  # (bounded: only the last max_chars are ever sent)
        return joined

    async def finish(self) -> str:
        await self._guard.classify(self._request, self._answer(), "response")
        return ""
