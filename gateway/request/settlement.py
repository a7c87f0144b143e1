"""`Settlement`: the one object that owns "an admitted request is settled exactly once".

    settlement = Settlement(settle_once)        # settle_once(queue) meters the request's record
    await settlement.settle(queue=False)        # before the answer (limited requests): awaited
    await settlement.settle()                   # the handler's `finally`: queued if the meter can
    # whichever call comes first settles; every later one returns False and does nothing

The flag is set before `settle_once` runs, so a settle that raises, or is cancelled half-way,
is never retried into a second record (the meter would count its tokens twice).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable


class Settlement:
    __slots__ = ("_settle_once", "is_settled")

    def __init__(self, settle_once: Callable[[bool], Awaitable[None]]) -> None:
        self._settle_once = settle_once  # (queue) -> settles; queue: the meter may defer the write
        self.is_settled = False

    async def settle(self, *, queue: bool = True) -> bool:
        """Settle unless already settled; True when this call did."""
        if self.is_settled:
            return False
        self.is_settled = True
        await self._settle_once(queue)
        return True
