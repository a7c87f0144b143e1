"""Priority classes in the Scheduler (Request.priority: -1 priority, 0 default, 1 flex), driven with
fake requests and the fake compute step (tests/engine/fakes.py). No model."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from tests.engine.fakes import make_manager, make_request, run_to_completion, simulate_step, tokens

PRIORITY, DEFAULT, FLEX = -1, 0, 1


def make_scheduler(num_blocks: int = 256, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                             max_num_seqs=max_num_seqs, prefix_aware_window=8)
    return Scheduler(config, make_manager(num_blocks, enable_caching=False))


def classed(priority: int, num_prompt_tokens: int, start: int, max_tokens: int = 8,
            request_id: str | None = None) -> Request:
    request = make_request(tokens(num_prompt_tokens, start=start), max_tokens=max_tokens,
                           request_id=request_id)
    request.priority = priority
    return request


def test_a_flood_of_flex_requests_does_not_delay_a_priority_request() -> None:
    # 40 blocks of 16 tokens; 16 flex requests of 32 prompt tokens growing to 96 tokens each fill
    # the KV cache and every seat; a priority request arrives while they decode.
    scheduler = make_scheduler(num_blocks=40, max_num_batched_tokens=128, max_num_seqs=16)
    flood = [classed(FLEX, 32, start=1000 * (i + 1), max_tokens=64) for i in range(16)]
    for request in flood:
        scheduler.add_request(request)
    for _ in range(30):
        simulate_step(scheduler, scheduler.schedule())
        scheduler.kv_cache.check_integrity()
    assert scheduler.running and all(r.priority == FLEX for r in scheduler.running)
    assert scheduler.waiting, "the flood must be holding requests back"
    urgent = classed(PRIORITY, 100, start=90_000, max_tokens=20, request_id="urgent")
    scheduler.add_request(urgent)
    assert scheduler.waiting[0] is urgent  # ahead of every waiting flex request
    batch = scheduler.schedule()  # the very next step
    by_id = {s.request_id: s for s in batch.sequences}
    assert urgent.status == RequestStatus.RUNNING and "urgent" in by_id
    assert batch.sequences[0].request_id == "urgent"  # its prefill before the flex decodes
    assert by_id["urgent"].num_scheduled_tokens == 100
    assert batch.preempted_request_ids  # it made KV room by preempting flex requests
    assert all(scheduler.waiting[i].priority == FLEX for i in range(len(scheduler.waiting)))
    simulate_step(scheduler, batch)
    scheduler.kv_cache.check_integrity()
    # from then on it decodes every step until it finishes; it is never preempted
    while not urgent.is_finished:
        batch = scheduler.schedule()
        assert "urgent" in {s.request_id for s in batch.sequences}
        assert "urgent" not in batch.preempted_request_ids
        simulate_step(scheduler, batch)
        scheduler.kv_cache.check_integrity()
    assert urgent.num_preemptions == 0 and urgent.num_output_tokens == 20
    run_to_completion(scheduler)
    assert all(r.is_finished and r.num_output_tokens == 64 for r in flood)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_preemption_takes_the_lowest_class_first_then_the_youngest() -> None:
    # 9 blocks of 16 tokens; three requests of 30 prompt tokens each growing to 80 (5 blocks):
    # no two of them fit together to the end.
    scheduler = make_scheduler(num_blocks=9, max_num_batched_tokens=128)
    flex = classed(FLEX, 30, start=1000, max_tokens=50, request_id="flex")
    default_old = classed(DEFAULT, 30, start=2000, max_tokens=50, request_id="default-old")
    default_young = classed(DEFAULT, 30, start=3000, max_tokens=50, request_id="default-young")
    scheduler.add_request(flex)  # the oldest, but of the lowest class
    simulate_step(scheduler, scheduler.schedule())
    for request in (default_old, default_young):
        scheduler.add_request(request)
    preempted: list[str] = []
    for _ in range(1000):
        if not scheduler.num_unfinished:
            break
        batch = scheduler.schedule()
        for request_id in batch.preempted_request_ids:
            if request_id != "flex":  # a default request goes only once the flex one holds nothing
                assert flex not in scheduler.running
        preempted.extend(batch.preempted_request_ids)
        simulate_step(scheduler, batch)
        scheduler.kv_cache.check_integrity()
    assert preempted[0] == "flex"
    assert next(p for p in preempted if p != "flex") == "default-young"
    assert default_old.num_preemptions == 0  # the older of the class keeps its blocks
    assert all(r.is_finished and r.num_output_tokens == 50
               for r in (flex, default_old, default_young))
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_a_higher_class_is_never_preempted_for_a_lower_one() -> None:
    # 12 blocks: the two priority requests grow to 5 blocks each, the flex one to 5 too
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=128, max_num_seqs=4)
    urgent = [classed(PRIORITY, 30, start=1000 * (i + 1), max_tokens=50) for i in range(2)]
    for request in urgent:
        scheduler.add_request(request)
    simulate_step(scheduler, scheduler.schedule())
    late_flex = classed(FLEX, 30, start=50_000, max_tokens=40, request_id="late-flex")
    scheduler.add_request(late_flex)
    while any(not r.is_finished for r in urgent):
        batch = scheduler.schedule()
        assert not {r.request_id for r in urgent} & set(batch.preempted_request_ids)
        simulate_step(scheduler, batch)
        scheduler.kv_cache.check_integrity()
    assert all(r.num_preemptions == 0 for r in urgent)
    assert late_flex.num_preemptions >= 1  # it was admitted, and made room when they grew
    run_to_completion(scheduler)
    assert late_flex.is_finished and late_flex.num_output_tokens == 40
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_waiting_requests_are_admitted_in_class_order_and_fifo_within_a_class() -> None:
    # one seat: the admission order is the order requests are first scheduled in
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=1)
    arrivals = [("f1", FLEX), ("d1", DEFAULT), ("p1", PRIORITY), ("f2", FLEX), ("d2", DEFAULT),
                ("p2", PRIORITY), ("d3", DEFAULT)]
    requests = {name: classed(priority, 8, start=1000 * (i + 1), max_tokens=2, request_id=name)
                for i, (name, priority) in enumerate(arrivals)}
    for request in requests.values():
        scheduler.add_request(request)
    assert [r.request_id for r in scheduler.waiting] == ["p1", "p2", "d1", "d2", "d3", "f1", "f2"]
    order: list[str] = []
    for batch in run_to_completion(scheduler):
        order.extend(s.request_id for s in batch.sequences
                     if s.start_position == 0 and s.request_id not in order)
    assert order == ["p1", "p2", "d1", "d2", "d3", "f1", "f2"]
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_a_priority_arrival_takes_a_seat_from_a_flex_request() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    flex = [classed(FLEX, 8, start=1000 * (i + 1), max_tokens=30) for i in range(2)]
    default = classed(DEFAULT, 8, start=7000, max_tokens=30)
    for request in (*flex, default):
        scheduler.add_request(request)
    simulate_step(scheduler, scheduler.schedule())
    assert default in scheduler.running and len(scheduler.running) == 2  # default ran first
    urgent = classed(PRIORITY, 8, start=9000, max_tokens=3, request_id="urgent")
    scheduler.add_request(urgent)
    batch = scheduler.schedule()
    assert "urgent" in {s.request_id for s in batch.sequences}
    assert len(batch.preempted_request_ids) == 1
    assert batch.preempted_request_ids[0] in {r.request_id for r in flex}
    assert default in scheduler.running  # the default request keeps its seat
    simulate_step(scheduler, batch)
    run_to_completion(scheduler)
    assert all(r.is_finished for r in (*flex, default, urgent))
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


# ---- flex aging (engine/flex_aging.py) -----------------------------------------------------------
def _flex_under_a_default_stream(flex_max_wait_ms: float,
                                 num_steps: int = 80) -> tuple[Request, int | None]:
    """One seat; one default request arrives every step and takes one step (8 prompt tokens, one
    output token), so a default request always waits. A flex request arrives first. A virtual clock
    of one second per step. Returns the flex request and the step it was first scheduled in."""
    now = [0.0]
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1,
                             flex_max_wait_ms=flex_max_wait_ms)
    scheduler = Scheduler(config, make_manager(256, enable_caching=False), clock=lambda: now[0])
    flex = classed(FLEX, 8, start=500_000, max_tokens=4, request_id="flex")
    flex.arrival_time = now[0]
    scheduler.add_request(flex)
    first_step = None
    for step in range(num_steps):
        default = classed(DEFAULT, 8, start=1000 * (step + 1), max_tokens=1)
        default.arrival_time = now[0]
        scheduler.add_request(default)
        batch = scheduler.schedule()
        if first_step is None and "flex" in {s.request_id for s in batch.sequences}:
            first_step = step
        simulate_step(scheduler, batch)
        now[0] += 1.0
    return flex, first_step


def test_a_flex_request_starves_under_a_steady_default_stream_without_aging() -> None:
    flex, first_step = _flex_under_a_default_stream(float("inf"))
    assert first_step is None and flex.priority == FLEX


def test_an_aged_flex_request_is_scheduled_as_default_within_its_bound() -> None:
    flex, first_step = _flex_under_a_default_stream(10_000.0)  # 10 steps of the virtual clock
    # promoted past 10 s, ahead of later defaults
    assert first_step is not None and 10 < first_step <= 12
    assert flex.priority == DEFAULT and flex.is_finished


def test_an_aged_flex_request_queues_behind_older_defaults_and_ahead_of_younger_ones() -> None:
    now = [0.0]
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, flex_max_wait_ms=5_000.0)
    scheduler = Scheduler(config, make_manager(256, enable_caching=False), clock=lambda: now[0])
    for name, priority, arrival in [("d-old", DEFAULT, 0.0), ("flex", FLEX, 1.0),
                                    ("d-young", DEFAULT, 2.0),
                                    ("p", PRIORITY, 3.0), ("flex-young", FLEX, 4.0)]:
        request = classed(priority, 8, start=len(name) * 1000 + int(arrival) * 100, request_id=name)
        request.arrival_time = arrival
        scheduler.add_request(request)
    now[0] = 6.5  # flex waited 5.5 s, flex-young 2.5 s
    assert scheduler.aging.promote(scheduler.waiting, now[0]) == 1
    assert ([r.request_id for r in scheduler.waiting]
            == ["p", "d-old", "flex", "d-young", "flex-young"])
    now[0] = 9.5
    scheduler.schedule()  # flex-young is promoted too, behind every default that waited before it
    assert [r.request_id for r in scheduler.waiting][-2:] == ["d-young", "flex-young"]
    assert all(r.priority <= DEFAULT for r in scheduler.waiting)
    run_to_completion(scheduler)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_a_preempted_flex_request_waits_again_from_its_preemption() -> None:
    now = [0.0]
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, flex_max_wait_ms=5_000.0)
    scheduler = Scheduler(config, make_manager(256, enable_caching=False), clock=lambda: now[0])
    flex = classed(FLEX, 8, start=1000, max_tokens=20, request_id="flex")
    flex.arrival_time = 0.0
    scheduler.add_request(flex)
    now[0] = 4.0
    simulate_step(scheduler, scheduler.schedule())  # admitted after 4 s
    now[0] = 20.0
    scheduler.add_request(classed(DEFAULT, 8, start=2000, max_tokens=20))
    batch = scheduler.schedule()  # the default request takes its seat
    assert batch.preempted_request_ids == ["flex"] and flex.priority == FLEX
    now[0] = 24.0
    scheduler.schedule()
    assert flex.priority == FLEX  # 4 s since its preemption, not 24 since its arrival
    now[0] = 25.5
    scheduler.schedule()
    assert flex.priority == DEFAULT
    run_to_completion(scheduler)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_flex_max_wait_is_validated() -> None:
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="flex_max_wait_ms"):
            SchedulerConfig(flex_max_wait_ms=bad)
    assert SchedulerConfig(flex_max_wait_ms=float("inf")).flex_max_wait_ms == float("inf")


def test_the_flex_wait_bound_follows_the_ttft_target() -> None:
    from engine.flex_aging import flex_max_wait_s

    # 2 x flex's 4 x target
    assert flex_max_wait_s(SchedulerConfig(ttft_p90_ms=500.0)) == 2 * 4 * 0.5
    assert flex_max_wait_s(SchedulerConfig()) == 60.0
    assert flex_max_wait_s(SchedulerConfig(ttft_p90_ms=500.0, flex_max_wait_ms=1500.0)) == 1.5


def test_a_higher_class_prompt_leaves_every_running_decode_its_token() -> None:
    # four default requests stream; a long priority prompt arrives. Its chunks go first (class
    # order) but take the budget less a token per decode: no stream skips a step while it
    # prefills (the SLO run's default decodes stalled ~22 steps behind priority prompts)
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=16)
    streams = [classed(DEFAULT, 8, start=1000 * (i + 1), max_tokens=40) for i in range(4)]
    for request in streams:
        scheduler.add_request(request)
    simulate_step(scheduler, scheduler.schedule())  # their prompts; each decodes from now on
    urgent = classed(PRIORITY, 300, start=90_000, max_tokens=4, request_id="urgent")
    scheduler.add_request(urgent)
    chunks = []
    while urgent.num_computed_tokens < urgent.num_prompt_tokens:
        batch = scheduler.schedule()
        by_id = {s.request_id: s.num_scheduled_tokens for s in batch.sequences}
        assert all(by_id.get(r.request_id) == 1 for r in streams)  # every stream, every step
        assert batch.num_scheduled_tokens <= 64
        chunks.append(by_id["urgent"])
        simulate_step(scheduler, batch)
    assert chunks[:-1] == [60] * (len(chunks) - 1)  # the budget less the four decodes' tokens
    assert sum(chunks) == 300
    run_to_completion(scheduler)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_the_step_plan_spends_only_the_slack_every_stream_has() -> None:
    from engine.slo import HEADROOM
    from engine.step_cost import StepCost, StepCostModel

    now = [100.0]
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, prefix_aware_window=8,
                             policy="slo", tpot_p90_ms=100.0, ttft_p90_ms=4000.0)
    scheduler = Scheduler(config, make_manager(256, enable_caching=False), clock=lambda: now[0])
    model = StepCostModel()
    model.cost = StepCost(base_s=0.010, prefill_s_per_token=0.001, decode_s_per_seq=0.002)
    scheduler.step_costs = model
    ahead, fresh = (classed(DEFAULT, 8, start=s, max_tokens=40) for s in (1000, 2000))
    for request in (ahead, fresh):
        scheduler.add_request(request)
    simulate_step(scheduler, scheduler.schedule())  # both decode from here on
    scheduler.add_request(classed(DEFAULT, 2000, start=5000, max_tokens=2))
    gap_s = 0.100 * HEADROOM
    for request in (ahead, fresh):
        request.output_token_ids.extend([7] * 10)  # 11 tokens: 10 gaps so far
        request.num_computed_tokens += 10  # (as if their blocks held them: the plan reads counts)
    ahead.first_token_time = now[0] - 10 * 0.02  # short gaps: 0.6 s in hand
    fresh.first_token_time = now[0] - 10 * gap_s  # exactly on target: nothing in hand
    flat = scheduler._plan_step()
    fresh.first_token_time = ahead.first_token_time
    spent = scheduler._plan_step()
    # the fresh stream has no slack: the flat step (base + 2 decodes + chunk = 80 ms)
    assert flat.token_budget - 2 == int((gap_s - 0.014) / 0.001 + 1e-6)
    # both ahead: gap * 11 - 0.2 s = 0.68 s, capped at a tenth of the TTFT target (0.4 s)
    assert spent.token_budget - 2 == int((0.4 - 0.014) / 0.001 + 1e-6)


def test_a_prompt_at_risk_of_its_ttft_takes_step_time_from_lower_classes_only() -> None:
    from engine.step_cost import StepCost, StepCostModel

    def planned_prefill_tokens(prompt_class: int, stream_classes: tuple[int, ...],
                               num_gaps: int = 10) -> int:
        now = [100.0]
        config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16,
                                 prefix_aware_window=8, policy="slo", tpot_p90_ms=100.0,
                                 ttft_p90_ms=1000.0)
        scheduler = Scheduler(config, make_manager(256, enable_caching=False),
                              clock=lambda: now[0])
        model = StepCostModel()
        model.cost = StepCost(base_s=0.010, prefill_s_per_token=0.001, decode_s_per_seq=0.002)
        scheduler.step_costs = model
        streams = [classed(c, 8, start=1000 * (i + 1), max_tokens=40)
                   for i, c in enumerate(stream_classes)]
        for request in streams:
            scheduler.add_request(request)
        simulate_step(scheduler, scheduler.schedule())  # they decode from here on
        for request in streams:  # num_gaps gaps so far, each on the plan's target (80 ms)
            request.output_token_ids.extend([7] * num_gaps)
            request.num_computed_tokens += num_gaps  # (as if their blocks held them)
            request.first_token_time = now[0] - num_gaps * 0.080
        # 0.8 s of prefill due in 0.9 s (TTFT_HEADROOM of 1 s): it needs ~89% of each step
        urgent = classed(prompt_class, 800, start=90_000, max_tokens=2)
        urgent.arrival_time = now[0]
        scheduler.add_request(urgent)
        plan = scheduler._plan_step()
        return plan.token_budget - len(streams)

    overhead_s = 0.010 + 2 * 0.002

    def tokens_in(step_s: float) -> int:
        return int((step_s - overhead_s) / 0.001 + 1e-6)

    flat = tokens_in(0.080)
    # lower classes' streams lend what keeps their mean gap within 0.9 x 100 ms: 11 gaps at
    # 90 ms less the 0.8 s so far = 0.19 s, so the step stretches to its bound, a tenth of the
    # TTFT target; streams that just started lend only their next gap's 90 ms
    assert planned_prefill_tokens(PRIORITY, (DEFAULT, FLEX)) == tokens_in(0.1)
    assert planned_prefill_tokens(PRIORITY, (DEFAULT, FLEX), num_gaps=0) == tokens_in(0.090)
    # a stream of its own class (or a higher one) keeps its step: no time taken from it
    assert planned_prefill_tokens(PRIORITY, (PRIORITY, DEFAULT)) == flat
    assert planned_prefill_tokens(DEFAULT, (DEFAULT, DEFAULT)) == flat
    assert planned_prefill_tokens(DEFAULT, (FLEX, FLEX)) > flat  # flex yields to default too
