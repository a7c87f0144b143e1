"""The scheduler's next step plan under policy `slo`: what engine/slo.py::plan_step needs, read
from the running and waiting requests each step.

- the running decodes: how many, their contexts (attention work), and each one's time in hand
  (how long the next step may last and keep its mean gap within the plan's HEADROOM of the TPOT
  target; and how long it lends a higher class's prompt at risk: within LEND_HEADROOM);
- the prompts the step would prefill, in schedule order (class by class: running prompts, then
  waiting ones at their predicted cache hit), each at its position;
- of those whose class is above the lowest class decoding, the seconds left until their TTFT
  deadline (TTFT_HEADROOM of their class's bound after arrival) and the longest step they may ask
  for (engine/slo.py::deadline_step_s).

Pure functions of the requests and the clock's reading; the scheduler (engine/scheduler.py) calls
`plan_next_step` once a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

from engine.admission import class_ttft_target_ms
from engine.config import SchedulerConfig
from engine.request import Request
from engine.slo import (
    HEADROOM,
    LEND_HEADROOM,
    MAX_PLANNED_PREFILLS,
    PREFILL_STEP_TTFT_FRACTION,
    TTFT_HEADROOM,
    StepPlan,
    plan_step,
)
from engine.step_cost import StepCost

# (class, position its next chunk starts at, tokens left, arrival time on the scheduler's clock)
PlannedPrefill = tuple[int, int, int, float]


def plan_next_step(config: SchedulerConfig, cost: StepCost | None, running: Sequence[Request],
                   waiting: Iterable[Request], now_s: float) -> StepPlan:
    """The next step's token budget and seats: the fixed budget unless the policy is `slo`."""
    if config.policy != "slo":
        return StepPlan(config.max_num_batched_tokens, config.max_num_seqs)
    num_decodes = num_decode_pairs = 0
    slack_s: float | None = None
    # per class, the least slack of its running decodes: (how long a step they allow under the
    # plan's headroom, how long they lend a higher class's prompt at risk)
    slack_by_class: dict[int, tuple[float, float]] = {}
    gap_s = (config.tpot_p90_ms or 0.0) / 1000.0 * HEADROOM
    lend_gap_s = (config.tpot_p90_ms or 0.0) / 1000.0 * LEND_HEADROOM
    for r in running:
        if r.num_tokens - r.num_computed_tokens <= 1:
            num_decodes += 1
            num_decode_pairs += r.num_tokens  # (its context)
            # the longest step that keeps its mean gap within the target (its next token ends
            # gap number num_output_tokens)
            first_s = r.first_token_time if r.first_token_time is not None else now_s
            own_s = gap_s * max(r.num_output_tokens, 1) - (now_s - first_s)
            slack_s = own_s if slack_s is None else min(slack_s, own_s)
            lend_s = lend_gap_s * max(r.num_output_tokens, 1) - (now_s - first_s)
            held = slack_by_class.get(r.priority, (own_s, lend_s))
            slack_by_class[r.priority] = (min(held[0], own_s), min(held[1], lend_s))
    prefill_step_ms = (config.ttft_p90_ms * PREFILL_STEP_TTFT_FRACTION
                       if config.ttft_p90_ms else None)
    planned = planned_prefills(running, waiting)
    deadlines = (prefill_deadlines(config, planned, slack_by_class, prefill_step_ms, now_s)
                 if prefill_step_ms is not None else [])
    return plan_step(cost, num_decodes, config.tpot_p90_ms, config.max_num_batched_tokens,
                     config.max_num_seqs, [(start, num_left) for _, start, num_left, _ in planned],
                     num_decode_pairs, prefill_step_ms, slack_s, deadlines)


def prefill_deadlines(config: SchedulerConfig, planned: Sequence[PlannedPrefill],
                      slack_by_class: dict[int, tuple[float, float]], prefill_step_ms: float,
                      now_s: float) -> list[tuple[float, float]]:
    """(seconds until its TTFT deadline, the longest step it may ask for) of the first planned
    prompts whose class is above the lowest class decoding: a prompt at risk of its class's TTFT
    target takes step time from lower classes' streams up to what keeps each one's mean gap within
    LEND_HEADROOM of the TPOT target, and from its own class's or a higher one's only their slack
    under the plan's headroom (engine/slo.py::deadline_step_s)."""
    if not slack_by_class or config.ttft_p90_ms is None:
        return []
    lowest = max(slack_by_class)
    deadlines = []
    for priority, _, _, arrival_s in planned:
        if priority >= lowest:
            break  # (schedule order: the rest are of this class or lower)
        target_ms = class_ttft_target_ms(config.ttft_p90_ms, priority) or 0.0
        bound_s = min([prefill_step_ms / 1000.0]
                      + [own_s if c <= priority else lend_s
                         for c, (own_s, lend_s) in slack_by_class.items()])
        deadlines.append((arrival_s + target_ms / 1000.0 * TTFT_HEADROOM - now_s, bound_s))
    return deadlines


def planned_prefills(running: Sequence[Request], waiting: Iterable[Request]
                     ) -> list[PlannedPrefill]:
    """The prompts a step would prefill, in schedule order (class by class: its running prompts,
    then its waiting ones at their predicted cache hit); at most MAX_PLANNED_PREFILLS."""
    prefills: list[PlannedPrefill] = []
    for r in running:
        if r.num_tokens - r.num_computed_tokens > 1:
            prefills.append((r.priority, r.num_computed_tokens,
                             r.num_tokens - r.num_computed_tokens, r.arrival_time))
            if len(prefills) >= MAX_PLANNED_PREFILLS:
                break
    for r in islice(waiting, MAX_PLANNED_PREFILLS):
        cached = min(r.num_cached_tokens_predicted, r.num_tokens - 1)
        prefills.append((r.priority, cached, r.num_tokens - cached, r.arrival_time))
    prefills.sort(key=lambda p: p[0])  # (stable: running first within a class)
    return prefills[:MAX_PLANNED_PREFILLS]
