"""Reserved shares (engine/reserved_shares.py) on the scheduler with fake requests (no model): a
project's share of the token budget and of the KV blocks holds against a flood from another
project while it has work, and is given back when it has none."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.request import Request
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
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                             max_num_seqs=max_num_seqs, reserved_shares=shares)
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
    # 25 blocks at the end
    acme = make_request(tokens(200, start=900_000), cache_salt=ACME, max_tokens=200)
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


# ---- taking a share back: others filled the pool and the seats before the project's burst --------
def _fill_then_burst(shares: tuple[tuple[str, float], ...], other_classes: tuple[int, ...],
                     acme_class: int = 0) -> tuple[Scheduler, list[Request], list[Request]]:
    """32 blocks, 4 seats: four other-project requests of 112 prompt tokens (7 blocks) decode and
    hold every seat and 28+ blocks; then acme's burst of two 40-token prompts arrives."""
    scheduler = make_scheduler(shares, num_blocks=32, max_num_batched_tokens=64, max_num_seqs=4)
    others = []
    for i, priority in enumerate(other_classes):
        request = make_request(tokens(112, start=10_000 * (i + 1)), cache_salt=OTHER, max_tokens=24,
                               request_id=f"other-{i}")
        request.priority = priority
        scheduler.add_request(request)
        others.append(request)
    while not all(r.num_output_tokens >= 2 for r in others):
        simulate_step(scheduler, scheduler.schedule())
    assert len(scheduler.running) == 4 and scheduler.kv_cache.num_free_blocks <= 4
    burst = []
    for i in range(2):
        request = make_request(tokens(40, start=900_000 + 1000 * i), cache_salt=ACME, max_tokens=8,
                               request_id=f"acme-{i}")
        request.priority = acme_class
        scheduler.add_request(request)
        burst.append(request)
    return scheduler, others, burst


def _finish(scheduler: Scheduler, requests: list[Request]) -> None:
    run_to_completion(scheduler)
    assert all(r.is_finished and r.num_output_tokens == r.max_num_tokens - r.num_prompt_tokens
               for r in requests)
    scheduler.kv_cache.check_integrity()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_a_reserved_project_takes_its_seats_and_blocks_back_from_other_projects() -> None:
    # the others are of every class (oldest first): priority, default, default, flex
    scheduler, others, burst = _fill_then_burst((("acme", 0.5),), (-1, 0, 0, 1))
    batch = scheduler.schedule()  # the step right after the burst arrived
    # two seats owed: the lowest class goes first, then the youngest of the next class
    assert batch.preempted_request_ids == ["other-3", "other-2"]
    scheduled = {s.request_id: s.num_scheduled_tokens for s in batch.sequences}
    # the rest, after 2 decodes
    assert scheduled["acme-0"] == 40 and scheduled["acme-1"] == 64 - 40 - 2
    assert scheduled["other-0"] == scheduled["other-1"] == 1  # the older ones keep decoding
    simulate_step(scheduler, batch)
    scheduler.kv_cache.check_integrity()
    assert burst[0].num_output_tokens == 1
    simulate_step(scheduler, scheduler.schedule())
    assert burst[1].num_output_tokens == 1  # the burst's first tokens within two steps
    _finish(scheduler, others + burst)
    assert all(r.num_preemptions == 0 for r in burst)
    assert [r.num_preemptions for r in others][:2] == [0, 0]


def test_without_a_share_the_burst_waits_for_the_others() -> None:
    scheduler, others, burst = _fill_then_burst((), (0, 0, 0, 0))
    num_steps = 0
    while burst[0].num_output_tokens == 0:
        batch = scheduler.schedule()
        assert not batch.preempted_request_ids or set(batch.preempted_request_ids) <= {
            r.request_id for r in others}
        simulate_step(scheduler, batch)
        num_steps += 1
    assert num_steps >= 15  # until the first of the others finished its 24 tokens
    _finish(scheduler, others + burst)


def test_a_reservation_holds_against_another_projects_higher_class() -> None:
    # the others are all priority-class: a reservation is capacity, whatever the others' class
    scheduler, others, burst = _fill_then_burst((("acme", 0.5),), (-1, -1, -1, -1), acme_class=1)
    batch = scheduler.schedule()
    assert batch.preempted_request_ids == ["other-3", "other-2"]
    assert {"acme-0", "acme-1"} <= {s.request_id for s in batch.sequences}
    simulate_step(scheduler, batch)
    # inside its share the flex burst is never preempted, though priority requests wait for seats
    while not all(r.is_finished for r in burst):
        batch = scheduler.schedule()
        assert not {"acme-0", "acme-1"} & set(batch.preempted_request_ids)
        simulate_step(scheduler, batch)
        scheduler.kv_cache.check_integrity()
    _finish(scheduler, others + burst)
    assert all(r.num_preemptions == 0 for r in burst)


def test_a_reserved_project_does_not_take_from_another_within_its_share() -> None:
    scheduler = make_scheduler((("acme", 0.25), ("beta", 0.5)), num_blocks=32,
                               max_num_batched_tokens=64, max_num_seqs=4)
    beta = [make_request(tokens(64, start=10_000 * (i + 1)), cache_salt="project:beta",
                         max_tokens=16)
            for i in range(2)]  # 2 seats and 10 blocks: within beta's half
    other = [make_request(tokens(64, start=50_000 * (i + 1)), cache_salt=OTHER, max_tokens=16)
             for i in range(2)]
    for request in beta + other:
        scheduler.add_request(request)
    while not all(r.num_output_tokens >= 1 for r in beta + other):
        simulate_step(scheduler, scheduler.schedule())
    acme = make_request(tokens(40, start=900_000), cache_salt=ACME, max_tokens=4)
    scheduler.add_request(acme)
    batch = scheduler.schedule()
    assert len(batch.preempted_request_ids) == 1
    assert batch.preempted_request_ids[0] in {r.request_id for r in other}  # never one of beta's
    assert acme.request_id in {s.request_id for s in batch.sequences}
    _finish(scheduler, beta + other + [acme])
    assert all(r.num_preemptions == 0 for r in beta + [acme])


@pytest.mark.parametrize("seed", [1, 2])
def test_mixed_projects_and_classes_under_kv_pressure_all_finish_and_leak_nothing(
        seed: int) -> None:
    """Random arrivals of three projects (two reserved) in every class into a small pool: every
    step the allocator is consistent; every request finishes with all its tokens (no livelock of
    taking back and readmitting); nothing leaks."""
    import random

    rng = random.Random(seed)
    scheduler = make_scheduler((("acme", 0.3), ("beta", 0.2)), num_blocks=40,
                               max_num_batched_tokens=64, max_num_seqs=6)
    salts = [ACME, "key:beta:k1", OTHER, None]
    requests: list[Request] = []
    for step in range(2000):
        if step < 150 and rng.random() < 0.4:
            request = make_request(tokens(rng.randint(4, 90), start=100_000 * (len(requests) + 1)),
                                   cache_salt=rng.choice(salts), max_tokens=rng.randint(1, 40))
            request.priority = rng.choice((-1, 0, 1))
            scheduler.add_request(request)
            requests.append(request)
        if not scheduler.num_unfinished and step >= 150:
            break
        batch = scheduler.schedule()
        simulate_step(scheduler, batch)
        scheduler.kv_cache.check_integrity()
    assert all(r.is_finished and r.num_tokens == r.max_num_tokens for r in requests)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert scheduler.kv_cache.num_requests == 0


def test_a_share_takes_back_one_seat_per_seat_owed_when_the_plan_caps_the_batch_below_it() -> None:
    # the slo policy's plan may cap the running batch below what runs (here 2 seats, 4 running):
    # acme (one seat owed) takes back one seat, not every seat above the cap
    from engine.slo import StepPlan

    scheduler = make_scheduler((("acme", 0.5),), num_blocks=64, max_num_batched_tokens=64,
                               max_num_seqs=4)
    others = [make_request(tokens(20, start=10_000 * (i + 1)), cache_salt=OTHER, max_tokens=30)
              for i in range(4)]
    for request in others:
        scheduler.add_request(request)
    simulate_step(scheduler, scheduler.schedule())
    assert len(scheduler.running) == 4
    scheduler._plan_step = lambda: StepPlan(64, 2)  # type: ignore[method-assign]
    acme = make_request(tokens(20, start=900_000), cache_salt=ACME, max_tokens=4)
    scheduler.add_request(acme)
    batch = scheduler.schedule()
    assert batch.preempted_request_ids == [others[-1].request_id]
    assert acme.request_id in {s.request_id for s in batch.sequences}
    simulate_step(scheduler, batch)
    run_to_completion(scheduler)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_a_reserved_project_is_found_behind_a_deep_queue_of_other_projects() -> None:
    # 300 of another project's requests wait ahead of acme's (more than the scan of the queue):
    # acme's share still gets its prompt in at the next step
    scheduler = make_scheduler((("acme", 0.25),), num_blocks=128, max_num_batched_tokens=64,
                               max_num_seqs=4)
    for i in range(300):
        scheduler.add_request(make_request(tokens(8, start=10_000 * (i + 1)), cache_salt=OTHER,
                                           max_tokens=6))
    simulate_step(scheduler, scheduler.schedule())
    assert len(scheduler.running) == 4 and len(scheduler.waiting) == 296
    acme = make_request(tokens(16, start=9_000_000), cache_salt=ACME, max_tokens=2)
    scheduler.add_request(acme)
    batch = scheduler.schedule()
    assert acme.request_id in {s.request_id for s in batch.sequences}
    assert len(batch.preempted_request_ids) == 1  # its one seat
    simulate_step(scheduler, batch)
    assert acme.num_output_tokens == 1
    _finish(scheduler, [acme])
