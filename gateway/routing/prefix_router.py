"""Prefix-aware routing: send a request to the replica that already holds its prefix, within load.

    router = PrefixRouter(PrefixRouterConfig(redis_url=...))
    await router.start(fleet)            # one KV event consumer per replica endpoint
    decision = await router.choose(request, candidates)
    await router.close()

`choose`: hash the request's blocks as the replica will (prompt_hashing.py, off the event loop
for long prompts), look up the longest run each candidate holds (one index round trip), score
(scoring.py), then record the chosen replica as holding the request's blocks for
`tentative_ttl_s` (events arrive later). Falls back to least load when the route is not served
by our replicas, no consumer has synced yet, or the prompt has no full block. Session affinity
(the body's `prompt_cache_key`, else `x-session-id`, else `user` / metadata.user_id: the first
of SESSION_KEY_PRECEDENCE the canonical form carries): the session's last replica is credited
with the session's last prompt blocks, and wins a tie (scoring.py).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contracts.block_hash import hash_blocks
from gateway.fleet.endpoints import Endpoint, Fleet
from gateway.request.canonical import CanonicalRequest
from gateway.routing.base import Decision, LeastOutstandingRouter, Router
from gateway.routing.events_consumer import ConsumerConfig, ReplicaEventConsumer
from gateway.routing.index import InProcessIndex, PrefixIndex
from gateway.routing.scoring import CandidateLoad, ScoringConfig, choose

if TYPE_CHECKING:
    from gateway.backends.base import Backend
    from gateway.routing.prompt_hashing import PromptHasher

log = logging.getLogger("aigw.routing")


@dataclass(frozen=True, slots=True)
class PrefixRouterConfig:
    scoring: ScoringConfig = ScoringConfig()
    consumer: ConsumerConfig = ConsumerConfig()
    redis_url: str | None = None  # the shared index; None = in process
    redis_prefix: str = "aigw"
    read_redis_streams: bool = False  # events from the replicas' Redis streams instead of HTTP
    tentative_ttl_s: float = 5.0
    hash_off_loop_min_chars: int = 2_000  # prompts this long are hashed in a worker thread
    max_sessions: int = 65_536
    max_explanations: int = 1_024
    segment_cache_max_bytes: int = 32 * 1024 * 1024  # the prompt hasher's (prompt_hashing.py)

    def __post_init__(self) -> None:
        if self.tentative_ttl_s <= 0 or self.hash_off_loop_min_chars < 0:
            raise ValueError(f"invalid {self}")


@dataclass(slots=True)
class _EndpointState:
    endpoint: Endpoint
    backend: Backend
    consumer: ReplicaEventConsumer
    inflight_uncached: deque[int] = field(default_factory=deque)


class PrefixRouter(Router):
    def __init__(self, config: PrefixRouterConfig = PrefixRouterConfig(),
                 index: PrefixIndex | None = None) -> None:
        self.config = config
        self.index = index
        self._fallback = LeastOutstandingRouter()
        self._states: dict[str, _EndpointState] = {}  # by endpoint url
        self._tasks: dict[str, asyncio.Task[None]] = {}  # consumer tasks by endpoint url
        self._fleet: Fleet | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        self._hashers: dict[str, PromptHasher] = {}
        # session digest -> (url, num_blocks): max_sessions entries of fixed size (~200 bytes)
        self._sessions: OrderedDict[bytes, tuple[str, int]] = OrderedDict()
        self._explanations: OrderedDict[str, str] = OrderedDict()
        self._is_started = False
        self._stream_client: Any = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="aigw-prompt-hash")

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self, fleet: Fleet) -> None:
        """Open the index and run one event consumer per replica endpoint; a second call is a
        no-op."""
        if self._is_started:
            return
        self._is_started = True
        if self.index is None:
            if self.config.redis_url:
                from gateway.routing.redis_index import RedisIndex

                self.index = RedisIndex.from_url(self.config.redis_url, self.config.redis_prefix)
            else:
                self.index = InProcessIndex()
        if self.config.read_redis_streams and self.config.redis_url:
            from infra.redis_client import connect_redis

            self._stream_client = connect_redis(self.config.redis_url)
        self._fleet = fleet
        for route, endpoint in fleet.all_endpoints():
            if route.settings.backend == "replica":
                self._run_consumer(endpoint, route.backend)

    def _run_consumer(self, endpoint: Endpoint, backend: Backend) -> None:
        if endpoint.url in self._states:
            return
        consumer = self.track(endpoint, backend)
        self._tasks[endpoint.url] = asyncio.create_task(consumer.run(),
                                                        name=f"kv-events {endpoint.url}")

    async def on_endpoints_changed(self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
                                   ) -> None:
        """Consumers for new replica endpoints; removed ones stop and leave the index."""
        for endpoint in removed:
            task = self._tasks.pop(endpoint.url, None)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            state = self._states.pop(endpoint.url, None)
            if state is not None and self.index is not None and state.consumer.replica_id:
                await self.index.drop_replica(state.consumer.replica_id)
        for endpoint in added:
            route = self._fleet.get(endpoint.model.name) if self._fleet is not None else None
            if route is not None and route.settings.backend == "replica":
                self._run_consumer(endpoint, route.backend)

    def track(self, endpoint: Endpoint, backend: Backend) -> ReplicaEventConsumer:
        """Start keeping state for `endpoint` (its consumer is returned, not run: `start` runs
        it)."""
        assert self.index is not None, "give an index or call start()"
        consumer = ReplicaEventConsumer(endpoint, self.index, backend.transport,  # (the app's one)
                                        self.config.consumer, self._stream_client)
        self._states[endpoint.url] = _EndpointState(endpoint, backend, consumer)
        return consumer

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._pending]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._stream_client is not None:
            await self._stream_client.aclose()
            self._stream_client = None
        if self.index is not None:
            await self.index.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def settle(self) -> None:
        """Wait for the background index writes started so far (tentative inserts)."""
        await asyncio.gather(*self._pending, return_exceptions=True)

    def consumer(self, endpoint: Endpoint) -> ReplicaEventConsumer | None:
        state = self._states.get(endpoint.url)
        return state.consumer if state else None

    # ---- picking -----------------------------------------------------------------------------
    def pick(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        return self._fallback.pick(request, endpoints)

    async def choose(self, request: CanonicalRequest, endpoints: Sequence[Endpoint]) -> Decision:
        if request.kind == "embedding":  # an encoder keeps no prefix cache
            return self._least_load(request, endpoints, "least_load:embedding")
        states = [self._states.get(e.url) for e in endpoints]
        synced = [s for s in states if s is not None and s.consumer.is_synced]
        if self.index is None or not synced or len(endpoints) < 2:
            return self._least_load(request, endpoints, "least_load:no_index")
        model_id, block_size = synced[0].consumer.model_id, synced[0].consumer.block_size
        assert model_id is not None and block_size is not None
        if self._is_surely_over_context(request, endpoints):
            return self._least_load(request, endpoints, "least_load:over_context")
        upstream_body = getattr(synced[0].backend, "upstream_body", None)  # the replica backend's
        if upstream_body is None:
            return self._least_load(request, endpoints, "least_load:no_body")
        body: dict[str, Any] = upstream_body(request, synced[0].endpoint)
        try:
            hashes = await self._hash(request, body, model_id, block_size, synced[0].endpoint)
        except Exception as exc:  # noqa: BLE001 - the replica will report a bad request itself
            log.debug("cannot hash %s: %s", request.request_id, exc)
            return self._least_load(request, endpoints, "least_load:unhashable")
        if not hashes:
            return self._least_load(request, endpoints, "least_load:short_prompt")
        replica_ids = [s.consumer.replica_id for s in synced if s.consumer.replica_id]
        matched = await self.index.match_tiers(hashes, replica_ids)
        candidates = [self._candidate(endpoint, state, matched, request, len(hashes))
                      for endpoint, state in zip(endpoints, states, strict=True)]
        best, scores = choose(self.config.scoring, len(hashes), hashes[0], candidates)
        chosen = endpoints[best]
        reason = "prefix" if scores[best].num_matched_blocks else "least_cost"
        self._record(request, chosen, hashes, scores[best].num_matched_blocks, reason,
                     "; ".join(s.describe() for s in scores))
        return Decision(chosen, reason)

    async def expected_cached_tokens(self, request: CanonicalRequest,
                                     endpoints: Sequence[Endpoint]) -> int:
        """The prompt tokens the index expects `request` to find cached: the longest run of its
        blocks one of `endpoints` holds (or the session's last replica is credited with), at most
        all but the last token (which a replica always computes). 0 without a rendered prompt
        (admission renders one under a token limit) or a synced index: nothing is assumed."""
        rendered = request.rendered_prompt
        states = [self._states.get(e.url) for e in endpoints]
        synced = [s for s in states if s is not None and s.consumer.is_synced]
        if rendered is None or self.index is None or not synced or request.kind == "embedding":
            return 0
        block_size = synced[0].consumer.block_size
        upstream_body = getattr(synced[0].backend, "upstream_body", None)
        if (upstream_body is None or block_size is None
            or rendered[0] != tokenizer_path(endpoints[0])):
            return 0
        try:
            hashes = await self._hash(request, upstream_body(request, synced[0].endpoint),
                                      synced[0].consumer.model_id or "", block_size,
                                      synced[0].endpoint)
        except Exception:  # noqa: BLE001 - nothing assumed cached
            return 0
        if not hashes:
            return 0
        replica_ids = [s.consumer.replica_id for s in synced if s.consumer.replica_id]
        num_matched = max((await self.index.match(hashes, replica_ids)).values(), default=0)
        session = self._sessions.get(_session_key(request) or b"")
        if session is not None and any(e.url == session[0] for e in endpoints):
            num_matched = max(num_matched, min(session[1], len(hashes)))
        return min(num_matched * block_size, max(len(rendered[1]) - 1, 0))

    def _candidate(self, endpoint: Endpoint, state: _EndpointState | None,
                   matched: dict[str, tuple[int, int]], request: CanonicalRequest,
                   num_blocks: int) -> CandidateLoad:
        replica_id = state.consumer.replica_id if state and state.consumer.is_synced else None
        num_matched, num_host = matched.get(replica_id, (0, 0)) if replica_id else (0, 0)
        session = self._sessions.get(_session_key(request) or b"")
        holds_session = session is not None and session[0] == endpoint.url
        if session is not None and holds_session:
            num_matched = max(num_matched, min(session[1], num_blocks))
        inflight: Sequence[int] = ()
        if state is not None:
            while len(state.inflight_uncached) > endpoint.num_outstanding:
                state.inflight_uncached.popleft()  # the oldest have finished (approximately)
            num_unknown = endpoint.num_outstanding - len(state.inflight_uncached)
            # not ours: assume n
            inflight = (*state.inflight_uncached, *(num_blocks,) * num_unknown)
        load = endpoint.load
        kv_used = 0.0
        if load and load.num_kv_blocks_used is not None and load.num_kv_blocks_total:
            kv_used = load.num_kv_blocks_used / load.num_kv_blocks_total
        delay_ms = load.queue_delay_ms(request.service_tier) if load else None
        ms_per_block = None
        if load and load.prefill_ms_per_token and state and state.consumer.block_size:
            ms_per_block = load.prefill_ms_per_token * state.consumer.block_size
        return CandidateLoad(endpoint.name, num_matched, inflight,
                             (load.num_requests_waiting or 0) if load else 0, kv_used, num_host,
                             delay_ms, ms_per_block, holds_session)

    def _is_surely_over_context(self, request: CanonicalRequest,
                                endpoints: Sequence[Endpoint]) -> bool:
        """A prompt whose length alone proves it cannot fit is not hashed: encoding megabytes
        takes seconds, during which the tokenizer may hold the GIL and stall the event loop; the
        replica refuses it unencoded (chat/render.py: refuse_surely_too_long). Its
        characters bound its UTF-8 bytes from below, and a token stands for at most
        `max_token_bytes` of them (unknown until this model's tokenizer is loaded)."""
        hasher = self._hashers.get(tokenizer_path(endpoints[0]))
        max_token_bytes = hasher.tokenizer.max_token_bytes if hasher is not None else None
        context_length = max((e.context_length or 0 for e in endpoints), default=0)
        return bool(max_token_bytes and context_length
                    and request.text_length() > max_token_bytes * context_length)

    def _least_load(self, request: CanonicalRequest, endpoints: Sequence[Endpoint],
                    reason: str) -> Decision:
        decision = self._fallback.pick(request, endpoints)
        self._remember_explanation(request.request_id, f"{reason} -> {decision.endpoint.name}")
        return Decision(decision.endpoint, reason)

    async def _hash(self, request: CanonicalRequest, body: dict[str, Any], model_id: str,
                    block_size: int, endpoint: Endpoint) -> list[int]:
        path = tokenizer_path(endpoint)
        rendered = request.rendered_prompt
        if rendered is not None and rendered[0] == path:  # rendered at admission: hash those ids
            salt = body.get("cache_salt")
            return hash_blocks(rendered[1], block_size, model_id,
                               salt if isinstance(salt, str) else None)
        if (path not in self._hashers
            or request.text_length() >= self.config.hash_off_loop_min_chars):
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._executor, self._token_ids, path, body)
        else:
            ids = self._token_ids(path, body)
        request.rendered_prompt = (path, ids)  # the replica backend sends them on: rendered once
        salt = body.get("cache_salt")
        return hash_blocks(ids, block_size, model_id, salt if isinstance(salt, str) else None)

    def _token_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        hasher = self._hashers.get(path)
        if hasher is None:
            from gateway.routing.prompt_hashing import shared_prompt_hasher

            hasher = self._hashers[path] = shared_prompt_hasher(
                path, self.config.segment_cache_max_bytes)
        return hasher.token_ids(body)

    def _record(self, request: CanonicalRequest, chosen: Endpoint, hashes: list[int],
                num_matched: int, reason: str, detail: str) -> None:
        state = self._states.get(chosen.url)
        if state is not None:
            state.inflight_uncached.append(len(hashes) - num_matched)
            replica_id = state.consumer.replica_id
            if replica_id and self.index is not None:
                task = asyncio.create_task(
                    self.index.insert_tentative(replica_id, hashes, self.config.tentative_ttl_s))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
        key = _session_key(request)
        if key:
            self._sessions[key] = (chosen.url, len(hashes))
            self._sessions.move_to_end(key)
            if len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)
        text = f"{reason} -> {chosen.name} blocks={len(hashes)} | {detail}"
        self._remember_explanation(request.request_id, text)
        log.debug("route %s: %s", request.request_id, text)

    def _remember_explanation(self, request_id: str, text: str) -> None:
        self._explanations[request_id] = text
        if len(self._explanations) > self.config.max_explanations:
            self._explanations.popitem(last=False)

    def explain(self, request_id: str) -> str | None:
        return self._explanations.get(request_id)


# the affinity inputs, first present wins: the body's prompt_cache_key (OpenAI's field for cache
# routing), the `x-session-id` header, the end user (OpenAI `user`, Anthropic metadata.user_id)
SESSION_KEY_PRECEDENCE = ("prompt_cache_key", "session_id", "user")


def _session_key(request: CanonicalRequest) -> bytes | None:
    """A fixed-size digest of (project, session): the session's name is the caller's text (a
    body's prompt_cache_key or `user` of any length, an `x-session-id` header of up to 8 KiB), and
    `max_sessions` of them must stay bounded in bytes (16 bytes a key)."""
    for attribute in SESSION_KEY_PRECEDENCE:
        value = getattr(request, attribute, None)
        if isinstance(value, str) and value:
            text = f"{request.project or ''}/{value}".encode("utf-8", "surrogatepass")
            return hashlib.blake2b(text, digest_size=16).digest()
    return None


def tokenizer_path(endpoint: Endpoint) -> str:
    """The model path whose tokenizer the replicas use: `ModelSettings.tokenizer` (a GGUF file or a
    Hugging Face directory; a tokenizer.json means its directory), else the engine's default."""
    return _resolve_tokenizer_path(endpoint.model.tokenizer)


@functools.lru_cache(maxsize=64)
def _resolve_tokenizer_path(configured: str | None) -> str:
    if configured:
        path = Path(configured)
        return str(path.parent if path.suffix == ".json" else path)
    from contracts.default_model import default_model_path

    return str(default_model_path())
