"""The deny-list / regex guard: blocks a request or an answer that matches.

    [[guardrails]]
    name = "deny"
    type = "regex"
    [guardrails.options]
    words = ["project zeus"]            # literal, case-insensitive, on word boundaries
    patterns = ['\\bsk-[A-Za-z0-9]{20,}']  # Python regular expressions
    window_chars = 256                  # how far back a streamed match may start

On a stream each delta is checked with the last `window_chars` already sent before it, so a match
that spans deltas is caught on the delta that completes it, which is then not sent (the part of
the match in earlier deltas was). Nothing is held back: the stream is not delayed.
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


class RegexGuard(Guardrail):
    def __init__(self, name: str, options: Mapping[str, Any], context: GuardContext) -> None:
        super().__init__(name, options, context)
        check_known_options(name, options, {"words", "patterns", "window_chars"})
        words = option(options, "words", list, [])
        patterns = option(options, "patterns", list, [])
        if not all(isinstance(x, str) and x for x in words + patterns):
            raise ValueError(f"guardrail {name!r}: words and patterns must be non-empty strings")
        if not words and not patterns:
            raise ValueError(f"guardrail {name!r}: give `words` or `patterns`")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"guardrail {name!r}: bad pattern {pattern!r}: {exc}") from None
        # words and patterns apart: a streamed word match starts at most its length back, a
        # pattern's anywhere in the window
        self.words = (re.compile("|".join(rf"\b{re.escape(w)}\b" for w in words), re.IGNORECASE)
                      if words else None)
        self.patterns = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None
        self.max_word_chars = max(map(len, words), default=0)
        self.window_chars = option(options, "window_chars", int, 256)
        if self.window_chars < 0:
            raise ValueError(f"guardrail {name!r}: window_chars must be >= 0")
        if self.patterns is None:
            self.window_chars = min(self.window_chars, self.max_word_chars)

    def matches(self, text: str, from_char: int = 0) -> bool:
        """Does a word or pattern match in `text` and end past `from_char`?"""
        for pattern, start in ((self.words, max(0, from_char - self.max_word_chars)),
                               (self.patterns, 0)):
            if pattern is None:
                continue
            match = pattern.search(text, start)
            while match is not None and match.end() <= from_char:  # (one in the tail alone was
                match = pattern.search(text, match.start() + 1)  # checked already)
            if match is not None:
                return True
        return False

    async def check_request(self, request: GuardedRequest) -> None:
        for part in request.parts:
            if self.matches(part.text):
                raise self.block("request", f"the {part.role} text matches a denied pattern")

    def scan_response(self, request: GuardedRequest) -> ResponseScanner:
        return _RegexScanner(self)


class _RegexScanner(ResponseScanner):
    __slots__ = ("_guard", "_tail")

    def __init__(self, guard: RegexGuard) -> None:
        self._guard = guard
        self._tail = ""  # the last window_chars sent

    async def feed(self, text: str) -> str:
        guard = self._guard
        seen = self._tail + text
        if guard.matches(seen, len(self._tail)):
            raise guard.block("response", "the answer matches a denied pattern")
        self._tail = seen[-guard.window_chars:] if guard.window_chars else ""
        return text

    async def finish(self) -> str:
        return ""
