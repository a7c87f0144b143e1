"""The answer side of the pipeline: the whole answer (`Answerer.respond`), the dialect's events
as they come (`Answerer.stream`), and an error in the dialect's envelope (`error_response`).

    respond   the response guards -> drain the upstream's events -> (limited: settle) ->
              the dialect's object -> the keeper stores it -> headers -> sent
    stream    the response guards -> headers -> the first event -> each event as it comes
              -> (limited: settle) -> the last events and the terminator in one send

Both release the attempt (closing the upstream) whatever happens and feed the endpoint's circuit
breaker. After a stream has started, a failure ends it with the dialect's error event (its status
200 already sent). Every answer carries `x-request-id`, `x-aigw-served-model` and, for a traced
request, `x-aigw-trace-id`; only an operator's (`state.show_overhead`) the gateway's own time and
the endpoint that served.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from aiohttp import web

from auth.principal import Principal, Scope
from gateway.dialects.base import Dialect, StreamEncoder
from gateway.guardrails.base import GuardrailBlocked
from gateway.request.canonical import FOLDED_EVENTS, Accumulator, CanonicalEvent
from gateway.request.dispatch import Attempt, Timing
from gateway.request.errors import UpstreamError, UpstreamTimeout
from gateway.request.observer import TRACE_ID_HEADER
from gateway.request.state import RequestState
from gateway.request.usage import (
    COST_HEADER,
    COST_REQUEST_HEADER,
    STATUS_CLIENT_CLOSED,
    cost_usd_of,
    wants_cost,
)
from gateway.routing.base import Router
from gateway.settings import GatewaySettings
from gateway.upstream.wait_timer import WaitTimer, Watchdog

log = logging.getLogger("aigw.gateway")

_CLIENT_GONE = (ConnectionResetError, ConnectionError)
DRAIN_DEADLINE = "aigw: the drain deadline"  # the cancel message of a stream the drain ends
_DRAINING = (503, "draining", "the gateway is shutting down")
_SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}
SERVED_MODEL_HEADER = "x-aigw-served-model"  # the model that answered (a fallback's, after a hop)

# The gateway's own time on a request (ms), for the overhead metric; the `x-aigw-overhead-ms`
# header shows it only to a caller with the admin scope: its figure moves with what the request
# found cached or queued in state every tenant shares, a timing side channel for anyone else.
OVERHEAD_MS = web.ResponseKey("aigw_overhead_ms", float)


def error_response(dialect: Dialect, status: int, code: str, message: str, request_id: str,
                   overhead_ms: float, replica: str = "none",
                   headers: dict[str, str] | None = None, param: str | None = None,
                   error_type: str | None = None, show_overhead: bool = False) -> web.Response:
    body = dialect.error_body(status, code, message, param, error_type)
    response = web.Response(status=status, body=orjson.dumps(body),
                            content_type="application/json", headers=headers)
    stamp(response, request_id, replica, overhead_ms, show_overhead)
    return response


def stamp(response: web.StreamResponse, request_id: str, replica: str, overhead_ms: float,
          show_overhead: bool) -> None:
    """`show_overhead` is the operator's view (an admin caller, or auth off): only it reads the
    gateway's time and which endpoint served (`x-aigw-replica` is the endpoint's host:port,
    internal topology; others see it only as "none" when nothing was dispatched)."""
    headers = response.headers  # (a property: one Python call a read)
    headers["x-request-id"] = request_id
    if show_overhead or replica == "none":
        headers["x-aigw-replica"] = replica
    response[OVERHEAD_MS] = overhead_ms
    if show_overhead:
        headers["x-aigw-overhead-ms"] = f"{overhead_ms:.3f}"


_ADMIN_SCOPE = Scope.ADMIN.value  # (an Enum's .value is two Python calls a read)


def may_see_overhead(principal: Principal) -> bool:
    """Only an operator (the admin scope) reads the gateway's per-request timing (or anyone,
    with auth off: then the dashboard is open too)."""
    return _ADMIN_SCOPE in principal.scopes


class Answerer:
    """The answer steps of every request of one pipeline (module docstring)."""

    def __init__(self, settings: GatewaySettings, router: Router, watchdog: Watchdog) -> None:
        self.settings = settings
        self.router = router  # (its `explain`, for x-aigw-debug)
        self._watchdog = watchdog
        self._streaming: set[asyncio.Task[object]] = set()  # handlers writing a stream now

    def end_streams(self) -> int:
        """The drain's deadline (gateway/web/server.py): every stream still being written ends
        with its dialect's error event (503 `draining`) and is settled, instead of being cut
        mid-chunk when the server closes its connection. Returns how many were ended."""
        for task in self._streaming:
            task.cancel(DRAIN_DEADLINE)
        return len(self._streaming)

    async def respond(self, state: RequestState, attempt: Attempt) -> web.Response:
        """The whole answer, sent here (so settling and the telemetry that follow it are not on
        the client's critical path). Releases `attempt`."""
        canonical, timing = state.canonical, state.timing
        state.status = 499  # until the answer is built (a cancelled handler keeps this)
        try:
            if state.guards is not None:  # the answer through the response guards
                await state.guards.guard_attempt(attempt, canonical)
            state.accumulator.add(attempt.first_event)
            await self._drain_events(attempt, state.accumulator, timing)
            attempt.endpoint.breaker.record_success()
        except GuardrailBlocked:
            attempt.endpoint.breaker.record_success()  # (the endpoint answered)
            raise
        except (UpstreamError, TimeoutError) as exc:
            attempt.endpoint.breaker.record_failure(time.monotonic())
            raise _after_start(exc, self.settings) from None
        finally:
            await attempt.release()
        state.status = 200
        if state.settles_before_answer:
            await state.settlement.settle(queue=False)
        answer = state.dialect.render(canonical, state.accumulator.response())
        if state.keeper is not None:
            await state.keeper.keep(canonical, answer)
        response = web.Response(body=orjson.dumps(answer), content_type="application/json",
                                headers=state.admission.headers)
        self._headers(response, state)
        headers = state.request.headers
        if COST_REQUEST_HEADER in headers and wants_cost(headers):  # asked: x-aigw-cost: 1
            response.headers[COST_HEADER] = cost_usd_of(canonical, state.route.settings,
                                                        state.accumulator)
        try:
            await response.prepare(state.request)
            await response.write_eof()
        except _CLIENT_GONE:
            state.status = STATUS_CLIENT_CLOSED
        return response

    async def stream(self, state: RequestState, attempt: Attempt) -> web.StreamResponse:
        """The answer as the dialect's events, written as they come. Releases `attempt`."""
        canonical = state.canonical
        state.status = STATUS_CLIENT_CLOSED
        accumulator = state.accumulator
        encoder = state.dialect.encoder(canonical)
        response = web.StreamResponse(headers={**_SSE_HEADERS, **state.admission.headers})
        task = asyncio.current_task()
        try:
            if state.guards is not None:  # (a block on the first event is still a 400)
                await state.guards.guard_attempt(attempt, canonical)
            self._headers(response, state)
            await response.prepare(state.request)
            state.status = 200
            if task is not None:
                self._streaming.add(task)  # (the drain's deadline ends it: end_streams)
            accumulator.add(attempt.first_event)
            await response.write(encoder.start(accumulator.prompt_usage)
                                 + _delta_bytes(encoder, attempt.first_event))
            try:
                idle_timeout_s = self.settings.idle_timeout_s
                async with WaitTimer(self._watchdog) as timer:
                    while True:
                        timer.waiting(idle_timeout_s)
                        try:
                            event = await anext(attempt.events)
                        except StopAsyncIteration:
                            break
                        finally:
                            timer.done_waiting()
                        accumulator.add(event)
                        if not isinstance(event, FOLDED_EVENTS):
                            await response.write(encoder.event(event))
                attempt.endpoint.breaker.record_success()
                tail = encoder.finish(accumulator.response())
            # a response guard stopped it: the dialect's error event
            except GuardrailBlocked as exc:
                attempt.endpoint.breaker.record_success()
                accumulator.finish_reason = "content_filter"
                state.error = (exc.code, exc.message)
                tail = encoder.error(exc.status, exc.code, exc.message)
            except (UpstreamError, TimeoutError) as exc:
                attempt.endpoint.breaker.record_failure(time.monotonic())
                error = _after_start(exc, self.settings)
                log.warning("stream %s failed after start: %s", canonical.request_id, error.message)
                accumulator.finish_reason = "error"
                tail = encoder.error(error.status, error.code, error.message)
            if state.keeper is not None and (answer := encoder.answer()) is not None:
                await state.keeper.keep(canonical, answer)  # before its last event goes out
            if state.settles_before_answer:
                await state.settlement.settle(queue=False)
            headers = state.request.headers
            if COST_REQUEST_HEADER in headers and wants_cost(headers):
                # (the headers are gone: an SSE comment before the end)
                tail = (": "
                        f"{COST_HEADER}={cost_usd_of(canonical, state.route.settings, accumulator)}"
                        "\n\n").encode() + tail
            await response.write_eof(tail)  # the last events and the chunked terminator in one send
            return response
        except _CLIENT_GONE:
            state.status = STATUS_CLIENT_CLOSED  # the upstream is closed by release() below
            return response
        except asyncio.CancelledError as exc:
            if exc.args != (DRAIN_DEADLINE,) or task is None:  # the client went away
                state.status = STATUS_CLIENT_CLOSED  # (handler cancellation)
                raise
            task.uncancel()  # the drain's deadline: the dialect's error event, not a cut
            accumulator.finish_reason = "error"
            state.error = _DRAINING[1:]
            try:
                await response.write_eof(encoder.error(*_DRAINING))
            except _CLIENT_GONE:
                state.status = STATUS_CLIENT_CLOSED
            return response
        finally:
            self._streaming.discard(task)
            await attempt.release()

    def _headers(self, response: web.StreamResponse, state: RequestState) -> None:
        """Every answer's headers; `x-aigw-debug: 1` asks for the routing decision too: matched
        blocks and scores per replica (for an admin caller: the scores show every replica's
        load)."""
        canonical = state.canonical
        stamp(response, canonical.request_id, state.replica, state.timing.overhead_ms(),
              state.show_overhead)
        headers = response.headers
        headers[SERVED_MODEL_HEADER] = canonical.model
        if state.debug:
            _explain_cache(response, state)
        if state.explain_route:
            headers["x-aigw-route"] = self.router.explain(canonical.request_id) or "no decision"
        trace_id = canonical.observer.trace_id
        if trace_id is not None:
            headers[TRACE_ID_HEADER] = trace_id

    async def _drain_events(self, attempt: Attempt, accumulator: Accumulator,
                            timing: Timing) -> None:
        events = attempt.events
        perf_counter = time.perf_counter
        idle_timeout_s = self.settings.idle_timeout_s
        async with WaitTimer(self._watchdog) as timer:
            while True:
                waited = perf_counter()
                timer.waiting(idle_timeout_s)
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    break
                finally:
                    timer.done_waiting()
                    timing.upstream_s += perf_counter() - waited
                accumulator.add(event)


def _explain_cache(response: web.StreamResponse, state: RequestState) -> None:
    """`x-aigw-debug: 1`: the prompt's tokens and how many hit the prefix cache (a stream: when
    its upstream announced them first, as our replicas do), and for a session where the prompt
    diverged from the previous turn's (docs/reference/api.md §4)."""
    usage = state.accumulator.usage or state.accumulator.prompt_usage or state.announced
    if usage is not None:
        response.headers["x-aigw-prompt-tokens"] = str(usage.prompt_tokens)
        response.headers["x-aigw-cache-hit-tokens"] = str(usage.cached_tokens)
    turn = state.turn
    if turn is not None:
        response.headers["x-aigw-cache-session-turn"] = str(turn.turn)
        divergence = turn.divergence
        if divergence is None:
            response.headers["x-aigw-cache-divergence"] = "none"
        else:
            response.headers["x-aigw-cache-divergence"] = divergence.where
            response.headers["x-aigw-cache-divergence-token"] = (
                str(divergence.token_index) if divergence.is_exact
                else f"~{divergence.token_index}")


def _delta_bytes(encoder: StreamEncoder, event: CanonicalEvent) -> bytes:
    return b"" if isinstance(event, FOLDED_EVENTS) else encoder.event(event)


def _after_start(exc: BaseException, settings: GatewaySettings) -> UpstreamError:
    if isinstance(exc, UpstreamError):
        return exc
    return UpstreamTimeout(f"the upstream sent nothing for {settings.idle_timeout_s:g}s")
