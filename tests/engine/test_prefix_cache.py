"""Prompt caching on the real model: exact cached_tokens, no partial-block sharing, outputs
identical with the cache on and off (also under eviction pressure), tenant isolation by cache salt,
clean ref counts after aborts, and a KV event stream that replays to exactly the hashes the replica
holds."""

from __future__ import annotations

import random
from typing import Any

import pytest

from contracts.kv_events import BlockRemoved, apply_events
from contracts.sampling_params import SamplingParams
from engine.engine import LLMEngine
from tests.engine.conftest import EngineFactory
from tests.engine.fakes import Completion, assert_idle_and_clean, collect, generate

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SYSTEM = ("You are a support agent for a bicycle shop. Answer politely, mention the warranty when "
          "it applies, never invent prices, and keep every answer under three sentences. ") * 3
QUESTIONS = ["Do you repair carbon frames?", "When do you open on Sundays?", "Can I rent a tandem?",
             "How long does a tune-up take?", "Do you sell helmets for children?",
             "Is parking free?"]


def conversation(tokenizer: Any, question: str, system: str = SYSTEM) -> list[int]:
    return tokenizer.encode_chat([{"role": "system", "content": system},
                                  {"role": "user", "content": question}])


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_cached_tokens(cached_sequence: list[int], prompt: list[int]) -> int:
    """Full blocks of the shared part, but never the prompt's last token (its logits are needed)."""
    shared = common_prefix_len(cached_sequence, prompt)
    return min(shared // BLOCK_SIZE, (len(prompt) - 1) // BLOCK_SIZE) * BLOCK_SIZE


def test_shared_prefix_hits_report_exact_cached_tokens(make_engine: EngineFactory,
                                                       tokenizer: Any) -> None:
    engine = make_engine(fresh=True)
    first = conversation(tokenizer, QUESTIONS[0])
    warm = generate(engine, {"first": first}, GREEDY)["first"]
    assert warm.num_cached_tokens == 0
    later = {f"q{i}": conversation(tokenizer, q) for i, q in enumerate(QUESTIONS[1:4])}
    results = generate(engine, later, GREEDY)
    for name, prompt in later.items():
        expected = expected_cached_tokens(first + warm.token_ids, prompt)
        assert expected >= 96
        assert results[name].num_cached_tokens == expected
    repeat = generate(engine, {"repeat": first}, GREEDY)["repeat"]
    assert repeat.num_cached_tokens == (len(first) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert repeat.token_ids == warm.token_ids
    stats = engine.stats()
    assert stats.num_prefix_cache_hit_tokens == (sum(r.num_cached_tokens for r in results.values())
                                                 + repeat.num_cached_tokens)
    assert_idle_and_clean(engine)


def test_requests_in_the_same_batch_reuse_each_others_blocks(make_engine: EngineFactory,
                                                             tokenizer: Any) -> None:
    engine = make_engine(fresh=True)
    prompts = {f"q{i}": conversation(tokenizer, q) for i, q in enumerate(QUESTIONS[:3])}
    results = generate(engine, prompts, GREEDY)
    assert results["q0"].num_cached_tokens == 0
    for name in ("q1", "q2"):
        assert (results[name].num_cached_tokens
                == expected_cached_tokens(prompts["q0"], prompts[name]))
    alone = generate(make_engine(enable_prefix_caching=False), prompts, GREEDY)
    assert ({k: v.token_ids for k, v in results.items()}
            == {k: v.token_ids for k, v in alone.items()})


def test_a_partial_block_is_never_shared(make_engine: EngineFactory, tokenizer: Any) -> None:
    engine = make_engine(fresh=True)
    prompt = conversation(tokenizer, QUESTIONS[0])
    assert len(prompt) % BLOCK_SIZE != 0
    generate(engine, {"a": prompt}, SamplingParams(temperature=0.0, max_tokens=1))
    # Same prompt, but diverging inside the last, partial block: only the full blocks before it hit.
    diverging = prompt[:-1] + [prompt[-1] + 1]
    hit = generate(engine, {"b": diverging}, GREEDY)["b"]
    assert hit.num_cached_tokens == len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    # A prompt of exactly k full blocks reuses only k-1 of them: its last token is always computed.
    exact = prompt[: len(prompt) // BLOCK_SIZE * BLOCK_SIZE]
    again = generate(engine, {"c": exact}, GREEDY)["c"]
    assert again.num_cached_tokens == len(exact) - BLOCK_SIZE
    held = {b.block_hash for b in engine.kv_cache.pool.blocks if b.block_hash is not None}
    assert held == set(engine.kv_cache.pool.cached_hashes())
    assert_idle_and_clean(engine)


def test_different_salts_never_share(make_engine: EngineFactory, tokenizer: Any) -> None:
    engine = make_engine(fresh=True)
    prompt = conversation(tokenizer, QUESTIONS[2])
    tenant_a = generate(engine, {"a1": prompt}, GREEDY, cache_salt="project-a")["a1"]
    tenant_b = generate(engine, {"b1": prompt}, GREEDY, cache_salt="project-b")["b1"]
    unsalted = generate(engine, {"n1": prompt}, GREEDY)["n1"]
    assert tenant_b.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    tenant_a_again = generate(engine, {"a2": prompt}, GREEDY, cache_salt="project-a")["a2"]
    assert tenant_a_again.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert (tenant_a.token_ids == tenant_b.token_ids == unsalted.token_ids
            == tenant_a_again.token_ids)


def _workload_prompts(tokenizer: Any, num_questions: int = len(QUESTIONS)) -> dict[str, list[int]]:
    other_system = "You are a chef. Suggest one recipe and nothing else. " * 4
    prompts = {}
    for i, question in enumerate(QUESTIONS[:num_questions]):
        prompts[f"shop{i}"] = conversation(tokenizer, question)
        prompts[f"chef{i}"] = conversation(tokenizer, question, system=other_system)
    return prompts


@pytest.fixture(scope="module")
def workload(tokenizer: Any) -> dict[str, list[int]]:
    return _workload_prompts(tokenizer, num_questions=3)


@pytest.fixture(scope="module")
def outputs_without_cache(make_engine: EngineFactory,
                          workload: dict[str, list[int]]) -> dict[str, list[int]]:
    results = generate(make_engine(enable_prefix_caching=False), workload, GREEDY)
    return {name: r.token_ids for name, r in results.items()}


def test_greedy_outputs_are_identical_with_the_cache_on_and_off(
        make_engine: EngineFactory, workload: dict[str, list[int]],
        outputs_without_cache: dict[str, list[int]]) -> None:
    engine = make_engine(fresh=True)
    generate(engine, {"seed": workload["shop0"]}, GREEDY)
    on = generate(engine, workload, GREEDY)
    assert sum(r.num_cached_tokens for r in on.values()) > 300
    assert {k: v.token_ids for k, v in on.items()} == outputs_without_cache


def test_greedy_outputs_are_identical_under_eviction_pressure(
        make_engine: EngineFactory, engine: LLMEngine, workload: dict[str, list[int]],
        outputs_without_cache: dict[str, list[int]]) -> None:
    tiny = make_engine(kv_cache_memory_bytes=16 * engine.runner.bytes_per_block,
                       max_num_batched_tokens=128, fresh=True)
    results: dict[str, Completion] = {}
    # each evicts some of the last
    for name in ("shop0", "shop1", "chef0", "shop2", "chef1", "chef2"):
        results.update(generate(tiny, {name: workload[name]}, GREEDY))
    page = tiny.kv_events.since(0)
    assert page is not None
    # evictions happened
    assert any(isinstance(e, BlockRemoved) for b in page.batches for e in b.events)
    assert sum(r.num_cached_tokens for r in results.values()) > 0  # and hits still happened
    assert {k: v.token_ids for k, v in results.items()} == outputs_without_cache
    assert_idle_and_clean(tiny)


@pytest.fixture(scope="module")
def random_workload(make_engine: EngineFactory, tokenizer: Any) -> LLMEngine:
    """A fresh engine after a random mix of shared-prefix requests, salts, aborts, preemptions and
    one cache reset."""
    bytes_per_block = make_engine().runner.bytes_per_block
    engine = make_engine(kv_cache_memory_bytes=16 * bytes_per_block, max_num_batched_tokens=128,
                         fresh=True)
    rng = random.Random(99)
    prompts = list(_workload_prompts(tokenizer).values())
    results: dict[str, Completion] = {}
    live: list[str] = []
    for step in range(400):
        if step < 80 and rng.random() < 0.4:
            request_id = f"w{step}"
            engine.add_request(request_id, rng.choice(prompts),
                               SamplingParams(temperature=0.0, max_tokens=16),
                               cache_salt=rng.choice([None, None, "tenant"]))
            live.append(request_id)
        if live and rng.random() < 0.08:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        if step == 40:
            engine.reset_prefix_cache()
        if not engine.has_unfinished_requests and step >= 80:
            break
        for output in engine.step():
            collect(results, output)
            if output.finished and output.request_id in live:
                live.remove(output.request_id)
        engine.kv_cache.check_integrity()
    assert not engine.has_unfinished_requests
    assert sum(r.num_cached_tokens for r in results.values()) > 0
    assert engine.stats().num_preemptions_total > 0  # preemption was part of the mix
    return engine


def test_random_workload_with_aborts_leaves_integrity_and_zero_ref_counts(
        random_workload: LLMEngine) -> None:
    assert_idle_and_clean(random_workload)
    assert random_workload.kv_cache.pool.num_cached_blocks > 0


def test_event_stream_replayed_from_zero_reproduces_the_held_hashes(
        random_workload: LLMEngine) -> None:
    page = random_workload.kv_events.since(0)
    assert page is not None
    # no gaps
    assert [b.seq for b in page.batches] == list(range(1, random_workload.kv_events.last_seq + 1))
    held: set[int] = set()
    for batch in page.batches:
        apply_events(held, batch.events)
    snapshot = random_workload.kv_snapshot()
    assert snapshot.seq == random_workload.kv_events.last_seq
    assert held == set(snapshot.block_hashes) == set(random_workload.kv_cache.pool.cached_hashes())
