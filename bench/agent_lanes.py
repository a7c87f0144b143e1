"""The lanes of `aigw bench agent --pauses` (bench/agent_pauses.py): one mode's engine driven
through the plan on its own clock, the agent turns it records, and the breakdown of each mode's
slowest turns.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bench.plotting import fmt, percentile

if TYPE_CHECKING:
    from bench.agent_pauses import Plan

AGENT_SALT, BACKGROUND_SALT = "project:agents", "project:batch"


@dataclass
class Turn:
    session: int
    num_prompt_tokens: int
    arrival_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    num_cached_tokens: int = 0
    turn_index: int = 0
    backlog_tokens: int = 0  # tokens the engine still had to compute when this turn arrived
    num_host_tokens: int = 0  # of the cached tokens, restored from the host tier
    queue_s: float = 0.0  # arrival to first scheduled
    output_ids: list[int] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s


class Lane:
    """One mode's engine driven through the plan on its own clock.

    Virtual clock (the default): the clock stands still while the engine is idle and jumps to the
    next arrival (a pause costs no wall time), and a step advances it by the step's cost: the CPU
    time of the thread that ran it (`step_cost="cpu"`: what the step takes on an otherwise idle
    machine with `--threads` cores, the torch worker threads working alongside; immune to other
    processes' load, which on a shared machine stretches wall time many times over), or its wall
    time (`"wall"`). Wall clock: time.perf_counter from the lane's start, idle gaps slept through
    (the lanes then run one after another)."""

    def __init__(self, mode: str, plan: Plan, retain_s: float, virtual: bool,
                 step_cost: str = "cpu") -> None:
        self.mode, self.plan, self.retain_s, self.virtual = mode, plan, retain_s, virtual
        self._cost_clock = time.thread_time if virtual and step_cost == "cpu" else time.perf_counter
        self.engine: Any = None
        self._t0 = time.perf_counter()
        self.t = 0.0  # the virtual clock
        self.clients = [s.fresh() for s in plan.sessions]
        # (time, order, session or -1 - background index)
        self.due: list[tuple[float, int, int]] = []
        self._order = itertools.count()
        for i, start in enumerate(plan.starts_s):
            heapq.heappush(self.due, (start, next(self._order), i))
        for k, (at, _) in enumerate(plan.background):
            heapq.heappush(self.due, (at, next(self._order), -1 - k))
        self.turns: list[Turn] = []
        self.active: dict[str, Turn | None] = {}
        self.previous: dict[int, list[int] | None] = dict.fromkeys(range(len(self.clients)))
        self.num_done = [0] * len(self.clients)
        self._ids = itertools.count()
        self.step_s = 0.0  # cost of the engine's steps (the step-cost clock's seconds)

    def now(self) -> float:
        return self.t if self.virtual else time.perf_counter() - self._t0

    def start(self, engine: Any) -> None:
        self.engine, self._t0, self.t = engine, time.perf_counter(), 0.0

    @property
    def done(self) -> bool:
        return not self.due and not self.active

    def advance(self) -> None:
        """Admit what is due, then one engine step (or, idle, wait for the next arrival)."""
        from contracts.sampling_params import SamplingParams

        engine, now = self.engine, self.now()
        while self.due and self.due[0][0] <= now:
            _, _, who = heapq.heappop(self.due)
            request_id = f"p{next(self._ids)}"
            if who < 0:
                prompt = self.plan.background[-1 - who][1]
                engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                                      ignore_eos=True),
                                   cache_salt=BACKGROUND_SALT)
                self.active[request_id] = None
                continue
            planned = self.clients[who].next_request(self.previous[who])
            if planned is None:
                continue
            backlog = sum(r.num_tokens - r.num_computed_tokens
                          for r in (*engine.scheduler.waiting, *engine.scheduler.running))
            turn = Turn(who, len(planned.prompt_token_ids), now, turn_index=self.num_done[who],
                        backlog_tokens=backlog)
            self.turns.append(turn)
            params = SamplingParams(temperature=0.0, max_tokens=planned.max_tokens, ignore_eos=True)
            engine.add_request(request_id, planned.prompt_token_ids, params, cache_salt=AGENT_SALT,
                               retain_s=self.retain_s,
                               retention_id=f"session-{who}" if self.retain_s else None)
            self.active[request_id] = turn
        if not engine.has_unfinished_requests:
            if self.due and self.virtual:
                self.t = max(self.t, self.due[0][0])
            elif self.due:
                time.sleep(max(0.0, min(self.due[0][0] - self.now(), 0.05)))
            return
        started = self._cost_clock()
        outputs = engine.step()
        elapsed = self._cost_clock() - started
        self.step_s += elapsed
        self.t += elapsed
        self._collect(outputs, self.now())

    def _collect(self, outputs: list[Any], now: float) -> None:
        for output in outputs:
            turn = self.active.get(output.request_id)
            if turn is not None:
                if output.new_token_ids and turn.first_token_s is None:
                    turn.first_token_s = now
                turn.output_ids.extend(output.new_token_ids)
            if not output.finished:
                continue
            del self.active[output.request_id]
            if turn is None:
                continue
            turn.finish_s, turn.num_cached_tokens = now, output.num_cached_tokens
            turn.num_host_tokens = int(output.timings.get("num_host_cached_tokens", 0))
            turn.queue_s = output.timings.get("queue_s", 0.0)
            self.previous[turn.session] = turn.output_ids
            pause = self.plan.pauses_s[turn.session][self.num_done[turn.session]]
            self.num_done[turn.session] += 1
            heapq.heappush(self.due, (now + pause, next(self._order), turn.session))


def run_lanes(lanes: list[Lane], make_engine: Any) -> None:
    """Wall clock: each lane to its end, one after another. Virtual clock: all lanes at once, the
    one furthest behind in its own time stepped next, so a burst of load on the machine lands on
    every mode at the same point of the workload (the modes are compared within one stretch of
    time)."""
    if not lanes:
        return
    if not lanes[0].virtual:
        for lane in lanes:
            lane.start(make_engine(lane))
            while not lane.done:
                lane.advance()
            lane.engine.kv_cache.check_integrity()
        return
    for lane in lanes:
        lane.start(make_engine(lane))
    while live := [lane for lane in lanes if not lane.done]:
        min(live, key=lambda lane: lane.t).advance()
    for lane in lanes:
        lane.engine.kv_cache.check_integrity()


def turn_record(t: Turn) -> dict[str, Any]:
    return {"session": t.session, "turn": t.turn_index, "arrival_s": round(t.arrival_s, 3),
            "ttft_s": round(t.ttft_s, 3), "queue_s": round(t.queue_s, 3),
            "num_prompt_tokens": t.num_prompt_tokens, "num_cached_tokens": t.num_cached_tokens,
            "num_host_tokens": t.num_host_tokens, "backlog_tokens": t.backlog_tokens}


def tail_breakdown(lanes: list[Lane]) -> list[str]:
    """Per mode: the turns at or above its TTFT p90, each with what it computed against the
    oracle's same turn, where its cached tokens came from, and what it queued behind."""
    oracle = {(t.session, t.turn_index): t for lane in lanes if lane.mode == "oracle"
              for t in lane.turns}
    lines = ["tail turns (TTFT >= the mode's p90): session/turn TTFT, uncached tokens (oracle's), "
             "host-tier tokens, queue, backlog at arrival"]
    for lane in lanes:
        p90 = percentile([t.ttft_s for t in lane.turns], 90)
        if p90 is None:
            continue
        tail = sorted((t for t in lane.turns if t.ttft_s >= p90), key=lambda t: -t.ttft_s)
        cells = []
        for t in tail:
            o = oracle.get((t.session, t.turn_index))
            same = f" ({o.num_prompt_tokens - o.num_cached_tokens})" if o is not None else ""
            cells.append(f"s{t.session}/t{t.turn_index} {t.ttft_s:.2f}s, "
                         f"{t.num_prompt_tokens - t.num_cached_tokens}{same} uncached, "
                         f"{t.num_host_tokens} host, queue {t.queue_s:.2f}s, backlog "
                         f"{t.backlog_tokens}")
        uncached = sum(t.num_prompt_tokens - t.num_cached_tokens for t in lane.turns)
        queue = percentile([t.queue_s for t in lane.turns], 50)
        lines.append(f"  {lane.mode}: p90 {p90:.2f} s, {uncached} uncached tokens in all, queue "
                     "p50 "
                     f"{fmt(queue, 3)} s; " + "; ".join(cells))
    return lines
