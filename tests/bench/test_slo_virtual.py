"""The virtual clock of `aigw bench slo` (bench/slo_virtual.py) on the default model: idle time
costs no wall time and a request's times are its steps' CPU costs, the engine's step-time model
learns in the clock's unit, admission refuses at arrival as the server does (Retry-After, nothing
queued), and a cell cut at its drain leaves no request or KV block behind."""

from __future__ import annotations

import argparse
import time
from typing import Any

import pytest

from bench.slo_load import Arrival, summarize
from bench.slo_virtual import Lane, VirtualClock, build_engine, run_lanes
from bench.workloads import PlannedRequest, TokenSource


def _args(*flags: str) -> argparse.Namespace:
    from bench.slo_bench import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--threads", "1", "--kv-cache-memory", str(32 << 20), *flags])
    return args


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from bench.engine_bench import load_model
    from engine.loader import default_model_path

    return load_model(str(default_model_path()))[1]


@pytest.fixture(scope="module")
def slo_engine(tokenizer: Any) -> tuple[Any, VirtualClock]:
    """One engine under the slo policy with a 1 ms TTFT target: a request is refused whenever
    anything is queued ahead of it (a request finding an empty engine is always admitted)."""
    clock = VirtualClock()
    return build_engine(_args("--scheduler-policy", "slo", "--ttft-p90-ms", "1",
                              "--tpot-p90-ms", "100000"), clock), clock


def _lane(engine: Any, clock: VirtualClock, plan: list[Arrival], tokenizer: Any, *,
          drain_timeout_s: float = 60.0, ttft_s: float = 60.0, tpot_s: float = 60.0) -> Lane:
    return Lane("p", engine, clock, plan, TokenSource(tokenizer, seed=1), drain_timeout_s, ttft_s,
                tpot_s)


def test_idle_time_is_skipped_and_a_request_takes_its_steps_cpu_time(
        tokenizer: Any, slo_engine: tuple[Any, VirtualClock]) -> None:
    engine, clock = slo_engine
    assert engine.step_timer is time.thread_time
    start_s, num_steps_before = clock.t, engine.scheduler.step_costs.num_steps
    source = TokenSource(tokenizer, seed=3)
    plan = [Arrival(0.0, "default", [PlannedRequest(source.take(40), 3)]),
            Arrival(5000.0, "priority", [PlannedRequest(source.take(40), 3)])]
    steps: list[float] = []
    step = engine.step

    def counted_step() -> list[Any]:
        outputs = step()
        steps.append(engine.last_step_s)
        return outputs

    engine.step = counted_step
    lane = _lane(engine, clock, plan, tokenizer)
    started = time.perf_counter()
    try:
        run_lanes([lane])
    finally:
        del engine.step
    assert time.perf_counter() - started < 600.0  # the 5,000 s pause cost no wall time
    first, second = lane.records
    assert (first.status, second.status) == (200, 200)
    assert second.sent_s - start_s == pytest.approx(5000.0)  # the clock jumped the idle gap
    # each request alone: its time to the last token is the sum of its three steps' costs
    assert first.finish_s - first.sent_s == pytest.approx(sum(steps[:3]))
    assert second.finish_s - second.sent_s == pytest.approx(sum(steps[3:6]))
    assert 0.0 < first.ttft_s < first.finish_s and first.num_output_tokens == 3
    assert engine.scheduler.step_costs.num_steps - num_steps_before == len(steps) == 6
    assert clock.t - start_s == pytest.approx(5000.0 + sum(steps[3:]))
    cell = summarize(lane.records, 1.0, 10.0, 60.0, 60.0)
    assert (cell.num_good, cell.priority_num_sent, cell.num_refused) == (2, 1, 0)


def test_admission_refuses_at_arrival_and_a_cut_cell_leaves_nothing_behind(
        tokenizer: Any, slo_engine: tuple[Any, VirtualClock]) -> None:
    engine, clock = slo_engine
    source = TokenSource(tokenizer, seed=4)
    warm = [Arrival(10.0 * i, "default", [PlannedRequest(source.take(24), 2)]) for i in range(3)]
    run_lanes([_lane(engine, clock, warm, tokenizer)])  # fits the step-time model (4+ steps)
    assert engine.scheduler.step_costs.cost is not None
    burst = [Arrival(0.0, "default", [PlannedRequest(source.take(64), 50)]) for _ in range(6)]
    lane = _lane(engine, clock, burst, tokenizer, drain_timeout_s=0.0, ttft_s=0.001)
    num_prompt_before = engine.stats().num_prompt_tokens_total
    run_lanes([lane])
    refused = [r for r in lane.records if r.is_refused]
    admitted = [r for r in lane.records if not r.is_refused]
    assert len(lane.records) == 6 and refused and admitted  # the first finds no queue ahead
    assert all(r.retry_after and int(r.retry_after) >= 1 for r in refused)
    assert engine.stats().num_prompt_tokens_total - num_prompt_before == 64 * len(admitted)
    # the drain timeout of 0 cut the cell at once: nothing finished, nothing left in the engine
    assert all(r.finish_s is None for r in admitted)
    assert not engine.has_unfinished_requests and engine.kv_cache.num_requests == 0
    cell = summarize(lane.records, 1.0, 1.0, 0.001, 100.0)
    assert ((cell.num_refused, cell.num_unfinished, cell.num_good)
            == (len(refused), len(admitted), 0))


def test_the_step_log_writes_every_step_with_its_plan_and_costs(
        tokenizer: Any, slo_engine: tuple[Any, VirtualClock], tmp_path: Any) -> None:
    import json

    from bench.slo_virtual import StepLog

    engine, clock = slo_engine
    log = StepLog(str(tmp_path / "steps.jsonl"))
    log.attach("slo", engine, clock)
    log.cell = {"workload": "mixed", "rate": 1.0}
    source = TokenSource(tokenizer, seed=5)
    plan = [Arrival(0.0, "default", [PlannedRequest(source.take(40), 4)])]
    run_lanes([_lane(engine, clock, plan, tokenizer)])
    log.close()
    assert "record_step" not in vars(engine.scheduler)  # detached
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(lines) == 4  # the prompt's step (first token), then three decodes
    assert lines[0]["seqs"][0][1:] == [0, 40] and all(x["seqs"][0][2] == 1 for x in lines[1:])
    assert [x["seqs"][0][1] for x in lines[1:]] == [40, 41, 42]
    assert all(x["step_s"] > 0 and x["predicted_s"] > 0 for x in lines)
    assert lines[0]["workload"] == "mixed" and lines[0]["policy"] == "slo"
    assert lines[0]["t_s"] < lines[-1]["t_s"]
