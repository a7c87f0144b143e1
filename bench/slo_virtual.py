"""The virtual clock of `aigw bench slo` (`--clock virtual`, the default): both policies' engines
in this process, driven directly (no HTTP), each on its own clock, over the same weights.

A policy's clock stands still while its engine is idle and jumps to the next arrival; a step
advances it by the step's cost, the CPU time of the thread that ran it (time.thread_time: what the
step takes on an otherwise idle machine with `--threads` cores, the torch worker threads working
alongside; other processes' load does not stretch it, which on a shared machine stretches wall
time many times over). The engine measures that same cost with the same timer
(LLMEngine(step_timer=time.thread_time)), so the SLO policy's step-time model, its step plan and
admission's prediction work in the unit the clock runs in. Arrivals are the Poisson plan of the
wall-clock run (bench/slo_load.py) in virtual seconds; admission is asked at arrival as the
replica server asks it (engine.admission), and a refusal is the server's 429 with Retry-After.

Within a cell the two lanes interleave, the one furthest behind in its own time stepped next, so a
burst of load on the machine falls on both at the same point of the workload. After the arrival
window a cell runs until every request is answered, until `drain_timeout_s` (virtual) has passed,
or until no request still unanswered can meet its targets (it has waited past the TTFT target
without a first token, or its decode already took longer than the TPOT target allows): cutting
then changes no request's verdict, and the fixed budget's hopeless backlog costs no run time.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from bench.slo_load import Arrival, SloRecord
from bench.workloads import AgentSession, PlannedRequest, TokenSource
from contracts.replica_protocol import SERVICE_TIER_PRIORITY


class VirtualClock:
    """A policy's seconds: advanced by its engine's step costs, jumped over idle time. Inside a
    step (`begin_step` .. `end_step`) it runs on with the step's thread CPU time, so what the
    engine stamps at the step's end (a first token's time, which the slo plan's stream slack is
    counted from) reads the step's end, as the wall clock would."""

    def __init__(self) -> None:
        self.t = 0.0
        self._step_started: float | None = None

    def __call__(self) -> float:
        if self._step_started is None:
            return self.t
        return self.t + time.thread_time() - self._step_started

    def begin_step(self) -> None:
        self._step_started = time.thread_time()

    def end_step(self, step_s: float) -> None:
        self._step_started = None
        self.t += step_s


def build_engine(args: Any, clock: VirtualClock) -> Any:
    """An LLMEngine configured from `args` over the process's shared checkpoint, on `clock`, with
    its steps measured in thread CPU time (the clock's unit)."""
    from bench.engine_bench import load_model
    from engine.engine import LLMEngine
    from engine.engine_args import engine_config_from_args
    from engine.model_runner import ModelRunner

    config = engine_config_from_args(args)
    checkpoint, tokenizer = load_model(config.model_path)
    runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))
    runner.warmup()
    return LLMEngine(config, checkpoint.config, runner, tokenizer, clock=clock,
                     step_timer=time.thread_time)


@dataclass(frozen=True)
class SingleRequestCosts:
    """One request alone on an idle engine, in the step timer's seconds (thread CPU time)."""

    short_prefill_s: float
    long_prefill_s: float
    decode_step_s: float  # the median decode step of one sequence
    num_short_tokens: int
    num_long_tokens: int

    def line(self) -> str:
        return (f"single request, thread CPU time: prefill {self.num_short_tokens} tokens "
                f"{self.short_prefill_s * 1000:.0f} ms, {self.num_long_tokens} tokens "
                f"{self.long_prefill_s * 1000:.0f} ms; decode step {self.decode_step_s * 1000:.1f} "
                "ms")


def probe_costs(engine: Any, source: TokenSource, num_short: int,
                num_long: int) -> SingleRequestCosts:
    """Single-request step costs on `engine` (its step-time model learns them too); the prefix
    cache is reset afterwards."""
    from contracts.sampling_params import SamplingParams

    def run(prompt: list[int], max_tokens: int) -> list[float]:
        engine.add_request(f"probe-{next(_probe_ids)}", prompt,
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        costs = []
        while engine.has_unfinished_requests:
            engine.step()
            costs.append(engine.last_step_s)
        return costs

    short = min(min(run(source.take(num_short), 1)) for _ in range(3))
    long = sum(run(source.take(num_long), 1))  # (chunked over steps beyond the token budget)
    decodes = sorted(run(source.take(num_short), 9)[1:])
    engine.reset_prefix_cache()
    engine.publish_load()
    return SingleRequestCosts(short, long, decodes[len(decodes) // 2], num_short, num_long)


_probe_ids = itertools.count()


@dataclass
class _Client:
    """One arrival's requests, sent one after another."""

    service_tier: str
    turns: list[PlannedRequest] | AgentSession
    index: int = 0
    previous: list[int] | None = None

    def next_request(self) -> PlannedRequest | None:
        if isinstance(self.turns, AgentSession):
            return self.turns.next_request(self.previous)
        if self.index >= len(self.turns):
            return None
        self.index += 1
        return self.turns[self.index - 1]


@dataclass
class _Active:
    record: SloRecord
    client: int
    max_tokens: int


@dataclass
class Lane:
    """One policy's engine driven through one cell's plan on the policy's clock."""

    policy: str
    engine: Any
    clock: VirtualClock
    plan: list[Arrival]
    filler: TokenSource  # the planned answers appended to an agent's context
    drain_timeout_s: float
    ttft_target_s: float
    tpot_target_s: float
    step_log: StepLog | None = None  # `--step-log`: each admission decision is a line too
    records: list[SloRecord] = field(default_factory=list)
    done: bool = False

    def __post_init__(self) -> None:
        self._start = self.clock.t
        self._window_end = self._start + max((a.at_s for a in self.plan), default=0.0)
        self._clients = [_Client(a.service_tier,
                                 a.turns.fresh() if isinstance(a.turns, AgentSession)
                                 else list(a.turns)) for a in self.plan]
        self._order = itertools.count()
        self._due = [(self._start + a.at_s, next(self._order), i) for i, a in enumerate(self.plan)]
        heapq.heapify(self._due)
        self._active: dict[str, _Active] = {}
        self._ids = itertools.count()

    @property
    def elapsed_s(self) -> float:
        return self.clock.t - self._start

    def advance(self) -> None:
        """Send what is due, then one engine step (or, idle, jump to the next arrival)."""
        now = self.clock.t
        while self._due and self._due[0][0] <= now:
            self._send(heapq.heappop(self._due)[2], now)
        if not self._due and now >= self._window_end and self._is_settled(now):
            self._cut()
            return
        if not self.engine.has_unfinished_requests:
            if self._due:
                self.clock.t = max(now, self._due[0][0])
            else:
                self.done = True
            return
        self.clock.begin_step()
        outputs = self.engine.step()
        self.clock.end_step(self.engine.last_step_s)
        self._collect(outputs, self.clock.t)

    def _send(self, client_index: int, now: float) -> None:
        from contracts.sampling_params import SamplingParams

        client = self._clients[client_index]
        planned = client.next_request()
        if planned is None:
            return
        record = SloRecord(client.service_tier, len(planned.prompt_token_ids), now)
        self.records.append(record)
        priority = SERVICE_TIER_PRIORITY[client.service_tier]
        # asked as the replica server asks (engine/server/serving.py)
        prompt = planned.prompt_token_ids
        admission = self.engine.admission(priority, len(prompt), 0,
                                          self.engine.num_cached_prefix_tokens(prompt, None))
        request_id = f"{self.policy}-{next(self._ids)}" if admission.is_admitted else None
        if self.step_log is not None:
            self.step_log.admission(self.policy, now, request_id, client.service_tier,
                                    len(prompt), admission)
        if request_id is None:  # the server's 429 + Retry-After; the next turn follows
            record.status, record.retry_after = 429, str(admission.retry_after_s)
            self._next_turn(client_index, planned.max_tokens, now)
            return
        params = SamplingParams(temperature=0.0, max_tokens=planned.max_tokens, ignore_eos=True)
        self.engine.add_request(request_id, planned.prompt_token_ids, params, priority=priority)
        self.engine.publish_load()  # the next arrival at this instant sees this one queued
        self._active[request_id] = _Active(record, client_index, planned.max_tokens)

    def _next_turn(self, client_index: int, num_answer_tokens: int, now: float) -> None:
        client = self._clients[client_index]
        if isinstance(client.turns, AgentSession):
            client.previous = self.filler.take(num_answer_tokens)  # the planned answer, as context
        heapq.heappush(self._due, (now, next(self._order), client_index))

    def _collect(self, outputs: list[Any], now: float) -> None:
        for output in outputs:
            active = self._active.get(output.request_id)
            if active is None:
                continue
            record = active.record
            if output.new_token_ids and record.first_token_s is None:
                record.first_token_s = now
            if output.finished:
                del self._active[output.request_id]
                record.status, record.finish_s = 200, now
                record.num_output_tokens = output.num_output_tokens
                self._next_turn(active.client, active.max_tokens, now)

    def _is_settled(self, now: float) -> bool:
        """Past the window: drained, out of drain time, or nothing unanswered can meet its
        targets."""
        if now - self._window_end >= self.drain_timeout_s:
            return True
        for active in self._active.values():
            record = active.record
            if record.first_token_s is None:
                if now - record.sent_s <= self.ttft_target_s:
                    return False
            elif now - record.first_token_s <= self.tpot_target_s * max(active.max_tokens - 1, 1):
                return False
        return True

    def _cut(self) -> None:
        """Abort what is left (recorded unanswered, as the wall-clock run's drain cut does)."""
        for request_id in list(self._active):
            self.engine.abort_request(request_id)
        self._active.clear()
        self.engine.publish_load()
        self.done = True


class StepLog:
    """`--step-log`: one JSON line per engine step of a lane, for tracing which steps overrun the
    plan and why. Attached by wrapping the scheduler's `record_step` (nothing runs without it):

        {"policy", "workload", "rate", "t_s" (the policy's clock before the step), "step_s"
         (measured), "predicted_s" (the step-time model before it learnt this step), "token_budget",
         "max_num_running", "num_running", "num_waiting", "preempted": [ids],
         "seqs": [[request id, start position, tokens], ...]}

    and one per arrival, the admission decision taken on it:

        {"policy", "workload", "rate", "t_s", "admission": request id (null: refused),
         "service_tier", "num_prompt_tokens", "queue_ms", "ttft_ms" (predicted), "target_ms"}
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "w")  # noqa: SIM115 (closed by close())
        self.cell: dict[str, Any] = {}
        self._attached: list[Any] = []  # schedulers whose record_step close() restores

    def attach(self, policy: str, engine: Any, clock: VirtualClock) -> None:
        import json

        from engine.step_cost import attention_pairs

        scheduler = engine.scheduler
        record_step = scheduler.record_step

        def logged(batch: Any, step_s: float) -> None:
            cost = scheduler.step_costs.cost
            seqs = [[s.request_id, s.start_position, s.num_scheduled_tokens]
                    for s in batch.sequences]
            num_decodes = sum(1 for _, _, n in seqs if n == 1)
            pairs = sum(attention_pairs(start, n) for _, start, n in seqs)
            predicted = (None if cost is None else
                         cost.step_s(batch.num_scheduled_tokens - num_decodes, num_decodes, pairs))
            self._file.write(json.dumps({
                "policy": policy, **self.cell, "t_s": clock.t, "step_s": step_s,
                "predicted_s": predicted, "token_budget": scheduler.plan.token_budget,
                "max_num_running": scheduler.plan.max_num_running,
                "num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
                "preempted": list(batch.preempted_request_ids), "seqs": seqs}) + "\n")
            record_step(batch, step_s)

        scheduler.record_step = logged
        self._attached.append(scheduler)

    def admission(self, policy: str, t_s: float, request_id: str | None, service_tier: str,
                  num_prompt_tokens: int, admission: Any) -> None:
        import json

        self._file.write(json.dumps({
            "policy": policy, **self.cell, "t_s": t_s, "admission": request_id,
            "service_tier": service_tier, "num_prompt_tokens": num_prompt_tokens,
            "queue_ms": admission.queue_ms, "ttft_ms": admission.ttft_ms,
            "target_ms": admission.target_ms}) + "\n")

    def close(self) -> None:
        for scheduler in self._attached:
            del scheduler.record_step  # (the instance attribute: the method again)
        self._attached.clear()
        self._file.close()


def run_lanes(lanes: list[Lane]) -> None:
    """All lanes to their end, the one furthest behind in its own time stepped next."""
    while live := [lane for lane in lanes if not lane.done]:
        min(live, key=lambda lane: lane.elapsed_s).advance()
    for lane in lanes:
        lane.engine.reset_prefix_cache()  # each cell starts cold, alike for every policy
        lane.engine.kv_cache.check_integrity()
