"""The replicas' second KV tier in the gateway's prefix index and router: events with medium "host"
are a second set per replica, a run continues through blocks held in either, and a block only the
host tier holds costs a little (a copy), far less than a miss. Both index implementations."""

from __future__ import annotations

import time

from contracts.kv_events import (
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    KVSnapshot,
)
from gateway.routing.prefix_router import PrefixRouterConfig
from gateway.routing.prompt_hashing import PromptHasher
from gateway.routing.scoring import CandidateLoad, ScoringConfig, choose
from tests.gateway.routing.conftest import IndexUnderTest
from tests.gateway.routing.test_prefix_router import Rig, hasher, hashes_of, request

__all__ = ["hasher"]  # (the module fixture, shared with test_prefix_router)


def host_stored(*hashes: int) -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 16, MEDIUM_HOST)


def evicted_to_host(*hashes: int) -> tuple[KVEvent, ...]:
    """What a replica's step reports when its pool evicts blocks into its host tier."""
    return BlockRemoved(tuple(hashes)), host_stored(*hashes)


def apply(index: IndexUnderTest, replica: str, seq: int, *events: KVEvent) -> None:
    index.run(index.index.apply(EventBatch(replica, seq, time.time(), tuple(events))))


def test_a_run_continues_through_either_tier_and_counts_the_host_blocks(
        index: IndexUnderTest) -> None:
    ix = index.index
    for replica in ("a", "b"):
        index.run(ix.load_snapshot(KVSnapshot(replica, 0, 16, ())))
    apply(index, "a", 1, BlockStored((1, 2, 3, 4), None, (), 16))
    apply(index, "a", 2, *evicted_to_host(3, 4))
    apply(index, "b", 1, host_stored(1, 2))
    assert index.run(ix.match_tiers([1, 2, 3, 4, 5], ["a", "b"])) == {"a": (4, 2), "b": (2, 2)}
    assert index.run(ix.match([1, 2, 3, 4], ["a", "b"])) == {"a": 4, "b": 2}
    apply(index, "a", 3, BlockStored((3,), 2, (), 16))  # restored: in both tiers, a pool hit
    assert index.run(ix.match_tiers([1, 2, 3, 4], ["a"])) == {"a": (4, 1)}
    apply(index, "a", 4, BlockRemoved((4,), MEDIUM_HOST))  # left the host tier: the run ends at 3
    assert index.run(ix.match_tiers([1, 2, 3, 4], ["a"])) == {"a": (3, 0)}
    apply(index, "b", 2, AllBlocksCleared())  # a reset empties both tiers
    assert index.run(ix.match_tiers([1, 2], ["a", "b"])) == {"a": (2, 0), "b": (0, 0)}


def test_a_snapshot_carries_the_host_tier_and_a_drop_forgets_it(index: IndexUnderTest) -> None:
    ix = index.index
    index.run(ix.load_snapshot(KVSnapshot("a", 5, 16, (1,), (2, 3))))
    index.run(ix.load_snapshot(KVSnapshot("b", 1, 16, (), (1, 2))))
    assert index.run(ix.match_tiers([1, 2, 3], ["a", "b"])) == {"a": (3, 2), "b": (2, 2)}
    index.run(ix.load_snapshot(KVSnapshot("a", 6, 16, (1,))))  # replaced: no host blocks now
    assert index.run(ix.match_tiers([1, 2, 3], ["a"])) == {"a": (1, 0)}
    index.run(ix.drop_replica("b"))
    assert index.run(ix.match_tiers([1, 2], ["b"])) == {"b": (0, 0)}
    assert index.run(ix.applied_seq("b")) is None


def test_scoring_ranks_a_pool_hit_over_a_host_hit_over_a_miss() -> None:
    config = ScoringConfig()
    pool = CandidateLoad("pool", 20)
    host = CandidateLoad("host", 20, num_host_blocks=20)
    miss = CandidateLoad("miss", 0)
    assert choose(config, 20, 1, [miss, host])[0] == 1
    assert choose(config, 20, 1, [host, pool])[0] == 1
    _, scores = choose(config, 20, 1, [pool, host, miss])
    assert scores[0].cost < scores[1].cost < scores[2].cost
    assert scores[1].prefill_blocks == config.host_block_cost * 20
    assert "host=20" in scores[1].describe()


def test_the_router_prefers_the_replica_whose_host_tier_holds_the_prefix(
        index: IndexUnderTest, hasher: PromptHasher) -> None:
    rig = Rig(index, PrefixRouterConfig(tentative_ttl_s=0.05))
    req = request("A long agent system prompt that was evicted to the host tier. ", request_id="t1")
    hashes = hashes_of(rig, hasher, req)
    evicted_on, other = rig.endpoints[1], rig.endpoints[0]
    rig.seqs[evicted_on.name] += 1
    apply(index, evicted_on.name, rig.seqs[evicted_on.name], host_stored(*hashes[:-1]))
    chosen, reason = rig.choose(req)
    assert chosen is evicted_on and reason == "prefix"
    account = rig.router.explain("t1")
    assert account is not None and f"host={len(hashes) - 1}" in account
    # the same prefix in the other replica's pool: the pool hit is cheaper
    rig.hold(other, hashes[:-1])
    time.sleep(0.1)  # the first decision's tentative entries (for its replica's pool) expired
    req2 = request("A long agent system prompt that was evicted to the host tier. ", "again", "t2")
    assert rig.choose(req2)[0] is other
