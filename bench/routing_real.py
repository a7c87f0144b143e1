"""Real replicas for `aigw bench routing`: cost calibration and short policy runs behind the
gateway.

    calibrate(args) -> (prefill_s_per_token, decode_s_per_token)   one replica, ~1 minute
    run_real(args)  -> rows                                          N replicas, one gateway per
                                                                     policy

Each policy gets a fresh gateway over the same replicas, whose prefix caches are reset
(POST /kv/reset) before each (workload, policy) run. Imbalance here is max/mean of the requests
each replica served. The prompts are real text (bench/workloads.py's corpus).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
import xxhash
from aiohttp import web

from bench.plotting import percentile
from gateway.fleet import embedded
from gateway.fleet.endpoints import Endpoint
from gateway.request.canonical import CanonicalRequest
from gateway.routing.base import Decision, LeastOutstandingRouter, Router
from infra import ports

REAL_POLICIES = ("round-robin", "least-load", "session-hash", "prefix")


class RoundRobinRouter(Router):
    def __init__(self) -> None:
        self._next = itertools.count()

    def pick(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        ordered = sorted(endpoints, key=lambda e: e.url)
        return Decision(ordered[next(self._next) % len(ordered)], "round_robin")


class SessionHashRouter(Router):
    """Consistent choice per conversation: a hash of its first two messages (system + first
    user)."""

    def pick(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        key = "".join(m.content for m in request.messages[:2]) or request.prompt
        ordered = sorted(endpoints, key=lambda e: e.url)
        return Decision(ordered[xxhash.xxh3_64_intdigest(key.encode()) % len(ordered)],
                        "session_hash")


def make_router(policy: str) -> Router:
    if policy == "round-robin":
        return RoundRobinRouter()
    if policy == "session-hash":
        return SessionHashRouter()
    if policy == "prefix":
        from gateway.routing.prefix_router import PrefixRouter

        return PrefixRouter()
    return LeastOutstandingRouter()


def _start(args: argparse.Namespace, num_replicas: int) -> list[embedded.ReplicaProcess]:
    import subprocess
    import sys

    replicas = []
    for _ in range(num_replicas):
        port = ports.free_port()
        command = [sys.executable, "-m", "cli.main", "replica", "--port", str(port), "--threads",
                   "1",
                   "--kv-cache-memory", str(args.kv_cache_memory), "--no-auth"]  # loopback bench
        replicas.append(embedded.ReplicaProcess(
            subprocess.Popen(command, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}"))
    embedded.wait_healthy(replicas, timeout_s=180)
    return replicas


def _texts(seed: int) -> Any:
    from bench.workloads import TokenSource
    from engine.loader import default_model_path, load_tokenizer

    return TokenSource(load_tokenizer(default_model_path()), seed)


def calibrate(args: argparse.Namespace) -> tuple[float, float]:
    replicas = _start(args, 1)
    source = _texts(args.seed + 1)
    try:
        model = embedded.model_settings_for(replicas).name
        with httpx.Client(base_url=replicas[0].url, timeout=120) as client:
            prefill = []
            for _ in range(3):
                started = time.perf_counter()
                body = client.post("/v1/completions", json={"model": model,
                                                            "prompt": source.text(600),
                                                             "max_tokens": 1}).json()
                prefill.append((time.perf_counter() - started) / body["usage"]["prompt_tokens"])

            async def decode() -> float:
                async with httpx.AsyncClient(base_url=replicas[0].url, timeout=120) as aclient:
                    started = time.perf_counter()
                    bodies = await asyncio.gather(*(aclient.post("/v1/completions", json={
                        "model": model, "prompt": f"Count to {i}:", "max_tokens": 48,
                        "ignore_eos": True}) for i in range(8)))
                    num_tokens = sum(b.json()["usage"]["completion_tokens"] for b in bodies)
                    return (time.perf_counter() - started) / max(1, num_tokens)
            return min(prefill), asyncio.run(decode())
    finally:
        embedded.stop_replicas(replicas)


def conversations(workload: str, seed: int) -> list[list[list[dict[str, str]]]]:
    """Each conversation is a list of turns (message lists) sent one after the other."""
    source, rng = _texts(seed), random.Random(seed)
    if workload == "agent":
        system = source.text(300)
        convs = []
        for _ in range(4):
            messages, turns = [{"role": "system", "content": system}], []
            for turn in range(3):
                messages = [*messages,
                            {"role": "user", "content": source.text(rng.randint(40, 80))}]
                turns.append(messages)
                messages = [*messages, {"role": "assistant", "content": f"Step {turn} done."}]
            convs.append(turns)
        return convs
    if workload == "shared-prefix":
        systems = [source.text(250) for _ in range(6)]
        convs = [[[{"role": "system", "content": s}, {"role": "user", "content": source.text(30)}]]
                 for s in systems for _ in range(3)]
        rng.shuffle(convs)
        return convs
    return [[[{"role": "user", "content": source.text(280)}]] for _ in range(12)]


async def _chat(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> dict[str, Any]:
    started = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json={
            "model": "m", "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        replica = response.headers.get("x-aigw-replica", "none")
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    return {"replica": replica, "ttft_s": first or time.perf_counter() - started,
            "prompt": usage.get("prompt_tokens", 0),
            "completion": usage.get("completion_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def _run_policy(policy: str, replicas: list[embedded.ReplicaProcess], workload: str,
                      args: argparse.Namespace) -> dict[str, Any]:
    from gateway.settings import GatewaySettings
    from gateway.web.app import create_app

    served = embedded.model_settings_for(replicas)
    model = served.model_copy(update={"name": "m", "upstream_model": served.name})
    settings = GatewaySettings(auth_enabled=False, models=[model], health_interval_s=0.5)
    app = create_app(settings, router=make_router(policy))
    async with httpx.AsyncClient(timeout=120) as admin:
        for replica in replicas:
            await admin.post(replica.url + "/kv/reset")
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", ports.free_port())
    await site.start()
    url = site.name
    await asyncio.sleep(1.0)  # consumers sync from the (empty) snapshots
    results: list[dict[str, Any]] = []
    gate = asyncio.Semaphore(args.concurrency)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            async def converse(turns: list[list[dict[str, str]]]) -> None:
                async with gate:
                    for messages in turns:
                        results.append(await _chat(client, messages))
            started = time.perf_counter()
            await asyncio.gather(*(converse(c) for c in conversations(workload, args.seed)))
            wall_s = time.perf_counter() - started
    finally:
        await runner.cleanup()
    per_replica = Counter(r["replica"] for r in results)
    counts = [per_replica.get(r.url.split("://", 1)[1], 0) for r in replicas]
    ttfts = [r["ttft_s"] for r in results]
    return {"mode": "real", "workload": workload, "load": float(args.concurrency), "policy": policy,
            "hit_ratio": sum(r["cached"] for r in results) / max(1,
                                                                 sum(r["prompt"] for r in results)),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "output_tok_s": sum(r["completion"] for r in results) / wall_s,
            "imbalance": max(counts) / max(1e-9, statistics.mean(counts))}


def run_real(args: argparse.Namespace) -> list[dict[str, Any]]:
    replicas = _start(args, args.real_replicas)
    try:
        return [asyncio.run(_run_policy(policy, replicas, workload, args))
                for workload in args.workloads.split(",") for policy in REAL_POLICIES]
    finally:
        embedded.stop_replicas(replicas)
