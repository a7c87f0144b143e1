"""Admission prices the cache: under a tokens-per-minute limit a request reserves only the prompt
tokens the router expects NOT to find cached (plus max_tokens), and the settle charges the real
uncached prompt and completion tokens exactly; cached prompt tokens never count against the limit.

Eight concurrent agent turns of ~600 prompt tokens, ~97% cached, under a 3,000 tokens-a-minute
limit: all admitted when the cache is priced; with no estimate (the same gateway, the router
knowing nothing cached) their full reservations pass the limit and some get a 429."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from engine.loader import default_model_path
from gateway.fleet.endpoints import Endpoint
from gateway.metering import Limits, MeteringSettings, open_meter
from gateway.request.canonical import CanonicalRequest
from gateway.routing.base import LeastOutstandingRouter
from gateway.routing.prompt_hashing import shared_prompt_hasher
from gateway.settings import GatewaySettings
from gateway.web.app import create_app
from tests.gateway.conftest import MODEL, LoopThread, chat_upstream_app, start_app
from tests.gateway.test_auth_seam import KeyAuthenticator

TOKENS_PER_MINUTE = 3_000
MAX_TOKENS = 8
SYSTEM = "You are a build agent. Run the tools, read their output, fix the code. " * 40
BLOCK_SIZE = 16


def cached_part(num_prompt: int) -> int:
    """What a replica finds cached of a prompt whose every earlier block is cached."""
    return (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE


def _cached_replica(served: list[dict[str, int]]) -> web.Application:
    """Chat answers with the default model's exact prompt count, all full blocks but the last
    reported cached; each usage is kept in `served`."""
    hasher = shared_prompt_hasher(str(default_model_path()), 1 << 20)

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(0.5)  # the eight turns are in flight together
        num_prompt = len(hasher.token_ids(body))
        usage = {"prompt_tokens": num_prompt, "completion_tokens": MAX_TOKENS,
                 "total_tokens": num_prompt + MAX_TOKENS,
                 "prompt_tokens_details": {"cached_tokens": cached_part(num_prompt)}}
        served.append(usage)
        return web.json_response({
            "id": "c", "object": "chat.completion", "created": 0, "model": MODEL, "usage": usage,
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": "ok " * MAX_TOKENS}}]})

    return chat_upstream_app(chat, [{"id": MODEL, "object": "model", "max_model_len": 8192}])


class _KnowsTheCache(LeastOutstandingRouter):
    """The prefix router's estimate as a replica holding every earlier turn would give it
    (tests/gateway/routing/test_expected_cached_tokens.py checks the real one against its index)."""

    def __init__(self, prices_cache: bool) -> None:
        self.prices_cache = prices_cache
        self.estimates: list[int] = []

    async def expected_cached_tokens(self, request: CanonicalRequest,
                                     endpoints: Sequence[Endpoint]) -> int:
        assert request.rendered_prompt is not None  # rendered at admission: a token limit applies
        estimate = cached_part(len(request.rendered_prompt[1])) if self.prices_cache else 0
        self.estimates.append(estimate)
        return estimate


def _run_turns(loop_thread: LoopThread, tmp_path: Path, prices_cache: bool
               ) -> tuple[list[int], list[dict[str, int]], _KnowsTheCache, Any]:
    served: list[dict[str, int]] = []
    upstream, upstream_url = loop_thread.run(start_app(_cached_replica(served)))
    meter = loop_thread.run(open_meter(MeteringSettings(default_project_limits=Limits(
        tokens_per_minute=TOKENS_PER_MINUTE)), redis=None, data_dir=tmp_path / str(prices_cache)))
    router = _KnowsTheCache(prices_cache)
    settings = GatewaySettings(models=[{"name": MODEL, "endpoints": [upstream_url]}],
                               data_dir=tmp_path)
    runner, url = loop_thread.run(start_app(create_app(
        settings, authenticator=KeyAuthenticator(), meter=meter, router=router)))  # type: ignore[arg-type]
    statuses: list[int] = []
    lock = threading.Lock()

    def turn(i: int) -> None:
        answer = httpx.post(url + "/v1/chat/completions", headers={"x-api-key": "good"}, timeout=30,
                            json={"model": MODEL, "max_tokens": MAX_TOKENS, "messages": [
                                {"role": "system", "content": SYSTEM},
                                {"role": "user", "content": f"step {i}: run the tests"}]})
        with lock:
            statuses.append(answer.status_code)

    try:
        threads = [threading.Thread(target=turn, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        final = httpx.post(url + "/v1/chat/completions", headers={"x-api-key": "good"}, timeout=30,
                           json={"model": MODEL, "max_tokens": MAX_TOKENS, "messages": [
                               {"role": "system", "content": SYSTEM},
                               {"role": "user", "content": "step 9: report"}]})
    finally:
        loop_thread.run(runner.cleanup())
        loop_thread.run(upstream.cleanup())
        loop_thread.run(meter.close())
    return statuses, served, router, final


def test_agent_turns_with_high_hit_ratios_are_admitted_and_charged_their_uncached_tokens(
        loop_thread: LoopThread, tmp_path: Path) -> None:
    if time.time() % 60 > 52:  # the counters are per minute window: start in a fresh one
        time.sleep(60.5 - time.time() % 60)
    statuses, served, router, final = _run_turns(loop_thread, tmp_path, prices_cache=True)
    assert statuses == [200] * 8 and final.status_code == 200
    num_prompt = served[0]["prompt_tokens"]
    assert num_prompt > 500 and cached_part(num_prompt) / num_prompt > 0.95
    # the limit counts exactly what was computed: each settled turn's uncached prompt and its
    # completion, then the final turn's reservation (its expected uncached prompt + max_tokens)
    charged = sum(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
                  + u["completion_tokens"] for u in served[:8])
    reserved = served[8]["prompt_tokens"] - router.estimates[-1]
    assert reserved < 32
    remaining = int(final.headers["x-ratelimit-remaining-tokens"])
    assert remaining == TOKENS_PER_MINUTE - charged - (reserved + MAX_TOKENS)


def test_without_an_estimate_the_same_turns_reserve_their_whole_prompts_and_some_are_refused(
        loop_thread: LoopThread, tmp_path: Path) -> None:
    statuses, _, _, _ = _run_turns(loop_thread, tmp_path, prices_cache=False)
    assert 429 in statuses and 200 in statuses  # 8 x ~620 reserved > 3,000
