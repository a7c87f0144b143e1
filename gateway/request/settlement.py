"""Settling: an admitted request's one usage record goes to the meter exactly once.

    settler = Settler(meter)                     # one per pipeline
    state.settlement = settler.open(state)       # one per admitted request (a `Settlement`)
    await state.settlement.settle(queue=False)   # before the answer (limited requests): awaited
    await state.settlement.settle()              # the handler's `finally`: queued if the meter can
    # whichever call comes first settles; every later one returns False and does nothing

`Settlement` owns "exactly once": its flag is set before the settle runs, so a settle that
raises, or is cancelled half-way, is never retried into a second record (the meter would count
its tokens twice). `Settler` owns how: the record built from the request's state
(gateway/request/state.py, gateway/request/usage.py), queued with a meter that has
`settle_nowait` (so the answer never waits for the usage write) unless `queue` is false, the
prompt counted first when an answer broke off before its usage (off the event loop, in a task
shutdown waits for: `wait_settled`), the request log's entry submitted with it, and the
request's observer told (`on_settled`). A meter that fails is logged; settling never raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING

from gateway.metering.contract import Admission, Meter, UsageRecord
from gateway.request.usage import build_record
from gateway.request_logs.capture import capture

if TYPE_CHECKING:
    from gateway.request.state import RequestState
    from gateway.request_logs import RequestLog

log = logging.getLogger("aigw.gateway")


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


class Settler:
    """How the pipeline's requests settle (module docstring)."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self._settle_nowait = getattr(meter, "settle_nowait", None)
        self._counting: set[asyncio.Task[None]] = set()  # _count_and_settle tasks in flight
        self.request_log: RequestLog | None = None  # set by the served app (gateway/request_logs/)

    def open(self, state: RequestState) -> Settlement:
        """The request's one `Settlement`."""
        return Settlement(partial(self._settle, state))

    async def wait_settled(self, timeout_s: float = 5.0) -> None:
        """Shutdown, before the meter closes: let the settlements that count a prompt first
        (`_count_and_settle`, shielded from their cancelled handlers) finish."""
        if self._counting:
            await asyncio.wait(set(self._counting), timeout=timeout_s)

    async def settle_now(self, admission: Admission, record: UsageRecord) -> None:
        """Write `record` now (for a route outside the pipeline, e.g. count_tokens); never
        raises."""
        try:
            await self.meter.settle(admission, record)
        except Exception:  # noqa: BLE001 - a metering outage must not fail the answer
            log.exception("settle failed for %s", record.request_id)

    async def _settle(self, state: RequestState, queue: bool) -> None:
        state.adopt_abandoned_attempt()  # (a client that left a non-streamed request)
        if state.needs_prompt_count():  # an answer that broke off before its usage
            task = asyncio.ensure_future(self._count_and_settle(state, queue))
            self._counting.add(task)
            task.add_done_callback(self._counting.discard)
            await asyncio.shield(task)  # a client that leaves stops neither count nor settle
        elif queue and self._settle_nowait is not None:
            record = self._record(state)
            try:
                self._settle_nowait(state.admission, record)  # never raises; nothing to cancel
            finally:
                state.canonical.observer.on_settled(record)
        else:
            await asyncio.shield(self._write(state, self._record(state)))

    async def _write(self, state: RequestState, record: UsageRecord) -> None:
        try:
            await self.settle_now(state.admission, record)
        finally:
            state.canonical.observer.on_settled(record)

    async def _count_and_settle(self, state: RequestState, queue: bool) -> None:
        """The upstream started answering but its usage never came (the client went away, or
        the stream broke): count the prompt it processed as the backend counts it (a replica:
        exactly, with its chat template and tokenizer; off the event loop), then settle
        (queued when `queue` and the meter can). If the count fails, the record keeps the
        estimate."""
        assert state.endpoint is not None
        try:
            state.num_prompt_tokens = await asyncio.to_thread(
                state.route.backend.count_prompt_tokens, state.canonical, state.endpoint)
        except Exception:  # noqa: BLE001 - e.g. a chat template that rejects this conversation
            log.debug("cannot count the prompt of %s", state.canonical.request_id, exc_info=True)
        record = self._record(state)
        if queue and self._settle_nowait is not None:
            try:
                self._settle_nowait(state.admission, record)
            finally:
                state.canonical.observer.on_settled(record)
        else:
            await self._write(state, record)

    def _record(self, state: RequestState) -> UsageRecord:
        """The request's usage record (and its request-log entry, when it was sampled)."""
        latency_ms = (time.perf_counter() - state.timing.started) * 1000.0
        record = build_record(state.canonical, state.principal, state.route.settings,
                              "" if state.replica == "none" else state.replica,
                              state.accumulator, state.status, latency_ms,
                              state.num_prompt_tokens, record_id=state.usage_id)
        if state.is_logged and self.request_log is not None:  # (queued, never awaited)
            self.request_log.submit(capture(
                state.request, state.dialect, state.canonical, state.accumulator, state.error,
                record, state.guards.body_masker() if state.guards is not None else None))
        return record
