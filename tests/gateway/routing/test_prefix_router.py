"""Prefix router decisions on both index implementations, with consumers marked synced by hand."""

from __future__ import annotations

import time
from typing import Any

import pytest

from contracts.kv_events import BlockStored, EventBatch, KVSnapshot
from engine.loader import default_model_path, load_tokenizer
from gateway.backends.replica import ReplicaBackend
from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.endpoints import Endpoint, EndpointLoad
from gateway.request.canonical import CanonicalRequest, Message
from gateway.routing.prefix_router import PrefixRouter, PrefixRouterConfig
from gateway.routing.prompt_hashing import PromptHasher
from gateway.settings import GatewaySettings, ModelSettings
from tests.gateway.routing.conftest import IndexUnderTest

MODEL = ModelSettings(name="m", endpoints=("http://127.0.0.1:1", "http://127.0.0.1:2"))


@pytest.fixture(scope="module")
def hasher() -> PromptHasher:
    return PromptHasher(load_tokenizer(default_model_path()))


class Rig:
    def __init__(self, index: IndexUnderTest, config: PrefixRouterConfig | None = None) -> None:
        self.ix = index
        self.backend = ReplicaBackend(None, GatewaySettings(auth_enabled=False))  # type: ignore[arg-type]
        self.endpoints = [Endpoint(url, MODEL, CircuitBreaker(3, 1.0)) for url in MODEL.endpoints]
        self.router = PrefixRouter(config or PrefixRouterConfig(), index=index.index)
        for endpoint in self.endpoints:
            consumer = self.router.track(endpoint, self.backend)
            consumer.replica_id, consumer.model_id, consumer.block_size = endpoint.name, "m", 16
            consumer.is_synced = True
            index.run(index.index.load_snapshot(KVSnapshot(endpoint.name, 0, 16, ())))
        self.seqs = dict.fromkeys((e.name for e in self.endpoints), 0)

    def hold(self, endpoint: Endpoint, hashes: list[int]) -> None:
        self.seqs[endpoint.name] += 1
        batch = EventBatch(endpoint.name, self.seqs[endpoint.name], time.time(),
                           (BlockStored(tuple(hashes), None, (), 16),))
        self.ix.run(self.ix.index.apply(batch))

    def choose(self, request: CanonicalRequest) -> tuple[Endpoint, str]:
        async def go() -> Any:
            decision = await self.router.choose(request, self.endpoints)
            await self.router.settle()
            return decision
        decision = self.ix.run(go())
        return decision.endpoint, decision.reason


def request(prefix: str, suffix: str = "", request_id: str = "r") -> CanonicalRequest:
    return CanonicalRequest(request_id, "m", messages=[Message("system", prefix * 30),
                                                       Message("user", "question " + suffix)],
                            project="p", cache_salt="project:p")


def hashes_of(rig: Rig, hasher: PromptHasher, req: CanonicalRequest) -> list[int]:
    return hasher.block_hashes(rig.backend.upstream_body(req, rig.endpoints[0]), "m", 16)


def test_the_prefix_holder_wins_and_the_debug_account_shows_matches(
        index: IndexUnderTest, hasher: PromptHasher) -> None:
    rig = Rig(index)
    req = request("You are terse. ", request_id="r1")
    hashes = hashes_of(rig, hasher, req)
    rig.hold(rig.endpoints[1], hashes[:-1])
    chosen, reason = rig.choose(req)
    assert chosen is rig.endpoints[1] and reason == "prefix"
    account = rig.router.explain("r1")
    assert (account is not None and f"matched={len(hashes) - 1}" in account
            and "matched=0" in account)


def test_the_holder_is_sticky_until_its_load_outweighs_the_prefill_saved(
        index: IndexUnderTest, hasher: PromptHasher) -> None:
    rig = Rig(index, PrefixRouterConfig())
    holder, other = rig.endpoints
    req = request("Shared system prompt for everyone. ")
    num_blocks = len(hashes_of(rig, hasher, req))
    rig.hold(holder, hashes_of(rig, hasher, req))
    picks = []
    for i in range(12):  # nothing finishes: each dispatch adds an outstanding request
        chosen, _ = rig.choose(request("Shared system prompt for everyone. ", f"q{i}", f"r{i}"))
        chosen.num_outstanding += 1
        picks.append(chosen)
    assert picks[0] is holder and picks[1] is holder
    assert other in picks  # overloaded: the other replica gets work
    assert picks.count(holder) > picks.count(other)
    assert num_blocks > 10


def test_without_any_match_the_least_loaded_replica_wins(index: IndexUnderTest) -> None:
    rig = Rig(index)
    rig.endpoints[0].num_outstanding = 3
    rig.endpoints[1].load = EndpointLoad(num_requests_waiting=0)
    chosen, reason = rig.choose(request("Nothing cached anywhere. "))
    assert chosen is rig.endpoints[1] and reason == "least_cost"


def test_queued_requests_reported_by_the_replica_count_as_load(index: IndexUnderTest) -> None:
    rig = Rig(index)
    rig.endpoints[0].load = EndpointLoad(num_requests_waiting=4)
    rig.endpoints[1].load = EndpointLoad(num_requests_waiting=0)
    assert rig.choose(request("Some prompt text here. "))[0] is rig.endpoints[1]


def test_a_decision_inserts_the_blocks_for_the_chosen_replica_with_a_ttl(
        index: IndexUnderTest, hasher: PromptHasher) -> None:
    rig = Rig(index, PrefixRouterConfig(tentative_ttl_s=2.0))  # (a slow machine takes ~0.5 s here)
    req = request("Tentative entries cover event lag. ")
    chosen, _ = rig.choose(req)
    hashes = hashes_of(rig, hasher, req)
    names = [e.name for e in rig.endpoints]
    matched = index.run(index.index.match(hashes, names))
    assert matched[chosen.name] == len(hashes)
    assert sum(matched.values()) == len(hashes)  # the other one holds nothing
    assert rig.choose(request("Tentative entries cover event lag. ", "more"))[0] is chosen
    time.sleep(2.2)
    assert index.run(index.index.match(hashes, names))[chosen.name] == 0


def test_distinct_prefixes_spread_over_the_replicas(index: IndexUnderTest) -> None:
    rig = Rig(index, PrefixRouterConfig(tentative_ttl_s=0.01))
    chosen = {rig.choose(request(f"Prefix number {i}. "))[0].name for i in range(12)}
    assert chosen == {e.name for e in rig.endpoints}


def test_unsynced_replicas_fall_back_to_least_outstanding(index: IndexUnderTest) -> None:
    rig = Rig(index)
    for endpoint in rig.endpoints:
        consumer = rig.router.consumer(endpoint)
        assert consumer is not None
        consumer.is_synced = False
    rig.endpoints[0].num_outstanding = 1
    chosen, reason = rig.choose(request("Any. "))
    assert chosen is rig.endpoints[1] and reason == "least_load:no_index"


def test_endpoints_removed_by_discovery_leave_the_router_and_the_index(
        index: IndexUnderTest) -> None:
    rig = Rig(index)
    gone = rig.endpoints[1]
    rig.hold(gone, [1, 2])
    index.run(rig.router.on_endpoints_changed([], [gone]))
    assert rig.router.consumer(gone) is None
    assert index.run(index.index.num_blocks(gone.name)) == 0


def test_a_prompt_sure_not_to_fit_is_routed_by_load_without_being_encoded(
        index: IndexUnderTest) -> None:
    # encoding an 8 MB prompt took ~20 s in the router's thread, holding the GIL: the gateway's
    # event loop (every other request, /health) stalled that long
    rig = Rig(index)
    rig.choose(request("Load the tokenizer first. "))  # the router loads its hasher
    for endpoint in rig.endpoints:
        endpoint.context_length = 1456
    loaded = next(iter(rig.router._hashers.values()))  # type: ignore[attr-defined]
    assert loaded.tokenizer.max_token_bytes is not None

    def no_encoding(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a prompt sure not to fit was encoded")

    loaded.block_hashes = no_encoding
    huge = CanonicalRequest("r", "m", messages=[Message("user", "word " * 200_000)], project="p")
    assert rig.choose(huge)[1] == "least_load:over_context"
    del loaded.block_hashes
    assert rig.choose(request("A prompt that fits. "))[1] != "least_load:over_context"


def test_sessions_are_kept_in_fixed_bytes_whatever_their_names() -> None:
    """The session table held `max_sessions` keys of the caller's own text (an OpenAI `user` of
    any length): 64 sessions named with 256 KB each kept 16 MB. Keys are 16-byte digests now."""
    import tracemalloc

    index = IndexUnderTest("in_process", None)  # (the session table is the router's own)
    rig = Rig(index, PrefixRouterConfig(max_sessions=1_000))
    rig.choose(request("You are terse. ", request_id="warm"))  # the tokenizer, the segment cache
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    for i in range(64):
        req = request("You are terse. ", request_id=f"r{i}")
        req.user = f"{i}-" + "u" * 256_000
        rig.choose(req)
        del req
    retained, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(rig.router._sessions) == 64
    assert retained - before < 1_000_000
    again = request("You are terse. ", request_id="again")
    again.user = "0-" + "u" * 256_000  # the same session is still found by its digest
    rig.choose(again)
    assert len(rig.router._sessions) == 64
    index.close()


def test_prompt_cache_key_is_the_session_key_ahead_of_the_header_and_the_user(
        index: IndexUnderTest) -> None:
    """A session's replica is credited with its last prompt; prompt_cache_key names the session
    first, so two requests sharing it follow each other whatever their x-session-id and user."""
    rig = Rig(index)
    first = request("You are terse. ", request_id="k1")
    first.prompt_cache_key, first.session_id, first.user = "conv-1", "s-a", "alice"
    chosen, _ = rig.choose(first)
    # another prompt (no shared prefix in the index), the same key, another header and user
    follow = request("Other words entirely. ", request_id="k2")
    follow.prompt_cache_key, follow.session_id, follow.user = "conv-1", "s-b", "bob"
    followed, reason = rig.choose(follow)
    assert followed is chosen and reason == "prefix"
    # the first request's header and user, without its key, name no session seen: no credit
    stranger = request("A third new prompt. ", request_id="k3")
    stranger.session_id, stranger.user = "s-a", "alice"
    assert rig.choose(stranger)[1] == "least_cost"
    keyed = request("A fourth new prompt. ", request_id="k4")
    keyed.session_id, keyed.prompt_cache_key = "s-a", "conv-1"  # the key: credited again
    assert rig.choose(keyed) == (chosen, "prefix")


@pytest.mark.parametrize("first_holder", [0, 1])
def test_a_tie_goes_to_the_sessions_last_replica(index: IndexUnderTest, hasher: PromptHasher,
                                                 first_holder: int) -> None:
    """Two replicas hold a session's prompt equally; the session's last replica also holds the
    previous turn's output (no index entry names those blocks yet), so it wins the tie, whichever
    replica the rendezvous hash would pick: one of the two orders failed when it decided."""
    rig = Rig(index)
    turn = request("You are terse. ", request_id="t1")
    turn.prompt_cache_key = "conv-1"
    hashes = hashes_of(rig, hasher, turn)
    rig.hold(rig.endpoints[first_holder], hashes)
    assert rig.choose(turn)[0] is rig.endpoints[first_holder]
    rig.hold(rig.endpoints[1 - first_holder], hashes)  # now both hold it
    again = request("You are terse. ", request_id="t2")
    again.prompt_cache_key = "conv-1"
    assert rig.choose(again) == (rig.endpoints[first_holder], "prefix")
