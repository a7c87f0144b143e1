"""What a stateful API keeps around the one pipeline (the Responses API's stored responses).

    Pipeline.handle(request, dialect, keeper)
        admit:  ... parse, authorize -> keeper.prepare(canonical, principal) -> meter.admit ...
        answer: the dialect's final object -> keeper.keep(canonical, object) -> sent to the client

`prepare` runs before admission, so the request it completes (a stored conversation put before
the new input) is what admission counts, the router hashes and the replica gets. `keep` runs
before the answer (or the stream's last event) goes out, so a client that continues at once finds
it stored. A stream that fails after it started is kept too (its object says `failed`); one
whose client went away, and an answer refused before it started, are not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from auth.principal import Principal
from gateway.request.canonical import CanonicalRequest


class AnswerKeeper(ABC):
    @abstractmethod
    async def prepare(self, request: CanonicalRequest, principal: Principal) -> None:
        """Complete `request` from what is stored for `principal`'s project; raises GatewayError
        (a 4xx in the dialect's envelope) when it names what is not there."""

    @abstractmethod
    async def keep(self, request: CanonicalRequest, answer: dict[str, Any]) -> None:
        """Store `answer` (the object the client gets) as the request asked; never raises: a
        store that fails is logged, and the answer still goes out."""
