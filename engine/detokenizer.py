"""IncrementalDetokenizer: one request's generated token ids -> released text, with stop strings.

Two stages, each holding text back for its own reason:

    token ids ──► DecodeStream ──► decoded text ──► stop-string window ──► released text
                  holds the ids of an               holds the longest tail that may still
                  incomplete UTF-8 character        be the start of a stop string
                  (never emits U+FFFD for one)      (at most max(len(stop)) - 1 chars)

`tokenizers.decoders.DecodeStream` decodes a short window of recent ids per step, so the cost
per token is constant, and it returns nothing until the bytes so far form complete characters
(checked for ByteLevel BPE: emoji, CJK and ZWJ sequences split across tokens).

Stop strings match across token boundaries and are never released. When several could match,
the one that is complete first in the text wins (ties: the one starting first), so the result
does not depend on how the ids were split between pushes. After a match, everything after the
stop string is dropped and later pushes release nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


@dataclass(frozen=True)
class DetokenizerUpdate:
    text: str  # newly released text (stop strings removed)
    stop_matched: str | None = None  # the stop string that ended the text, once one has matched


class IncrementalDetokenizer:
    """Turns one request's generated ids, pushed step by step, into released text.

    Contract: the concatenation of every `push(...).text` and the final `finish()` equals
    `tokenizer.decode(all_ids, skip_special_tokens=...)` cut just before the first stop string
    (when one matches). `tokenizer` is the raw `tokenizers.Tokenizer`.
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        assert all(stop), "stop strings must be non-empty"
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stops = tuple(stop)
        self._stop_first_chars = frozenset(s[0] for s in self._stops)
        self._max_held_chars = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""  # decoded, not released: may be the start of a stop string
        self._last_decoded_id: int | None = None  # context for decoding `_undecoded_ids`
        self._undecoded_ids: list[int] = []  # pushed ids the stream has produced no text for
        self._stop_matched: str | None = None

    @property
    def stop_matched(self) -> str | None:
        return self._stop_matched

    def push(self, token_ids: Sequence[int], check_stop: bool = True) -> DetokenizerUpdate:
        """Adds newly generated ids; returns the text that can now be released.

        After a stop string has matched, returns empty text and the stop string. With
        `check_stop=False` (the request has not reached min_tokens yet) stop strings are not looked
        for and everything decoded so far is released.
        """
        if self._stop_matched is not None:
            return DetokenizerUpdate("", self._stop_matched)
        pieces = []
        for token_id in token_ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if piece is None:
                self._undecoded_ids.append(token_id)
            else:
                pieces.append(piece)
                self._undecoded_ids.clear()
                self._last_decoded_id = token_id
        if not check_stop:
            released, self._held = self._held + "".join(pieces), ""
            return DetokenizerUpdate(released, None)
        return DetokenizerUpdate(self._release("".join(pieces)), self._stop_matched)

    def finish(self) -> str:
        """Releases everything still held, for a request that ends for another reason.

        Ids that never formed complete characters are decoded as the tokenizer would decode
        them (U+FFFD for a truncated UTF-8 sequence). Returns "" after a stop string matched.
        """
        if self._stop_matched is not None:
            return ""
        text = self._release(self._decode_undecoded())
        if self._stop_matched is None:
            text, self._held = text + self._held, ""
        return text

    def _decode_undecoded(self) -> str:
        ids, self._undecoded_ids = self._undecoded_ids, []
        if not ids:
            return ""
        if self._last_decoded_id is None:
            return self._decode(ids)
        # decode with one id of context: some decoders treat the first token specially
        context = self._decode([self._last_decoded_id])
        text = self._decode([self._last_decoded_id, *ids])
        return text[len(context) :] if text.startswith(context) else self._decode(ids)

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens))

    def _release(self, new_text: str) -> str:
        """Appends new_text to the held window; returns what can no longer be a stop string."""
        if not self._stops:
            return new_text
        window = self._held + new_text  # the held part contains no complete stop string
        match = self._first_stop(window)
        if match is not None:
            start, self._stop_matched = match
            self._held = ""
            return window[:start]
        num_held = self._num_stop_prefix_chars(window)
        self._held = window[len(window) - num_held :]
        return window[: len(window) - num_held]

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop) of the stop string that is complete first in text, if any."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _num_stop_prefix_chars(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        # no set of every prefix: that is O(len(stop)^2) characters, 40 GB for one 200k-char stop
        for n in range(min(len(text), self._max_held_chars), 0, -1):
            if text[-n] in self._stop_first_chars:
                tail = text[-n:]
                if any(len(stop) > n and stop.startswith(tail) for stop in self._stops):
                    return n
        return 0
