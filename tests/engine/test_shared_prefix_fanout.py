"""Fan-out: N requests that share a new (uncached) prefix and arrive together prefill it once.

Why it holds (docs/design/architecture.md, "Concurrent requests with the same new prefix"): the
leader's blocks become findable by hash when they are allocated for the step that writes them;
running requests take the token budget first, so a follower is admitted only in the step that
schedules the leader's last prefix chunk (or later); every layer stores the whole step's K/V before
it attends, so a follower reading the leader's blocks in that same step reads them written. Checked
with the fake scheduler driver (any budget) and on the real model (tokens prefilled counted by the
engine's stats, outputs equal to a run without the prefix cache, an abort of the leader
mid-prefill)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from contracts.sampling_params import SamplingParams
from engine.config import SchedulerConfig
from engine.request import Request
from engine.scheduler import Scheduler
from engine.server.metrics import _EngineStatsCollector
from tests.engine.conftest import EngineFactory
from tests.engine.fakes import (
    BLOCK_SIZE,
    Completion,
    assert_idle_and_clean,
    collect,
    drive,
    make_manager,
    make_request,
    run_to_completion,
    simulate_step,
    tokens,
)

N = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("budget", [256, 512, 2048, 8192])
def test_eight_requests_sharing_a_new_prefix_prefill_it_once(budget: int) -> None:
    manager = make_manager(2000)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), manager)
    prefix = tokens(2000)  # 125 blocks, in no cache yet
    for i in range(N):
        scheduler.add_request(make_request(prefix + tokens(100, start=5000 + 1000 * i),
                                           max_tokens=4))
    run_to_completion(scheduler)  # checks the manager's integrity after every step
    assert scheduler.num_prompt_tokens_computed_total == len(prefix) + N * 100
    assert manager.num_hit_tokens == (N - 1) * len(prefix)
    manager.check_integrity()
    assert manager.num_requests == 0 and manager.num_free_blocks == manager.num_blocks


def _fanout_prompts(tokenizer: Any) -> dict[str, list[int]]:
    system = ("You orchestrate subagents for a code review. Each subagent reads one file of the "
              "change, reports bugs with line numbers, and never rewrites code it was not asked "
              "to. ") * 3
    return {f"sub{i}": tokenizer.encode_chat([{"role": "system", "content": system},
                                              {"role": "user",
                                               "content": f"Review file number {i}."}])
            for i in range(N)}


def _shared_len(prompts: dict[str, list[int]]) -> int:
    first, *rest = prompts.values()
    n = 0
    while all(n < len(p) and p[n] == first[n] for p in rest):
        n += 1
    return n


@pytest.fixture(scope="module")
def uncached_outputs(make_engine: EngineFactory, tokenizer: Any) -> dict[str, list[int]]:
    """Every fan-out prompt's greedy tokens from an engine without the prefix cache (computed
    once)."""
    plain = make_engine(max_num_batched_tokens=64, enable_prefix_caching=False, fresh=True)
    prompts = _fanout_prompts(tokenizer)
    for request_id, prompt in prompts.items():
        plain.add_request(request_id, prompt, GREEDY)
    outputs = {k: v.token_ids for k, v in drive(plain).items()}
    assert plain.stats().num_prompt_tokens_computed_total == sum(len(p) for p in prompts.values())
    return outputs


def test_fanout_on_the_real_model_costs_one_prefill_of_the_prefix(
        make_engine: EngineFactory, tokenizer: Any, uncached_outputs: dict[str, list[int]]) -> None:
    prompts = _fanout_prompts(tokenizer)
    shared = _shared_len(prompts)
    assert shared >= 6 * BLOCK_SIZE  # several blocks, new to the engine below
    engine = make_engine(max_num_batched_tokens=64, fresh=True)  # the leader needs several chunks
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    results = drive(engine)
    stats = engine.stats()
    total = sum(len(p) for p in prompts.values())
    suffixes = total - N * shared
    assert stats.num_prompt_tokens_computed_total == total - stats.num_prefix_cache_hit_tokens
    # one prefill of the prefix, plus each request's own tail (and the partial block each re-reads)
    assert stats.num_prompt_tokens_computed_total <= shared + suffixes + N * BLOCK_SIZE
    assert stats.num_prefix_cache_hit_tokens >= (N - 1) * (shared // BLOCK_SIZE) * BLOCK_SIZE
    metrics = {m.name: m.samples[0].value
               for m in _EngineStatsCollector(engine.stats, {"replica": "r"}).collect()}
    assert metrics["aigw_replica_prompt_tokens_computed"] == stats.num_prompt_tokens_computed_total
    assert_idle_and_clean(engine)
    assert {k: v.token_ids for k, v in results.items()} == uncached_outputs


def test_aborting_the_leader_mid_prefill_leaves_followers_correct_and_no_block_leaked(
        make_engine: EngineFactory, tokenizer: Any, uncached_outputs: dict[str, list[int]]) -> None:
    prompts = _fanout_prompts(tokenizer)
    engine = make_engine(max_num_batched_tokens=64, fresh=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    results: dict[str, Completion] = {}
    for output in engine.step():  # the leader's first chunk only: the followers still wait
        collect(results, output)
    assert engine.stats().num_prompt_tokens_computed_total == 64
    assert engine.stats().num_running_requests == 1
    aborted = engine.abort_request("sub0")
    assert aborted is not None and aborted.finished
    engine.kv_cache.check_integrity()
    for request_id, completion in drive(engine).items():
        results[request_id] = completion
    assert_idle_and_clean(engine)
    followers = [k for k in prompts if k != "sub0"]
    assert ({k: results[k].token_ids for k in followers}
            == {k: uncached_outputs[k] for k in followers})
    assert all(results[k].num_cached_tokens >= 64 for k in followers)  # the leader's written chunk


@pytest.mark.parametrize("seed", range(16))
def test_staggered_followers_among_other_requests_still_share_the_leaders_prefill(
        seed: int) -> None:
    """Followers arriving over the leader's first steps, unrelated requests in between, any budget:
    the prefix is prefilled once (each follower may redo the partial block where it diverges)."""
    rng = random.Random(seed)
    budget = rng.choice([64, 128, 256, 512, 2048])
    manager = make_manager(3000)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64), manager)
    prefix = tokens(rng.randrange(100, 2000))
    arrivals: dict[int, list[Request]] = {}
    for i in range(N):
        prompt = prefix + tokens(rng.randrange(1, 100), start=5000 + 1000 * i)
        arrivals.setdefault(rng.randrange(6), []).append(
            make_request(prompt, max_tokens=rng.randrange(1, 6)))
    for j in range(rng.randrange(4)):
        other = make_request(tokens(rng.randrange(1, 300), start=100_000 + 1000 * j), max_tokens=20)
        arrivals.setdefault(rng.randrange(6), []).append(other)
    requests = [r for arriving in arrivals.values() for r in arriving]
    num_tails = sum(r.num_prompt_tokens - len(prefix) for r in requests
                    if r.prompt_token_ids[:len(prefix)] == prefix)
    num_others = sum(r.num_prompt_tokens for r in requests
                     if r.prompt_token_ids[:len(prefix)] != prefix)
    step = 0
    while step < 6 or scheduler.num_unfinished:
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        simulate_step(scheduler, scheduler.schedule())
        manager.check_integrity()
        step += 1
    assert scheduler.num_preemptions_total == 0
    extra = scheduler.num_prompt_tokens_computed_total - (len(prefix) + num_tails + num_others)
    assert 0 <= extra <= N * (BLOCK_SIZE - 1)
