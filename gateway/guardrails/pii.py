"""The PII guard: e-mail addresses, phone numbers and card numbers (Luhn-checked), masked or
blocked, in requests and answers.

    [[guardrails]]
    name = "pii"
    type = "pii"
    stages = ["request", "response"]
    [guardrails.options]
    action = "mask"                     # or "block"
    kinds = ["email", "phone", "card"]
    mask_format = "[{kind}]"            # -> [EMAIL], [PHONE], [CARD]
    holdback_chars = 64                 # streamed answers: text held back until it is complete

What counts: an e-mail address (local@domain.tld); a phone number written with a leading `+` and
8-15 digits, or in the North American 3-3-4 form with separators; a run of 13-19 digits (spaces or
dashes between them allowed) that passes the Luhn check. A streamed answer is sent
`holdback_chars` behind what has arrived, and a match touching that edge is held whole, so no
masked value is ever sent in part (a value longer than the holdback, e.g. a 70-character e-mail
address, can be). The answer's logprobs are dropped: they would carry the original tokens.
"""

from __future__ import annotations

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

_KINDS = ("card", "phone", "email")  # (in this order: a card's digits are no phone number)
_PATTERNS = {
    "email": re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"),
    "phone": re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){2,5}(?!\w)"
                        r"|(?<![\w(])\(?\d{3}\)?[ .-]\d{3}[ .-]\d{4}(?!\w)"),
    "card": re.compile(r"(?<!\d)\d(?:[ -]?\d){12,18}(?!\d)"),
}


def luhn_ok(digits: str) -> bool:
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = ord(char) - 48
        if index % 2:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


def _is_real(kind: str, text: str) -> bool:
    if kind == "card":
        digits = re.sub(r"\D", "", text)
        return 13 <= len(digits) <= 19 and luhn_ok(digits)
    if kind == "phone":
        return 8 <= sum(c.isdigit() for c in text) <= 15
    return True


_MAYBE = re.compile(r"@|\d")  # every kind holds an @ or a digit: text without either is clean


def find_pii(text: str, kinds: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """(start, end, kind) of each value in `text`, in order, none overlapping."""
    spans: list[tuple[int, int, str]] = []
    if _MAYBE.search(text) is None:
        return spans
    for kind in _KINDS:
        if kind not in kinds:
            continue
        for match in _PATTERNS[kind].finditer(text):
            start, end = match.span()
            if (_is_real(kind, match.group())
                and not any(s < end and start < e for s, e, _ in spans)):
                spans.append((start, end, kind))
    spans.sort()
    return spans


class PiiGuard(Guardrail):
    def __init__(self, name: str, options: Mapping[str, Any], context: GuardContext) -> None:
        super().__init__(name, options, context)
        check_known_options(name, options, {"action", "kinds", "mask_format", "holdback_chars"})
        self.action = option(options, "action", str, "mask")
        if self.action not in ("mask", "block"):
            raise ValueError(f"guardrail {name!r}: action must be 'mask' or 'block'")
        kinds = option(options, "kinds", list, list(_KINDS))
        if not kinds or any(kind not in _KINDS for kind in kinds):
            raise ValueError(f"guardrail {name!r}: kinds must be some of {list(_KINDS)}")
        self.kinds = tuple(kinds)
        self.mask_format = option(options, "mask_format", str, "[{kind}]")
        self.holdback_chars = option(options, "holdback_chars", int, 64)
        if self.holdback_chars < 0:
            raise ValueError(f"guardrail {name!r}: holdback_chars must be >= 0")
        self.rewrites_response = self.action == "mask"

    def mask(self, text: str, spans: list[tuple[int, int, str]], stage: str) -> str:
        if not spans:
            return text
        if self.action == "block":
            raise self.block(stage, f"the text holds {'an' if spans[0][2] == 'email' else 'a'} "
                                    f"{_NOUN[spans[0][2]]}")
        return self._masked(text, spans)

    def _masked(self, text: str, spans: list[tuple[int, int, str]]) -> str:
        pieces, position = [], 0
        for start, end, kind in spans:
            pieces += [text[position:start], self.mask_format.format(kind=kind.upper())]
            position = end
        pieces.append(text[position:])
        return "".join(pieces)

    async def check_request(self, request: GuardedRequest) -> None:
        for part in request.parts:
            part.text = self.mask(part.text, find_pii(part.text, self.kinds), "request")

    def mask_text(self, text: str) -> str:
        """`text` masked, whatever `action` is (the request log applies it to the body it
        stores: a request this guard blocked keeps no PII in the log either)."""
        spans = find_pii(text, self.kinds)
        return self._masked(text, spans) if spans else text

    def scan_response(self, request: GuardedRequest) -> ResponseScanner:
        return _PiiScanner(self)


_NOUN = {"email": "e-mail address", "phone": "phone number", "card": "card number"}


class _PiiScanner(ResponseScanner):
    __slots__ = ("_guard", "_held")

    def __init__(self, guard: PiiGuard) -> None:
        self._guard = guard
        self._held = ""

    async def feed(self, text: str) -> str:
        held = self._held + text
        spans = find_pii(held, self._guard.kinds)
        cut = max(0, len(held) - self._guard.holdback_chars)
        for start, end, _ in spans:  # a value at the edge (or reaching the end) is held whole
            if start < cut and (end > cut or end == len(held)):
                cut = start
                break
        self._held = held[cut:]
        return self._guard.mask(held[:cut], [s for s in spans if s[1] <= cut], "response")

    async def finish(self) -> str:
        held, self._held = self._held, ""
        return self._guard.mask(held, find_pii(held, self._guard.kinds), "response")
