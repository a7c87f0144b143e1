"""RetentionPolicy: how long our replicas keep a request's prompt prefix from eviction after it
ends.

    retain_s, retention_id = policy.decide(request)      # after authentication (project known)

The replica's KV retention (engine/kv_cache/retention.py) protects the prefix's blocks from LRU
eviction for `retain_s`, so an agent whose tool runs for a minute finds its prefix still cached:

    the client asked       Anthropic cache_control ttl ("5m", "1h"), OpenAI prompt_cache_retention
                           ("in_memory" 5 min, "24h") or prompt_cache_options.ttl ("30m"):
                           CanonicalRequest.cache_retention_s, clamped to `max_s`
    a repeating session    the request names a session (prompt_cache_key, else x-session-id) that
                           this gateway has seen before: `session_s` (0 turns it off)
    otherwise              0: no retention, plain LRU

`retention_id` is a digest of (project, session) when the request names one, so the session's next
turn replaces this turn's retention at once; None otherwise (the replica then replaces a retention
by the next prompt that extends it). The replica bounds what is kept per project (cache salt) and
in all, and clamps to its own maximum. Seen sessions: at most `max_sessions` 16-byte digests,
least recently seen dropped first (bounded in bytes).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from gateway.request.canonical import CanonicalRequest

SESSION_ATTRIBUTES = ("prompt_cache_key", "session_id")  # what names a session, first wins


@dataclass(frozen=True, slots=True)
class RetentionSettings:
    max_s: float = 3600.0  # the longest retention a client may ask for
    session_s: float = 300.0  # a repeating session's, unasked
    max_sessions: int = 65_536

    def __post_init__(self) -> None:
        if self.max_s < 0 or self.session_s < 0 or self.max_sessions < 0:
            raise ValueError(f"invalid {self}")


class RetentionPolicy:
    def __init__(self, settings: RetentionSettings = RetentionSettings()) -> None:
        self.settings = settings
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def decide(self, request: CanonicalRequest) -> tuple[float, str | None]:
        """(seconds, retention id) for `request`; notes its session as seen."""
        if (request.cache_retention_s is None and not request.prompt_cache_key
                and not request.session_id):  # (SESSION_ATTRIBUTES: none names a session)
            return 0.0, None
        digest = session_digest(request)
        repeating = False
        if digest is not None and self.settings.max_sessions:
            repeating = digest in self._seen
            self._seen[digest] = None
            self._seen.move_to_end(digest)
            if len(self._seen) > self.settings.max_sessions:
                self._seen.popitem(last=False)
        if request.cache_retention_s is not None:
            retain_s = min(request.cache_retention_s, self.settings.max_s)
        else:
            retain_s = self.settings.session_s if repeating else 0.0
        retention_id = "s:" + digest.hex() if digest is not None and retain_s > 0 else None
        return retain_s, retention_id

    @property
    def num_sessions(self) -> int:
        return len(self._seen)


def session_digest(request: CanonicalRequest) -> bytes | None:
    """16 bytes naming (project, session), or None when the request names no session."""
    for attribute in SESSION_ATTRIBUTES:
        value = getattr(request, attribute)
        if isinstance(value, str) and value:
            text = f"{request.project or ''}/{attribute}/{value}"
            return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return None
