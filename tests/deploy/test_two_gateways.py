"""Two gateways, one Redis: two `aigw serve` processes share a redis-server and two replicas.

One module-scoped setup (a fresh redis-server, two CPU replicas of the bundled model publishing
their KV events to it, two gateways with auth on, the prefix router and a tokens-per-minute
limit on project `limited`, each with its own data_dir so nothing is shared but Redis). The
tests show that keys, revocations, limits, usage and prefix routing are one state across both.
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from auth import Scope
from auth.settings import AuthSettings
from infra.ports import free_port
from tests.auth._admin_key import make_admin_key
from tests.deploy.test_neon_example import _clean_env, _process, _wait_healthy
from tests.redis_server import running_redis_server

pytestmark = pytest.mark.slow

TPM_LIMIT = 300  # tokens per minute of project `limited`, both gateways together
REPLICA_SECRET = "two-gateways-replica-secret"
MAX_TOKENS = 4
USD_PER_TOKEN = 0.0001  # what the gateways charge a token, cached or not: ~0.004 USD a request


@dataclass(frozen=True)
class Deployment:
    gateways: tuple[str, str]  # base URLs of gateway A and gateway B
    model: str
    admin_key: str  # ai_gateway:admin on project `ops`, made before the gateways started
    replicas: tuple[str, ...] = ()  # the replicas' base URLs


def _replica_cmd(port: int, redis_url: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", "replica", "--host", "127.0.0.1",
            "--port", str(port), "--threads", "1", "--kv-cache-memory", "67108864",
            "--redis-url", redis_url]


def _model_id(replica_url: str) -> str:
    import json

    request = urllib.request.Request(replica_url + "/v1/models",
                                     headers={"Authorization": f"Bearer {REPLICA_SECRET}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return str(json.loads(response.read())["data"][0]["id"])


def _config(path: Path, redis_url: str, model: str, replicas: list[str]) -> Path:
    endpoints = ", ".join(f'"{url}"' for url in replicas)
    path.write_text(
        f'redis_url = "{redis_url}"\ndata_dir = "{path.parent / "data"}"\nauth_enabled = true\n'
        f'router = "prefix"\nhealth_interval_s = 0.5\n'
        f'[project_limits.limited]\ntokens_per_minute = {TPM_LIMIT}\n'
        f'[[models]]\nname = "{model}"\nbackend = "replica"\nendpoints = [{endpoints}]\n'
        f'prices = {{ input_per_token = {USD_PER_TOKEN}, cached_input_per_token = {USD_PER_TOKEN}, '
        f'output_per_token = {USD_PER_TOKEN} }}\n')
    return path


@contextmanager
def _deployment(tmp: Path) -> Iterator[Deployment]:
    # the replicas require it; both gateways read it (AIGW_REPLICA_SECRET) and present it
    env = {**_clean_env(), "AIGW_REPLICA_SECRET": REPLICA_SECRET}
    with running_redis_server() as redis_url, ExitStack() as stack:
        replica_urls, replicas = [], []
        for i in range(2):
            port = free_port()
            replica_urls.append(f"http://127.0.0.1:{port}")
            replicas.append(stack.enter_context(
                _process(_replica_cmd(port, redis_url), tmp / f"replica{i}.log", env)))
        admin_key = asyncio.run(make_admin_key(AuthSettings(redis_url=redis_url,
                                                             data_dir=tmp / "cli")))
        for i, (url, process) in enumerate(zip(replica_urls, replicas, strict=True)):
            _wait_healthy(url, process, tmp / f"replica{i}.log", timeout_s=180)
        model = _model_id(replica_urls[0])
        gateway_urls = []
        for name in ("a", "b"):
            (tmp / name).mkdir()
            config = _config(tmp / name / "gateway.toml", redis_url, model, replica_urls)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = tmp / f"gateway-{name}.log"
            process = stack.enter_context(_process(
                [sys.executable, "-m", "cli.main", "serve", "--config", str(config),
                 "--host", "127.0.0.1", "--port", str(port)], log, env))
            _wait_healthy(url, process, log, timeout_s=60)
            gateway_urls.append(url)
        yield Deployment((gateway_urls[0], gateway_urls[1]), model, admin_key, tuple(replica_urls))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with _deployment(tmp_path_factory.mktemp("two-gateways")) as deployed:
        yield deployed


@pytest.fixture(scope="module")
def clients(deployment: Deployment) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    a, b = (httpx.Client(base_url=url, timeout=120) for url in deployment.gateways)
    yield a, b
    a.close()
    b.close()


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _create_key(client: httpx.Client, admin_key: str, project: str,
                scopes: list[str]) -> dict[str, Any]:
    status = client.post("/admin/v1/projects", headers=_bearer(admin_key),
                         json={"name": project}).status_code
    assert status in (201, 409)  # 409: another test of this module made it
    response = client.post(f"/admin/v1/projects/{project}/keys", headers=_bearer(admin_key),
                           json={"scopes": scopes, "name": "test"})
    assert response.status_code == 201, response.text
    return dict(response.json())


def _chat(client: httpx.Client, key: str, model: str,
          messages: list[dict[str, str]]) -> httpx.Response:
    return client.post("/v1/chat/completions", headers=_bearer(key), json={
        "model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})


def test_a_key_made_on_one_gateway_works_on_the_other_and_its_revocation_too(
        deployment: Deployment, clients: tuple[httpx.Client, httpx.Client]) -> None:
    a, b = clients
    created = _create_key(a, deployment.admin_key, "acme", [Scope.INVOKE.value])
    assert b.get("/v1/models", headers=_bearer(created["key"])).status_code == 200
    assert a.get("/v1/models", headers=_bearer(created["key"])).status_code == 200  # now cached
    revoked = b.post(f"/admin/v1/keys/{created['key_id']}/revoke",
                     headers=_bearer(deployment.admin_key))
    assert revoked.status_code == 200, revoked.text
    started = time.monotonic()
    while (status := a.get("/v1/models", headers=_bearer(created["key"])).status_code) == 200:
        assert time.monotonic() - started < 3.0, "gateway A still accepts the revoked key"
        time.sleep(0.02)
    assert status == 401 and time.monotonic() - started <= 1.0


def _wait_for_a_fresh_minute(min_left_s: float = 40.0) -> None:
    """The limit is per fixed UTC minute: start with enough of one left to reach the limit."""
    left = 60.0 - time.time() % 60.0
    if left < min_left_s:
        time.sleep(left + 0.1)


def _fill_one_minute(clients: tuple[httpx.Client, httpx.Client], key: str, model: str
                     ) -> tuple[list[dict[str, int]], int, list[dict[str, str]], bool]:
    """Requests alternating the gateways until one is refused: (the admitted usages, the index
    of the refusing gateway, the refused messages, whether all of it fell in one minute)."""
    _wait_for_a_fresh_minute()
    window = int(time.time() // 60)
    admitted: list[dict[str, int]] = []
    run = f"{time.monotonic_ns():x}"
    for i in range(30):
        # a system message of its own first: no prompt block is cached from an earlier request
        # (cached prompt tokens do not count against tokens per minute)
        messages = [{"role": "system", "content": f"Request {i} of run {run}."},
                    {"role": "user", "content": f"Count to {i}, slowly, please."}]
        response = _chat(clients[i % 2], key, model, messages)
        if response.status_code == 429:
            return admitted, i % 2, messages, int(time.time() // 60) == window
        assert response.status_code == 200, response.text
        admitted.append(response.json()["usage"])
    raise AssertionError("30 requests never reached the limit")


def test_the_tpm_limit_holds_across_both_gateways_and_usage_is_one_sum(
        deployment: Deployment, clients: tuple[httpx.Client, httpx.Client]) -> None:
    """The limit is per fixed minute: a run that crossed one (requests take 1-5 s each on a
    loaded 2-core machine) was admitted by two windows' counters, ~520 tokens against 300, as
    the rule allows; such a run is redone from the next minute's start."""
    key = _create_key(clients[0], deployment.admin_key, "limited",
                      [Scope.INVOKE.value, Scope.USAGE_READ.value])["key"]
    everything: list[dict[str, int]] = []  # every admitted request's usage, all runs
    for _ in range(3):
        admitted, refused_by, refused, in_one_minute = _fill_one_minute(
            clients, key, deployment.model)
        everything += admitted
        if in_one_minute:
            break
    assert in_one_minute, "three runs each crossed a minute"
    assert len(admitted) >= 2  # both gateways admitted some before one refused
    # tokens per minute count what the replicas computed: cached prompt tokens are free
    totals = [u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
              + u["completion_tokens"] for u in admitted]
    assert sum(totals) <= TPM_LIMIT + max(totals)
    # The other gateway refuses the same request: the counters are the shared ones. (A smaller
    # one may still fit what is left of the limit, as the rule says.)
    other = clients[1 - refused_by]
    assert _chat(other, key, deployment.model, refused).status_code == 429

    expected = {"requests": len(everything),
                "prompt_tokens": sum(u["prompt_tokens"] for u in everything),
                "completion_tokens": sum(u["completion_tokens"] for u in everything)}
    deadline = time.monotonic() + 10
    while True:  # settlement follows the response: poll, bounded
        rows = clients[0].get("/admin/v1/projects/limited/usage",
                              headers=_bearer(key)).json()["data"]
        seen = {name: sum(int(r[name]) for r in rows) for name in expected}
        if seen == expected or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert seen == expected


def test_turns_sent_alternately_to_both_gateways_stay_on_one_replica_and_hit_its_cache(
        deployment: Deployment, clients: tuple[httpx.Client, httpx.Client]) -> None:
    # (an operator's key: only the admin scope reads x-aigw-replica, the serving host:port)
    key = _create_key(clients[1], deployment.admin_key, "acme",
                      [Scope.INVOKE.value, Scope.ADMIN.value])["key"]
    system = {"role": "system", "content": "You are an assistant for beekeeping. " * 12}
    messages: list[dict[str, str]] = [system]
    replicas, cached = [], []
    for turn in range(4):
        messages = [*messages, {"role": "user", "content": f"Question {turn} about bees?"}]
        response = _chat(clients[turn % 2], key, deployment.model, messages)
        assert response.status_code == 200, response.text
        replicas.append(response.headers["x-aigw-replica"])
        usage = response.json()["usage"]
        cached.append(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
        messages = [*messages, {"role": "assistant", "content": f"Answer {turn}."}]
    assert len(set(replicas)) == 1, replicas
    assert all(c > 0 for c in cached[1:]), cached


def test_the_replicas_serve_only_the_gateways_credential_and_their_events_hold_no_tokens(
        deployment: Deployment, clients: tuple[httpx.Client, httpx.Client]) -> None:
    key = _create_key(clients[0], deployment.admin_key, "acme", [Scope.INVOKE.value])["key"]
    secret_prompt = "The launch code is 7-alpha-9. " * 12  # several full KV blocks
    assert _chat(clients[0], key, deployment.model,
                 [{"role": "system", "content": secret_prompt},
                  {"role": "user", "content": "hi"}]).status_code == 200  # credential sent
    for url in deployment.replicas:
        for method, path in (("GET", "/kv/events?since=0"), ("GET", "/kv/snapshot"),
                             ("POST", "/kv/reset"), ("GET", "/v1/models"),
                             ("POST", "/v1/chat/completions")):
            for headers in ({}, {"authorization": "Bearer wrong"}):
                response = httpx.request(method, url + path, headers=headers, json={})
                assert response.status_code == 401, (url, path, response.text)
                assert response.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + "/health").status_code == 200  # probes stay open
    pages = [httpx.get(url + "/kv/events?since=0", headers=_bearer(REPLICA_SECRET)).json()
             for url in deployment.replicas]
    stored = [e for page in pages for b in page["batches"] for e in b["events"]
              if e["type"] == "BlockStored"]
    assert stored and all(e["token_ids"] == [] and e["block_hashes"] for e in stored)


def _usage(client: httpx.Client, admin_key: str, project: str,
           group_by: str) -> list[dict[str, Any]]:
    response = client.get(f"/admin/v1/projects/{project}/usage", headers=_bearer(admin_key),
                          params={"group_by": group_by})
    assert response.status_code == 200, response.text
    return list(response.json()["data"])


def _request_cost(response: httpx.Response) -> float:
    usage = response.json()["usage"]
    return USD_PER_TOKEN * (usage["prompt_tokens"] + usage["completion_tokens"])


def test_a_budget_set_through_the_api_stops_the_project_within_one_request_on_both(
        deployment: Deployment, clients: tuple[httpx.Client, httpx.Client]) -> None:
    """Set on gateway A, in force on B within a second; requests alternating the gateways are
    admitted until the budget is spent, passing it by at most the one request in flight."""
    a, b = clients
    key = _create_key(a, deployment.admin_key, "budgeted", [Scope.INVOKE.value])["key"]
    messages = [{"role": "user", "content": "Say hi."}]
    first = _chat(b, key, deployment.model, messages)
    assert first.status_code == 200, first.text
    spent = _request_cost(first)
    budget = round(spent + 0.012, 6)  # what is left: ~3 more requests
    put = a.put("/admin/v1/projects/budgeted/limits", headers=_bearer(deployment.admin_key),
                json={"budgets": [{"usd": budget, "window": "month"}]})
    assert put.status_code == 200, put.text
    assert _applied_within(b, deployment.admin_key, budget) <= 1.0
    costs: list[float] = []
    for i in range(12):
        response = _chat(clients[(i + 1) % 2], key, deployment.model, messages)
        if response.status_code == 429:
            break
        assert response.status_code == 200, response.text
        costs.append(_request_cost(response))
    assert response.status_code == 429, "twelve requests never reached the budget"
    assert "monthly budget of this project is spent" in response.json()["error"]["message"]
    assert costs, "the budget refused the first request after it was set"
    assert spent + sum(costs) <= budget + max(costs) + 1e-9
    for client in (a, b):  # both refuse now
        assert _chat(client, key, deployment.model, messages).status_code == 429
    # a change made on B is in force on A within a second
    raised = b.put("/admin/v1/projects/budgeted/limits", headers=_bearer(deployment.admin_key),
                   json={"budgets": [{"usd": budget * 100, "window": "month"}]})
    assert raised.status_code == 200, raised.text
    assert _applied_within(a, deployment.admin_key, budget * 100) <= 1.0
    assert _chat(a, key, deployment.model, messages).status_code == 200


def _applied_within(client: httpx.Client, admin_key: str, budget_usd: float) -> float:
    """Seconds until `client`'s gateway applies a month budget of `budget_usd` to `budgeted`
    (GET .../limits shows what that instance applies, not what the store holds)."""
    started = time.monotonic()
    while True:
        view = client.get("/admin/v1/projects/budgeted/limits", headers=_bearer(admin_key)).json()
        budgets = view["effective"]["budgets"]
        if budgets and budgets[0]["usd"] == budget_usd:
            return time.monotonic() - started
        assert time.monotonic() - started < 3.0, f"not applied after 3 s: {view}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def webhook_receiver() -> Iterator[tuple[str, list[tuple[dict[str, str], bytes]]]]:
    """A local aiohttp receiver: (its URL, the (headers, body) of every POST it got)."""
    from aiohttp import web

    from tests.gateway.conftest import LoopThread, start_app

    received: list[tuple[dict[str, str], bytes]] = []

    async def receive(request: web.Request) -> web.Response:
        received.append(({k.lower(): v for k, v in request.headers.items()}, await request.read()))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", receive)
    loop_thread = LoopThread()
    runner, url = loop_thread.run(start_app(app))
    try:
        yield url + "/hook", received
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.close()


def test_a_soft_threshold_fires_one_signed_webhook_and_usage_by_tag_sums_to_the_ledger(
        deployment: Deployment, clients: tuple[httpx.Client, httpx.Client],
        webhook_receiver: tuple[str, list[tuple[dict[str, str], bytes]]]) -> None:
    """Every request passes the threshold, on both gateways: the alert is claimed in Redis and
    sent once for the window, signed; each request carries one tag, so the rows by tag sum to
    the project's ledger."""
    import json

    from gateway.metering.alerts import SIGNATURE_HEADER, verify_signature

    hook_url, received = webhook_receiver
    secret = "two-gateways-webhook-secret"
    a, _ = clients
    key = _create_key(a, deployment.admin_key, "alerted", [Scope.INVOKE.value])["key"]
    put = a.put("/admin/v1/projects/alerted/limits", headers=_bearer(deployment.admin_key), json={
        "budgets": [{"usd": 100.0, "window": "custom", "window_s": 86_400, "alert_at": [0.00001]}],
        "webhook_url": hook_url, "webhook_secret": secret})
    assert put.status_code == 200, put.text
    time.sleep(1.0)  # B has the limits too
    tags = ["team:search", "team:ads", "team:search", "team:ads"]
    for i, tag in enumerate(tags):
        response = clients[i % 2].post(
            "/v1/chat/completions", headers={**_bearer(key), "x-aigw-tags": tag},
            json={"model": deployment.model, "max_tokens": MAX_TOKENS,
                  "messages": [{"role": "user", "content": f"Name colour {i}."}]})
        assert response.status_code == 200, response.text
    deadline = time.monotonic() + 5.0
    while not received and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # and no second one comes
    assert len(received) == 1, [body for _, body in received]
    headers, body = received[0]
    assert verify_signature(secret, headers[SIGNATURE_HEADER], body)
    assert not verify_signature("another-secret", headers[SIGNATURE_HEADER], body)
    alert = json.loads(body)
    assert alert["project"] == "alerted" and alert["threshold"] == 0.00001
    assert (alert["spent_usd"] >= 0.001
            and alert["window"]["end"] - alert["window"]["start"] == 86_400)

    ledger = _usage(a, deployment.admin_key, "alerted", "")
    by_tag = _usage(clients[1], deployment.admin_key, "alerted", "tag")
    assert ledger[0]["requests"] == 4
    assert {row["tag"]: row["requests"] for row in by_tag} == {"team:ads": 2, "team:search": 2}
    for metric in ("requests", "prompt_tokens", "completion_tokens", "total_tokens", "cost_usd"):
        assert abs(sum(row[metric] for row in by_tag) - ledger[0][metric]) < 1e-9, metric
