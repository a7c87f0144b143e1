"""A discrete-event simulator of routing policies over N replicas with LRU block caches.

Model (kept simple on purpose; what it answers is *placement*, not engine speed):
  - a replica is one FIFO server; a request's service time is
        prefill_s_per_token * uncached_prompt_tokens + decode_s_per_token * output_tokens
    (the two costs are calibrated on a real replica by bench/routing_bench.py);
  - its cache is an LRU of `num_cache_blocks` block hashes (contracts/block_hash.py); when a
    request starts, its longest cached prefix is a hit, and its prompt blocks are inserted (LRU
    evicts); at completion its prompt+output blocks are inserted (the next agent turn reuses them);
  - the "prefix" policy is the gateway's own scoring (gateway/routing/scoring.py) over an index
    that sees cache changes `event_lag_s` late, plus tentative entries for its own decisions;
    "oracle" sees every cache exactly (and what queued requests will add) and maximises the hit.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import xxhash

from contracts.block_hash import hash_blocks
from gateway.routing.scoring import CandidateLoad, ScoringConfig, choose

BLOCK_SIZE = 16
POLICIES = ("round-robin", "least-load", "session-hash", "prefix", "oracle")


@dataclass
class SimRequest:
    session: int
    prompt: list[int]
    num_output_tokens: int
    arrival_s: float = 0.0
    hashes: list[int] = field(default_factory=list)
    next_turn: Callable[[list[int]], SimRequest | None] | None = None  # agent loops
    think_s: float = 0.0
    num_cached_tokens: int = 0
    ttft_s: float = 0.0
    done_s: float = 0.0


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 49_000) for _ in range(n)]


def agent_workload(rng: random.Random, num_sessions: int, num_turns: int, rate_per_s: float,
                   system_tokens: int = 1500) -> list[SimRequest]:
    """Sessions arrive as a Poisson process; each runs `num_turns` turns back to back."""
    system = _tokens(rng, system_tokens)
    first, clock = [], 0.0
    for session in range(num_sessions):
        clock += rng.expovariate(rate_per_s)
        request = _agent_turn(rng, session, list(system), 0, num_turns)
        request.arrival_s = clock
        first.append(request)
    return first


def _agent_turn(rng: random.Random, session: int, history: list[int], turn: int,
                num_turns: int) -> SimRequest:
    prompt = history + _tokens(rng, rng.randint(100, 200))
    request = SimRequest(session, prompt, rng.randint(32, 64), think_s=0.05)
    if turn + 1 < num_turns:
        request.next_turn = lambda output: _agent_turn(rng, session, prompt + output, turn + 1,
                                                       num_turns)
    return request


def shared_prefix_workload(rng: random.Random, num_groups: int, prompts_per_group: int,
                           rate_per_s: float, system_tokens: int = 1024, question_tokens: int = 128,
                           output_tokens: int = 64) -> list[SimRequest]:
    systems = [_tokens(rng, system_tokens) for _ in range(num_groups)]
    order = [g for g in range(num_groups) for _ in range(prompts_per_group)]
    rng.shuffle(order)
    clock, requests = 0.0, []
    for group in order:
        clock += rng.expovariate(rate_per_s)
        requests.append(SimRequest(group, systems[group] + _tokens(rng, question_tokens),
                                   output_tokens, arrival_s=clock))
    return requests


def zero_reuse_workload(rng: random.Random, num_requests: int, rate_per_s: float,
                        prompt_tokens: int = 1152, output_tokens: int = 64) -> list[SimRequest]:
    clock, requests = 0.0, []
    for i in range(num_requests):
        clock += rng.expovariate(rate_per_s)
        requests.append(SimRequest(i, _tokens(rng, prompt_tokens), output_tokens, arrival_s=clock))
    return requests


class LRUBlocks:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int]) -> int:
        return next((i for i, h in enumerate(hashes) if h not in self.blocks), len(hashes))

    def insert(self, hashes: Sequence[int]) -> list[int]:
        """Touch/insert; returns the evicted hashes."""
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        evicted = []
        while len(self.blocks) > self.num_blocks:
            evicted.append(self.blocks.popitem(last=False)[0])
        return evicted


@dataclass
class SimConfig:
    num_replicas: int = 8
    num_cache_blocks: int = 400
    prefill_s_per_token: float = 2.0e-4
    decode_s_per_token: float = 1.0e-3
    event_lag_s: float = 0.1
    tentative_ttl_s: float = 5.0
    scoring: ScoringConfig = ScoringConfig()


class Fleet:
    def __init__(self, config: SimConfig, policy: str) -> None:
        self.config, self.policy = config, policy
        n = config.num_replicas
        self.caches = [LRUBlocks(config.num_cache_blocks) for _ in range(n)]
        self.index: list[dict[int, float]] = [{} for _ in range(n)]  # hash -> expiry (0 = held)
        self.queues: list[deque[SimRequest]] = [deque() for _ in range(n)]
        self.busy_until = [0.0] * n
        self.busy_s = [0.0] * n
        self.inflight: list[list[int]] = [[] for _ in range(n)]  # uncached blocks, our estimate
        self._rr = itertools.count()

    def pick(self, request: SimRequest, now: float) -> int:
        n = self.config.num_replicas
        if self.policy == "round-robin":
            return next(self._rr) % n
        if self.policy == "least-load":
            return min(range(n), key=lambda r: (len(self.inflight[r]), r))
        if self.policy == "session-hash":
            return xxhash.xxh3_64_intdigest(str(request.session).encode()) % n
        if self.policy == "oracle":  # our scoring, but on the exact caches and queues
            pending = [set().union(*(q.hashes for q in self.queues[r])) if self.queues[r] else set()
                       for r in range(n)]
            runs = [max(self.caches[r].match(request.hashes), _run(request.hashes, pending[r]))
                    for r in range(n)]
        else:
            runs = [_run(request.hashes, self.index[r], now) for r in range(n)]
        loads = [CandidateLoad(str(r), runs[r], tuple(self.inflight[r])) for r in range(n)]
        first = request.hashes[0] if request.hashes else 0
        return choose(self.config.scoring, max(1, len(request.hashes)), first, loads)[0]


def _run(hashes: Sequence[int], held: dict[int, float] | set[int], now: float | None = None) -> int:
    for i, h in enumerate(hashes):
        if h not in held:
            return i
        if now is not None and isinstance(held, dict) and 0 < held[h] < now:
            return i
    return len(hashes)


@dataclass
class SimResult:
    requests: list[SimRequest]
    busy_s: list[float]

    @property
    def token_hit_ratio(self) -> float:
        return (sum(r.num_cached_tokens for r in self.requests)
                / max(1, sum(len(r.prompt) for r in self.requests)))

    def ttft_s(self, q: float) -> float:
        values = sorted(r.ttft_s for r in self.requests)
        return values[min(len(values) - 1, int(q / 100 * len(values)))]

    @property
    def output_tokens_per_s(self) -> float:
        start = min(r.arrival_s for r in self.requests)
        end = max(r.done_s for r in self.requests)
        return sum(r.num_output_tokens for r in self.requests) / max(1e-9, end - start)

    @property
    def imbalance(self) -> float:
        """max/mean of the replicas' busy time."""
        mean = sum(self.busy_s) / len(self.busy_s)
        return max(self.busy_s) / mean if mean else 1.0


def simulate(config: SimConfig, policy: str, first_requests: Sequence[SimRequest]) -> SimResult:
    """Run to completion; every request comes back with its timings and cached tokens filled in."""
    fleet = Fleet(config, policy)
    events: list[tuple[float, int, str, object]] = []
    seq = itertools.count()
    done: list[SimRequest] = []

    def push(time_s: float, kind: str, payload: object) -> None:
        heapq.heappush(events, (time_s, next(seq), kind, payload))

    def change_index(now: float, replica: int, added: Sequence[int],
                     removed: Sequence[int]) -> None:
        push(now + config.event_lag_s, "event", (replica, list(added), list(removed)))

    def start(replica: int, now: float) -> None:
        request = fleet.queues[replica].popleft()
        cache = fleet.caches[replica]
        matched = cache.match(request.hashes)
        request.num_cached_tokens = matched * BLOCK_SIZE
        prefill_s = config.prefill_s_per_token * (len(request.prompt) - request.num_cached_tokens)
        service_s = prefill_s + config.decode_s_per_token * request.num_output_tokens
        request.ttft_s = now + prefill_s - request.arrival_s
        change_index(now, replica, request.hashes, cache.insert(request.hashes))
        fleet.busy_until[replica] = now + service_s
        fleet.busy_s[replica] += service_s
        push(now + service_s, "done", (replica, request))

    for request in first_requests:
        push(request.arrival_s, "arrive", request)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            request = payload  # type: ignore[assignment]
            assert isinstance(request, SimRequest)
            request.hashes = hash_blocks(request.prompt, BLOCK_SIZE, "sim")
            replica = fleet.pick(request, now)
            uncached = len(request.hashes) - _run(request.hashes, fleet.index[replica], now)
            fleet.inflight[replica].append(uncached)
            for h in request.hashes:  # tentative entries (what the gateway inserts after deciding)
                if fleet.index[replica].get(h) != 0.0:
                    fleet.index[replica][h] = now + config.tentative_ttl_s
            fleet.queues[replica].append(request)
            if fleet.busy_until[replica] <= now and len(fleet.queues[replica]) == 1:
                start(replica, now)
        elif kind == "event":
            replica, added, removed = payload  # type: ignore[misc]
            for h in added:
                fleet.index[replica][h] = 0.0
            for h in removed:
                fleet.index[replica].pop(h, None)
        else:
            replica, request = payload  # type: ignore[misc]
            request.done_s = now
            done.append(request)
            fleet.inflight[replica].pop(0)
            output = _tokens(random.Random(request.session * 7919 + len(request.prompt)),
                             request.num_output_tokens)
            full = hash_blocks(request.prompt + output, BLOCK_SIZE, "sim",
                               parent_hashes=request.hashes)
            change_index(now, replica, full, fleet.caches[replica].insert(full))
            if request.next_turn is not None:
                follow = request.next_turn(output)
                if follow is not None:
                    follow.arrival_s = now + request.think_s
                    push(follow.arrival_s, "arrive", follow)
            if fleet.queues[replica]:
                start(replica, now)
    return SimResult(done, fleet.busy_s)
