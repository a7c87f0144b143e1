"""Prefix index behaviour, on the in-process and the Redis implementation alike."""

from __future__ import annotations

import time

from contracts.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVSnapshot,
)
from gateway.routing.index import ApplyResult
from tests.gateway.routing.conftest import IndexUnderTest


def stored(*hashes: int) -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 16)


def batch(replica: str, seq: int, *events: object) -> EventBatch:
    return EventBatch(replica, seq, time.time(), tuple(events))  # type: ignore[arg-type]


def synced(index: IndexUnderTest, *replicas: str) -> None:
    for replica in replicas:
        index.run(index.index.load_snapshot(KVSnapshot(replica, 0, 16, ())))


def test_events_apply_in_order_and_removals_break_the_run(index: IndexUnderTest) -> None:
    synced(index, "a", "b")
    ix = index.index
    assert index.run(ix.apply(batch("a", 1, stored(1, 2, 3)))) is ApplyResult.APPLIED
    assert index.run(ix.apply(batch("b", 1, stored(1)))) is ApplyResult.APPLIED
    assert index.run(ix.match([1, 2, 3, 4], ["a", "b"])) == {"a": 3, "b": 1}
    assert index.run(ix.apply(batch("a", 2, BlockRemoved((2,))))) is ApplyResult.APPLIED
    assert index.run(ix.match([1, 2, 3], ["a", "b"])) == {"a": 1, "b": 1}
    assert index.run(ix.applied_seq("a")) == 2
    assert index.run(ix.num_blocks("a")) == 2


def test_replayed_batches_are_skipped_and_gaps_are_reported(index: IndexUnderTest) -> None:
    ix = index.index
    assert index.run(ix.apply(batch("a", 1, stored(1)))) is ApplyResult.GAP  # no snapshot yet
    synced(index, "a")
    assert index.run(ix.apply(batch("a", 1, stored(1)))) is ApplyResult.APPLIED
    assert index.run(ix.apply(batch("a", 1, stored(9)))) is ApplyResult.STALE
    assert index.run(ix.apply(batch("a", 3, stored(7)))) is ApplyResult.GAP
    assert index.run(ix.match([9], ["a"])) == {"a": 0}
    assert index.run(ix.match([7], ["a"])) == {"a": 0}


def test_snapshot_after_a_gap_replaces_the_replicas_entries(index: IndexUnderTest) -> None:
    synced(index, "a", "b")
    ix = index.index
    index.run(ix.apply(batch("a", 1, stored(1, 2))))
    index.run(ix.apply(batch("b", 1, stored(1, 2))))
    index.run(ix.load_snapshot(KVSnapshot("a", 7, 16, (1, 5))))
    assert index.run(ix.applied_seq("a")) == 7
    assert index.run(ix.match([1, 2], ["a", "b"])) == {"a": 1, "b": 2}
    assert index.run(ix.match([1, 5], ["a", "b"])) == {"a": 2, "b": 1}
    assert index.run(ix.apply(batch("a", 8, stored(6)))) is ApplyResult.APPLIED


def test_clear_and_drop_forget_only_that_replica(index: IndexUnderTest) -> None:
    synced(index, "a", "b")
    ix = index.index
    index.run(ix.apply(batch("a", 1, stored(1, 2))))
    index.run(ix.apply(batch("b", 1, stored(1, 2))))
    index.run(ix.apply(batch("a", 2, AllBlocksCleared(), stored(3))))
    assert index.run(ix.match([1, 2], ["a", "b"])) == {"a": 0, "b": 2}
    assert index.run(ix.match([3], ["a", "b"])) == {"a": 1, "b": 0}
    index.run(ix.drop_replica("b"))
    assert index.run(ix.match([1, 2], ["a", "b"])) == {"a": 0, "b": 0}
    assert index.run(ix.applied_seq("b")) is None
    assert index.run(ix.num_blocks("b")) == 0


def test_longest_run_counts_from_the_first_block_only(index: IndexUnderTest) -> None:
    synced(index, "a")
    index.run(index.index.apply(batch("a", 1, stored(2, 3, 4))))
    assert index.run(index.index.match([1, 2, 3, 4], ["a"])) == {"a": 0}
    assert index.run(index.index.match([], ["a"])) == {"a": 0}


def test_tentative_entries_expire_and_never_demote_event_entries(index: IndexUnderTest) -> None:
    synced(index, "a")
    ix = index.index
    index.run(ix.apply(batch("a", 1, stored(1))))
    index.run(ix.insert_tentative("a", [1, 2, 3], ttl_s=0.3))
    assert index.run(ix.match([1, 2, 3], ["a"])) == {"a": 3}
    index.run(ix.apply(batch("a", 2, stored(2))))  # the event arrives: 2 becomes permanent
    time.sleep(0.45)
    assert index.run(ix.match([1, 2, 3], ["a"])) == {"a": 2}
    assert index.run(ix.num_blocks("a")) == 2
