"""The prefix router's cost: prefill saved against load, in units of KV blocks (pure functions).

For a request of `n` full prompt blocks and each candidate replica r:

    prefill_r = n - matched_r + H * host_r          blocks r would have to compute; host_r of the
                                                    matched blocks only r's host tier holds: each is
                                                    a copy back into the pool, H of a recompute
    active_r  = sum over this gateway's requests in flight to r of (uncached_blocks + D)
              + max(waiting_r * (n + D),            requests the replica reports queued (/metrics),
                    delay_r / P_r)                  or its predicted queueing delay for the
                                                    request's class (ms), in blocks, if larger
              + n * max(0, kv_used_r - S) / (1 - S) KV nearly full: new blocks evict cached ones
    cost_r    = W * prefill_r + active_r

    P_r = the replica's prefill ms per block (its aigw_replica_prefill_ms_per_token x block size
    when it reports one, else queue_ms_per_block, default 4: a CPU replica of the default model;
    a GPU prefills a block in well under 1 ms). The delay is the replica's own estimate
    (aigw_replica_predicted_queue_delay_ms, the figure its admission control refuses by), so a
    replica about to refuse a class costs that class more than one with the same queue length,
    H = host_block_cost (default 0.1: a host-tier hit is cheaper than any miss, dearer than a
    pool hit; bench/results/kv-host-tier-cpu.md measured a restore at ~0.5% of a recompute on
    a CPU),
    W = prefill_weight (default 1.5), D = decode_blocks_per_request (default 8: a request's decode
    work in prefill-block units), S = kv_saturation (0.9). W > 1 charges a move for more than its
    prefill: recomputing a prefix elsewhere also evicts that replica's cached blocks. The defaults
    come from the simulator (bench/routing_sim.py): W = 1 (Dynamo's default) lost ~40% of the
    hits on the shared-prefix workload under overload; W = 2 unbalanced the agent workload.

The lowest cost wins; ties go to the session's last replica (it also holds the blocks of the
previous turn's output, which no index entry names yet), then to fewer requests in flight, then to
a rendezvous hash of the request's first block with the replica id, so new prefixes spread evenly
and a given prefix keeps going to the same replica before any event has arrived. Prefix alone never
decides: a holder with enough work in flight costs more than recomputing the prefix elsewhere
("sticky until saturated").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash


@dataclass(frozen=True, slots=True)
class ScoringConfig:
    prefill_weight: float = 1.5
    decode_blocks_per_request: float = 8.0
    kv_saturation: float = 0.9
    host_block_cost: float = 0.1
    queue_ms_per_block: float = 4.0

    def __post_init__(self) -> None:
        if not self.queue_ms_per_block > 0:
            raise ValueError("queue_ms_per_block must be positive")
        if self.prefill_weight < 0 or self.decode_blocks_per_request < 0:
            raise ValueError("weights must be non-negative")
        if not 0.0 <= self.host_block_cost <= 1.0:
            raise ValueError("host_block_cost must be in [0, 1]")
        if not 0.0 <= self.kv_saturation < 1.0:
            raise ValueError("kv_saturation must be in [0, 1)")


@dataclass(frozen=True, slots=True)
class CandidateLoad:
    """What the router knows about one candidate when it decides."""

    name: str
    num_matched_blocks: int
    inflight_uncached_blocks: Sequence[int] = ()  # one entry per request in flight from us
    num_requests_waiting: int = 0
    kv_used_fraction: float = 0.0
    num_host_blocks: int = 0  # of the matched blocks, those only the replica's host tier holds
    queue_delay_ms: float | None = None  # the replica's predicted queueing for this request's class
    ms_per_block: float | None = None  # the replica's prefill cost of one block, if it reports one
    holds_session: bool = False  # the replica the request's session last went to


@dataclass(frozen=True, slots=True)
class Score:
    name: str
    num_matched_blocks: int
    prefill_blocks: float
    active_blocks: float
    cost: float
    num_host_blocks: int = 0

    def describe(self) -> str:
        host = f" host={self.num_host_blocks}" if self.num_host_blocks else ""
        return (f"{self.name} matched={self.num_matched_blocks}{host} "
                f"prefill={self.prefill_blocks:g} active={self.active_blocks:g} cost={self.cost:g}")


def score(config: ScoringConfig, num_blocks: int, candidate: CandidateLoad) -> Score:
    matched = min(candidate.num_matched_blocks, num_blocks)
    host = min(candidate.num_host_blocks, matched)
    prefill = float(num_blocks - matched) + config.host_block_cost * host
    decode = config.decode_blocks_per_request
    active = sum(blocks + decode for blocks in candidate.inflight_uncached_blocks)
    queued = candidate.num_requests_waiting * (num_blocks + decode)
    if candidate.queue_delay_ms:
        ms_per_block = candidate.ms_per_block or config.queue_ms_per_block
        queued = max(queued, candidate.queue_delay_ms / ms_per_block)
    active += queued
    over = max(0.0, candidate.kv_used_fraction - config.kv_saturation)
    active += num_blocks * over / (1.0 - config.kv_saturation)
    return Score(candidate.name, matched, prefill, active, config.prefill_weight * prefill + active,
                 host)


def rendezvous(first_block_hash: int, name: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{first_block_hash:x}/{name}".encode())


def choose(config: ScoringConfig, num_blocks: int, first_block_hash: int,
           candidates: Sequence[CandidateLoad]) -> tuple[int, list[Score]]:
    """(index of the winner in `candidates`, every candidate's score)."""
    scores = [score(config, num_blocks, c) for c in candidates]
    best = min(range(len(candidates)), key=lambda i: (
        scores[i].cost, not candidates[i].holds_session,
        len(candidates[i].inflight_uncached_blocks),
        rendezvous(first_block_hash, candidates[i].name)))
    return best, scores
