"""`aigw limits` writes the store a gateway reads its run-time limits from (each store kind)."""

from __future__ import annotations

import asyncio
import json

import pytest

from cli.main import main
from gateway.metering.budgets import Budget
from gateway.metering.limit_store import LimitScope, open_limit_store
from tests.auth.test_cli import cli_env  # noqa: F401 - the fixture


@pytest.fixture(params=["redis", "sqlite"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Redis and SQLite (the limit store's Redis Cluster case is in
    tests/gateway/metering/test_budgets.py)."""
    return str(request.param)


def _stored(scope: LimitScope) -> object:
    async def load() -> object:
        import os
        from pathlib import Path

        client = None
        if os.environ.get("AIGW_REDIS_URL"):
            from infra.redis_client import connect_redis

            client = connect_redis(os.environ["AIGW_REDIS_URL"], decode_responses=True)
        store = await open_limit_store(client, Path(os.environ["AIGW_DATA_DIR"]))
        try:
            return (await store.load()).get(scope)
        finally:
            await store.close()
            if client is not None:
                await client.aclose()

    return asyncio.run(load())


@pytest.mark.usefixtures("cli_env")
def test_limits_set_get_list_delete_for_a_project_and_a_key(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["projects", "create", "acme"]) == 0
    assert main(["keys", "create", "--project", "acme", "--scope", "ai_gateway:invoke"]) == 0
    capsys.readouterr()
    assert main(["keys", "list", "--project", "acme"]) == 0
    key_id = json.loads(capsys.readouterr().out)["key_id"]
    assert main(["limits", "set", "--project", "acme", "--rpm", "60", "--concurrency", "4",
                 "--budget", "10/day", "--budget", "2.5/3600s", "--alert-at", "0.8",
                 "--webhook-url", "https://ops.example/hook",
                 "--webhook-secret", "0123456789abcdef"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["stored"]["webhook_secret_set"] and "webhook_secret" not in printed["stored"]
    stored = _stored(LimitScope("acme"))
    assert stored is not None and stored.max_concurrent_requests == 4  # type: ignore[attr-defined]
    assert stored.budgets[1] == Budget(usd=2.5, window="custom", window_s=3600,  # type: ignore[attr-defined]
                                       alert_at=(0.8,))
    assert main(["limits", "set", "--key", key_id, "--json", '{"tokens_per_minute": 900}']) == 0
    assert main(["limits", "list"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    assert [(line["project"], line["key_id"]) for line in lines[-2:]] == [("acme", None),
                                                                         ("acme", key_id)]
    assert main(["limits", "set", "--project", "acme", "--budget", "1/day",
                 "--alert-at", "0.5"]) == 0  # stored, but an alert would go nowhere: said so
    assert "no --webhook-url" in capsys.readouterr().err
    for bad in (["--budget", "1/week"], ["--rpm", "0"], ["--alert-at", "0.5"],
                ["--json", "[1]"], ["--webhook-url", "https://x.example/"]):
        assert main(["limits", "set", "--project", "acme", *bad]) == 1, bad
        assert "aigw:" in capsys.readouterr().err
    assert main(["limits", "get", "--project", "nope"]) == 1
    assert main(["limits", "delete", "--project", "acme"]) == 0
    assert _stored(LimitScope("acme")) is None
    assert _stored(LimitScope("acme", key_id=key_id)) is not None
