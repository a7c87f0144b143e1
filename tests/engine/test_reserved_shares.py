"""Reserved shares (engine/reserved_shares.py) on the scheduler with fake requests (no model): a
project's share of the token budget and of the KV blocks holds against a flood from another
project while it has work, and is given back when it has none."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.reserved_shares import project_of
from engine.scheduler import Scheduler
from tests.engine.fakes import (
    BLOCK_SIZE,
    make_manager,
    make_request,
    run_to_completion,
    simulate_step,
    tokens,
)

ACME, OTHER = "project:acme", "project:other"


def make_scheduler(shares: tuple[tuple[str, float], ...], num_blocks: int = 512,
                   max_num_batched_tokens: int = 64, max_num_seqs: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             reserved_shares=shares)
    return Scheduler(config, make_manager(num_blocks, enable_caching=False))


@pytest.mark.parametrize(("salt", "project"), [
    ("project:acme", "acme"), ("key:acme:k1", "acme"), ("key:a:b:k2", "a:b"), (None, None),
    ("", None), ("other", None), ("project:", None)])
def test_the_project_is_the_one_in_the_cache_salt(salt: str | None, project: str | None) -> None:
    assert project_of(salt) == project


def _acme_tokens_per_step(shares: tuple[tuple[str, float], ...]) -> list[int]:
    scheduler = make_scheduler(shares)
    for i in range(6):  # the flood arrives first: 6 x 400 prompt tokens of another project
        scheduler.add_request(make_request(tokens(400, start=10_000 * (i + 1)), cache_salt=OTHER))
    acme = make_request(tokens(256, start=900_000), cache_salt=ACME, max_tokens=4)
    scheduler.add_request(acme)
    per_step = []
    while acme.num_output_tokens == 0:
        batch = scheduler.schedule()
        per_step.append(sum(s.num_scheduled_tokens for s in batch.sequences
                            if s.request_id == acme.request_id))
        simulate_step(scheduler, batch)
    run_to_completion(scheduler)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    return per_step


def test_a_reserved_share_of_the_token_budget_holds_against_another_projects_flood() -> None:
    reserved = _acme_tokens_per_step((("acme", 0.5),))
    assert all(n >= 32 for n in reserved)  # half of every step's 64 tokens, from the first step
    assert len(reserved) == 256 // 32
    unreserved = _acme_tokens_per_step(())
    assert unreserved[:30] == [0] * 30  # first come, first served: behind the flood's 2,400 tokens
    assert len(unreserved) > 3 * len(reserved)


def test_an_idle_reservation_is_given_back_to_other_projects() -> None:
    scheduler = make_scheduler((("acme", 0.5),))
    for i in range(4):
        scheduler.add_request(make_request(tokens(300, start=10_000 * (i + 1)), cache_salt=OTHER))
    batch = scheduler.schedule()
    assert batch.num_scheduled_tokens == 64  # acme has no work: the whole budget is the flood's
    run_to_completion(scheduler)


def test_a_reserved_share_of_the_kv_blocks_holds_while_the_project_has_work() -> None:
    num_blocks = 64
    scheduler = make_scheduler((("acme", 0.25),), num_blocks=num_blocks, max_num_batched_tokens=256)
    for i in range(16):  # would take every block: 16 x (64 + 64) tokens = 128 blocks
        scheduler.add_request(make_request(tokens(64, start=10_000 * (i + 1)), cache_salt=OTHER,
                                           max_tokens=64))
    acme = make_request(tokens(200, start=900_000), cache_salt=ACME, max_tokens=200)  # 25 blocks at the end
    scheduler.add_request(acme)
    acme_share = num_blocks // 4
    while not acme.is_finished:
        batch = scheduler.schedule()
        others = [r for r in scheduler.running if r.cache_salt == OTHER]
        held_by_others = sum(-(-r.num_computed_tokens // BLOCK_SIZE) for r in others)
        held_by_acme = -(-acme.num_computed_tokens // BLOCK_SIZE)
        # other projects never hold blocks that acme's unmet reservation needs
        assert held_by_others <= num_blocks - max(acme_share - held_by_acme, 0) + len(others)
        simulate_step(scheduler, batch)
        scheduler.kv_cache.check_integrity()
    assert acme.num_preemptions == 0
    run_to_completion(scheduler)
    assert scheduler.kv_cache.num_free_blocks == num_blocks


def test_two_reserved_projects_each_keep_their_share() -> None:
    scheduler = make_scheduler((("acme", 0.25), ("beta", 0.25)))
    for i in range(4):
        scheduler.add_request(make_request(tokens(400, start=10_000 * (i + 1)), cache_salt=OTHER))
    acme = make_request(tokens(160, start=800_000), cache_salt=ACME, max_tokens=2)
    beta = make_request(tokens(160, start=900_000), cache_salt="key:beta:k9", max_tokens=2)
    scheduler.add_request(acme)
    scheduler.add_request(beta)
    batch = scheduler.schedule()
    by_id = {s.request_id: s.num_scheduled_tokens for s in batch.sequences}
    assert by_id[acme.request_id] == 16 and by_id[beta.request_id] == 16
    assert batch.num_scheduled_tokens == 64
    simulate_step(scheduler, batch)
    run_to_completion(scheduler)


def test_reserved_shares_are_validated() -> None:
    with pytest.raises(ValueError, match="0.9"):
        SchedulerConfig(reserved_shares=(("a", 0.5), ("b", 0.5)))
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        SchedulerConfig(reserved_shares=(("a", 0.0),))
    with pytest.raises(ValueError, match="each project once"):
        SchedulerConfig(reserved_shares=(("a", 0.2), ("a", 0.2)))
