"""Latency targets: the step plan that keeps running decodes inside their TPOT target while prefill
takes the rest of the step.

Everything here is a pure function or a small value object; the scheduler (engine/scheduler.py)
owns one `StepCostModel` and calls these each step; admission control's prediction from the
plan is engine/admission.py.

The step-time model (engine/step_cost.py): base + per prefill token + per
decoding sequence + per attention pair, fitted from every step the engine runs.

The control loop (`plan_step`, policy `slo` with a TPOT target): a step must last at most
`tpot_target * HEADROOM` (each running decode gets one token per step, so a step's time is their
time per output token). The running decodes' share of it is fixed (base + their cost); prefill takes
the rest, at least MIN_PREFILL_TOKENS so prompts always advance: the prompts the step would
prefill, in schedule order, each chunk costed at its position in its prompt. New sequences are
admitted to the running batch only while the batch's decodes alone (plus that minimum prefill)
still fit the step. A step with no decodes streams no tokens: it is bounded by `prefill_step_ms`
instead (the scheduler passes PREFILL_STEP_TTFT_FRACTION of the TTFT target: the most a request
arriving during it waits for the step to end), so prompts prefill in larger, cheaper chunks while
nothing decodes.

A decode's TPOT is its mean gap, (last token - first token) / gaps: a stream whose steps so far ran
shorter than the target (no prompt prefilled beside it) has time in hand. With `decode_slack_s`
(the least, over the running decodes, of `tpot_target * HEADROOM * gaps after this step - time
since its first token`) the step may last that long, up to the same `prefill_step_ms` bound: every
stream's mean gap still stays within `tpot_target * HEADROOM`, and a prompt waiting for prefill
gets the time the streams did not use.

    |<------------------ tpot_target * HEADROOM ------------------>|
    | base_s | decode_s_per_seq * num_decodes | prefill (the rest) |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from engine.step_cost import StepCost, attention_pairs

HEADROOM = 0.8  # the step aims at 80% of the TPOT target: the target is a p90, steps are noisy
PREFILL_STEP_TTFT_FRACTION = 0.1  # a step without decodes: at most this much of the TTFT target
MAX_PLANNED_PREFILLS = 8  # prompts a step plan costs chunk by chunk (the rest: at position 0)
MIN_PREFILL_TOKENS = 16  # prefill's floor per step while any prompt waits
TTFT_HEADROOM = 0.9  # a prompt at risk is pushed to end its prefill within this much of its target
# a lower class's stream lends a prompt at risk the steps that keep its mean gap within this much
# of the TPOT target (its own plan aims at HEADROOM)
LEND_HEADROOM = 0.9


@dataclass(frozen=True)
class StepPlan:
    """What one step may schedule: tokens in all, and sequences in the running batch."""

    token_budget: int
    max_num_running: int
    # seconds of prefill work a step of this plan holds beside its decodes (None: no time bound,
    # the token budget alone: the fixed budget); admission's rate of prefill
    prefill_room_s: float | None = None
    # seconds of prefill a step may hold for a prompt whose TTFT deadline is at risk, beside
    # decodes of lower classes only (`prefill_deadlines`; None: no such bound): admission's rate
    # for a class above a class that decodes
    deadline_room_s: float | None = None


def plan_step(cost: StepCost | None, num_decodes: int, tpot_target_ms: float | None,
              max_num_batched_tokens: int, max_num_seqs: int,
              prefills: Sequence[tuple[int, int]] = (), num_decode_pairs: int = 0,
              prefill_step_ms: float | None = None,
              decode_slack_s: float | None = None,
              prefill_deadlines: Sequence[tuple[float, float]] = ()) -> StepPlan:
    """The next step's budget under the `slo` policy (module docstring); the fixed budget when
    there is no TPOT target, nothing measured yet, or a target this machine cannot meet even
    with one sequence and the minimum prefill (shrinking the batch would then cost throughput and
    buy no latency).

    `prefills`: (position its chunk starts at, tokens left) of the prompts the step would prefill,
    in schedule order (at most MAX_PLANNED_PREFILLS are costed; tokens past them count as a prompt
    at position 0). `num_decode_pairs`: the decodes' contexts (their attention pairs).
    `prefill_step_ms`: the step's bound when nothing decodes (None: the token budget alone), and
    the most a step spends of the decodes' slack; `decode_slack_s`: the longest step that keeps
    every running decode's mean gap within the target (module docstring; None: the flat target).
    `prefill_deadlines`: for the first prompts of `prefills`, (seconds left until its deadline,
    the longest step it may ask for): the step lasts at least as long as the most urgent of them
    needs to prefill by its deadline (`deadline_step_s`), within its bound."""
    fixed = StepPlan(max_num_batched_tokens, max_num_seqs)
    if cost is None or not tpot_target_ms:
        return fixed
    step_target_s = tpot_target_ms / 1000.0 * HEADROOM
    floor_s = cost.step_s(MIN_PREFILL_TOKENS, 1, attention_pairs(0, MIN_PREFILL_TOKENS))
    if floor_s > tpot_target_ms / 1000.0:
        return fixed
    # a floor step past the headroom but inside the target itself: the floor (prefill's minimum),
    # and seats while the floor fits the target (no cliff to the fixed budget as the fit wobbles)
    seat_target_s = step_target_s if floor_s <= step_target_s else tpot_target_ms / 1000.0
    max_prefill = max(max_num_batched_tokens - num_decodes, 0)
    seats = _max_seats(cost, seat_target_s, num_decodes, num_decode_pairs, max_num_seqs)
    if num_decodes == 0:  # nothing streams: the step only delays what arrives meanwhile
        if prefill_step_ms is None:
            return StepPlan(max_num_batched_tokens, seats)
        step_target_s = max(step_target_s, prefill_step_ms / 1000.0)
    decodes_s = cost.step_s(0, num_decodes, num_decode_pairs)
    room_s = max(step_target_s - decodes_s, 0.0)  # (admission's rate: the slack is not lasting)
    if num_decodes and decode_slack_s is not None and prefill_step_ms is not None:
        step_target_s = min(max(step_target_s, decode_slack_s),
                            max(step_target_s, prefill_step_ms / 1000.0))
    if prefill_deadlines:
        step_target_s = max(step_target_s,
                            deadline_step_s(cost, decodes_s, prefills, prefill_deadlines))
    prefill = _prefill_tokens(cost, max(step_target_s - decodes_s, 0.0), prefills, max_prefill)
    prefill = min(max(prefill, MIN_PREFILL_TOKENS), max_prefill)
    deadline_room_s = (max(prefill_step_ms / 1000.0 - decodes_s, room_s)
                       if num_decodes and prefill_step_ms is not None else None)
    return StepPlan(num_decodes + prefill, seats, room_s, deadline_room_s)


def deadline_step_s(cost: StepCost, overhead_s: float, prefills: Sequence[tuple[int, int]],
                    deadlines: Sequence[tuple[float, float]]) -> float:
    """The shortest step at which each of the first prompts of `prefills` (schedule order) ends
    its prefill by its deadline, each capped at its own bound (`deadlines`: (seconds left, the
    longest step it may ask for)); 0.0 when none needs more than any step gives.

    A step of `step_s` spends `overhead_s` on its fixed part and decodes and the rest on prefill,
    so prompts ahead and this one (`work_s` of prefill) end within `left_s` when
    `(step_s - overhead_s) / step_s >= work_s / left_s`. A prompt past reach even so asks for its
    bound: it ends as soon as it can, and the prompts behind it sooner too."""
    needed_s = work_s = 0.0
    for (start, num_left), (left_s, max_step_s) in zip(prefills[:len(deadlines)], deadlines,
                                                       strict=True):
        work_s += cost.chunk_s(start, num_left)
        share = work_s / left_s if left_s > 0.0 else 1.0
        step_s = overhead_s / (1.0 - share) if share < 1.0 else max_step_s
        needed_s = max(needed_s, min(step_s, max_step_s))
    return needed_s


def _prefill_tokens(cost: StepCost, room_s: float, prefills: Sequence[tuple[int, int]],
                    max_prefill: int) -> int:
    """Prompt tokens that fit `room_s`, chunk by chunk in schedule order, each at its position."""
    num_tokens = 0
    for start, num_left in islice(prefills, MAX_PLANNED_PREFILLS):
        fits = cost.max_chunk(start, room_s)
        chunk = num_left if fits is None else min(fits, num_left)
        num_tokens += chunk
        room_s -= cost.chunk_s(start, chunk)
        if chunk < num_left or num_tokens >= max_prefill:
            return num_tokens
    fits = cost.max_chunk(0, room_s)  # prompts not listed (or arriving): at their start
    return max_prefill if fits is None else num_tokens + fits


def _max_seats(cost: StepCost, step_target_s: float, num_decodes: int, num_decode_pairs: int,
               max_num_seqs: int) -> int:
    """The most decodes (at the running decodes' mean context) that, with the minimum prefill,
    still fit the step."""
    mean_context = num_decode_pairs / num_decodes if num_decodes else 0.0
    per_seat_s = cost.decode_s_per_seq + cost.attention_s_per_pair * mean_context
    seat_room_s = step_target_s - cost.step_s(MIN_PREFILL_TOKENS, 0,
                                              attention_pairs(0, MIN_PREFILL_TOKENS))
    seats = int(max(seat_room_s, 0.0) / per_seat_s) if per_seat_s > 0.0 else max_num_seqs
    return min(max(seats, 1), max_num_seqs)
