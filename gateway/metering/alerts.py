"""Budget alerts: a webhook POST, signed, once per budget window and threshold.

    alerts = BudgetAlerts(claim)         # claim(spend, threshold) -> True for the one sender
    alerts.observe(spends)               # after a settle; returns at once
    await alerts.close()                 # waits (bounded) for the deliveries under way

When a settle leaves a budget window's spend at or past `alert_at * usd`, the meter claims
(scope, window, threshold) in its store (Redis SET NX, SQLite INSERT OR IGNORE): only the
claim's winner, among every gateway on that store, sends. So each alert is sent once per
window; a delivery that still fails after `NUM_ATTEMPTS` is logged and not sent again.

The request: `POST webhook_url`, body JSON (`alert_body`), headers
    content-type: application/json
    x-aigw-event-id: <id>                       the same on every attempt
    x-aigw-signature: t=<unix s>,v1=<hex>       HMAC-SHA256(webhook_secret, "<t>.<raw body>")
A receiver recomputes v1 over the raw body and refuses a stale t (see docs/features.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from gateway.metering.limits import Spend
from gateway.metering.prices import NANOS_PER_USD

log = logging.getLogger("aigw.metering")

NUM_ATTEMPTS = 3
ATTEMPT_TIMEOUT_S = 5.0
MAX_PENDING_ALERTS = 1024  # deliveries queued at once (each ~1 KiB); past it the oldest is dropped
_NUM_REMEMBERED = 10_000  # claimed (scope, window, threshold) kept to skip repeat claims
SIGNATURE_HEADER = "x-aigw-signature"

Claim = Callable[[Spend, float], Awaitable[bool]]


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The x-aigw-signature header value for `body` sent at `timestamp`."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def verify_signature(secret: str, header: str, body: bytes, tolerance_s: float = 300.0,
                     now: float | None = None) -> bool:
    """A receiver's check: the header's v1 matches and its t is within `tolerance_s`."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = signature(secret, timestamp, body).split("v1=", 1)[1]
    return hmac.compare_digest(expected, parts.get("v1", ""))


def alert_body(spend: Spend, threshold: float, event_id: str) -> dict[str, Any]:
    scope = spend.scope
    return {
        "id": event_id, "type": "budget.threshold_reached", "created_at": time.time(),
        "project": scope.project, "scope": "project" if scope.is_project else "key",
        "key_id": scope.key_id, "threshold": threshold,
        "budget": spend.budget.model_dump(mode="json"),
        "budget_usd": spend.budget.usd, "spent_usd": spend.spent_nanos / NANOS_PER_USD,
        "window": {"key": spend.window.key, "start": spend.window.start_s,
                   "end": spend.window.end_s},
    }


class BudgetAlerts:
    def __init__(self, claim: Claim) -> None:
        self._claim = claim
        self._claimed: set[tuple[str, str, str, float]] = set()
        self._queue: list[tuple[Spend, float]] = []
        self._worker: asyncio.Task[None] | None = None
        self._transport: Any = None  # a LeanTransport of its own, made on the first alert

    def observe(self, spends: list[Spend]) -> None:
        for spend in spends:
            for threshold in spend.budget.alert_at:
                if spend.spent_nanos < threshold * spend.budget.nanos:
                    continue
                if spend.scope.limits.webhook_url is None:
                    continue
                marker = (*spend.scope.qualified_name, spend.window.key, threshold)
                if marker in self._claimed:
                    continue
                if len(self._claimed) >= _NUM_REMEMBERED:
                    self._claimed.clear()
                self._claimed.add(marker)
                if len(self._queue) >= MAX_PENDING_ALERTS:
                    dropped, _ = self._queue.pop(0)
                    log.warning("budget alert of %s dropped: %d alerts waiting",
                                dropped.scope.qualified_name, MAX_PENDING_ALERTS)
                self._queue.append((spend, threshold))
        if self._queue and (self._worker is None or self._worker.done()):
            self._worker = asyncio.get_running_loop().create_task(self._deliver_all())

    async def _deliver_all(self) -> None:
        while self._queue:
            spend, threshold = self._queue.pop(0)
            try:
                if await self._claim(spend, threshold):
                    await self._send(spend, threshold)
            except Exception:  # noqa: BLE001 - one alert must not stop the others
                log.exception("budget alert of %s failed", spend.scope.qualified_name)

    async def _send(self, spend: Spend, threshold: float) -> None:
        from gateway.request.errors import UpstreamError
        from gateway.upstream.lean_transport import LeanTransport
        from gateway.upstream.transport import UpstreamRequest

        limits = spend.scope.limits
        assert limits.webhook_url is not None and limits.webhook_secret is not None
        if self._transport is None:  # (the gateway's one HTTP client, gateway/upstream/)
            self._transport = LeanTransport()
        event_id = uuid.uuid4().hex
        body = orjson.dumps(alert_body(spend, threshold, event_id))
        for attempt in range(NUM_ATTEMPTS):
            headers = {"content-type": "application/json", "x-aigw-event-id": event_id,
                       SIGNATURE_HEADER: signature(limits.webhook_secret, int(time.time()), body)}
            try:
                async with asyncio.timeout(ATTEMPT_TIMEOUT_S):
                    response = await self._transport.send(UpstreamRequest(
                        "POST", str(limits.webhook_url), body, headers, ATTEMPT_TIMEOUT_S))
                    response.close()  # (the status is the answer; its body is not read)
                if response.status < 300:
                    return
                problem = f"HTTP {response.status}"
            except (UpstreamError, TimeoutError, OSError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if attempt + 1 < NUM_ATTEMPTS:
                await asyncio.sleep(0.5 * 2**attempt)
        log.warning("budget alert %s of %s not delivered after %d attempts: %s", event_id,
                    spend.scope.qualified_name, NUM_ATTEMPTS, problem)

    async def close(self) -> None:
        if self._worker is not None and not self._worker.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._worker), NUM_ATTEMPTS * 7)
            self._worker.cancel()
        if self._transport is not None:
            await self._transport.aclose()
