"""Budget alerts (gateway/metering/alerts.py): the signature a receiver checks, and delivery to a
real aiohttp receiver: retried with the same event id after a failure, sent once per claim, and
never for a threshold the spend has not reached."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from gateway.metering.alerts import SIGNATURE_HEADER, BudgetAlerts, signature, verify_signature
from gateway.metering.budgets import Budget
from gateway.metering.limits import ScopeLimits, Spend
from gateway.metering.settings import Limits
from tests.gateway.conftest import start_app

SECRET = "an-alert-secret-of-length"


def test_a_signature_verifies_only_with_its_secret_body_and_a_fresh_timestamp() -> None:
    body = b'{"a": 1}'
    now = int(time.time())
    header = signature(SECRET, now, body)
    assert verify_signature(SECRET, header, body)
    assert not verify_signature(SECRET + "x", header, body)
    assert not verify_signature(SECRET, header, body + b" ")
    assert not verify_signature(SECRET, signature(SECRET, now - 3600, body), body)
    assert not verify_signature(SECRET, "v1=abc", body) and not verify_signature(SECRET, "", body)


def test_an_alert_is_retried_after_a_failure_and_sent_once_per_claim() -> None:
    async def scenario() -> None:
        received: list[tuple[str, bytes, str]] = []

        async def receive(request: web.Request) -> web.Response:
            body = await request.read()
            received.append((request.headers["x-aigw-event-id"], body,
                             request.headers[SIGNATURE_HEADER]))
            return web.Response(status=500 if len(received) == 1 else 204)

        app = web.Application()
        app.router.add_post("/hook", receive)
        runner, url = await start_app(app)
        limits = Limits(budgets=(Budget(usd=1.0, window="day", alert_at=(0.5, 0.9)),),
                        webhook_url=url + "/hook", webhook_secret=SECRET)
        scope = ScopeLimits("acme", "proj", limits)
        budget = scope.budgets[0]
        window = budget.window_at(time.time())
        claims: list[float] = []

        async def claim(spend: Spend, threshold: float) -> bool:
            claims.append(threshold)
            return len(claims) == 1  # another gateway claims any later one

        alerts = BudgetAlerts(claim)
        try:
            alerts.observe([Spend(scope, budget, window, 600_000_000)])  # 0.6 USD: 0.5 only
            alerts.observe([Spend(scope, budget, window, 700_000_000)])  # already claimed here
            await alerts.close()
        finally:
            await runner.cleanup()
        assert claims == [0.5]
        assert len(received) == 2 and received[0][0] == received[1][0]  # one event, retried
        body = json.loads(received[1][1])
        assert body["threshold"] == 0.5 and body["spent_usd"] == 0.6
        assert verify_signature(SECRET, received[1][2], received[1][1])

    asyncio.run(scenario())
