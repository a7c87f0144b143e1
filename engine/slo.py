"""Latency targets: the step-time model the engine measures, the step plan that keeps decodes inside
their TPOT target, and the queueing-delay prediction that admission control refuses on.

Everything here is a pure function or a small value object; the scheduler (engine/scheduler.py)
owns one `StepCostModel` and calls these each step.

The step-time model (engine/step_cost.py, re-exported here): base + per prefill token + per
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

Admission (`predict_admission`): a request of class c waits behind the prefill work of its class
and the higher ones (waiting prompts less what the prefix cache holds of them, running prompts'
unfinished chunks: their tokens and attention, in seconds); per step that work gets the token
budget less those classes' decodes, and under the slo plan the step's prefill room. It also
waits for a seat: when the running batch is at the plan's cap, until enough of the seats its class
can take (its own class's and higher; a lower class gives its seat up) free up, each after its
remaining output tokens, one a step. The queue is the longer of the two; the predicted TTFT is the
queue plus its own prefill, the prompt less its prefix-cache hit. Classes' TTFT targets
(`class_ttft_target_ms`): priority and default have the operator's target; flex is best effort
with a looser bound (FLEX_TTFT_FACTOR times it) so its queue stays bounded too. A request is refused
only when the queue is what breaks its target: one whose own prefill fits the target is refused when
queue + prefill exceed it; one whose own prefill alone takes longer (a long prompt, or a machine
slower than the target) only when the queue alone exceeds it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from engine.step_cost import MIN_STEPS_FITTED as MIN_STEPS_FITTED  # (re-exported)
from engine.step_cost import StepCost as StepCost
from engine.step_cost import StepCostModel as StepCostModel
from engine.step_cost import attention_pairs as attention_pairs
from engine.step_cost import prompt_pairs as prompt_pairs

HEADROOM = 0.8  # the step aims at 80% of the TPOT target: the target is a p90, steps are noisy
PREFILL_STEP_TTFT_FRACTION = 0.1  # a step without decodes: at most this much of the TTFT target
MAX_PLANNED_PREFILLS = 8  # prompts a step plan costs chunk by chunk (the rest: at position 0)
MIN_PREFILL_TOKENS = 16  # prefill's floor per step while any prompt waits
FLEX_TTFT_FACTOR = 4.0  # flex's TTFT bound for admission: this many times the target
STANDARD_CLASSES = (-1, 0, 1)  # priority, default, flex (contracts/replica_protocol.py)
MAX_SEAT_SAMPLES = 64  # per class, the soonest seat releases admission looks at


def service_tier_of(priority: int) -> str:
    """The OpenAI service_tier name of a scheduling class (a metric label)."""
    return "priority" if priority < 0 else "default" if priority == 0 else "flex"


def class_ttft_target_ms(ttft_target_ms: float | None, priority: int) -> float | None:
    """The TTFT bound admission holds class `priority` to (None: never refused)."""
    if not ttft_target_ms:
        return None
    return ttft_target_ms * FLEX_TTFT_FACTOR if priority > 0 else ttft_target_ms


@dataclass(frozen=True)
class StepPlan:
    """What one step may schedule: tokens in all, and sequences in the running batch."""

    token_budget: int
    max_num_running: int
    # seconds of prefill work a step of this plan holds beside its decodes (None: no time bound,
    # the token budget alone: the fixed budget); admission's rate of prefill
    prefill_room_s: float | None = None


def plan_step(cost: StepCost | None, num_decodes: int, tpot_target_ms: float | None,
              max_num_batched_tokens: int, max_num_seqs: int,
              prefills: Sequence[tuple[int, int]] = (), num_decode_pairs: int = 0,
              prefill_step_ms: float | None = None,
              decode_slack_s: float | None = None) -> StepPlan:
    """The next step's budget under the `slo` policy (module docstring); the fixed budget when
    there is no TPOT target, nothing measured yet, or a target this machine cannot meet even
    with one sequence and the minimum prefill (shrinking the batch would then cost throughput and
    buy no latency).

    `prefills`: (position its chunk starts at, tokens left) of the prompts the step would prefill,
    in schedule order (at most MAX_PLANNED_PREFILLS are costed; tokens past them count as a prompt
    at position 0). `num_decode_pairs`: the decodes' contexts (their attention pairs).
    `prefill_step_ms`: the step's bound when nothing decodes (None: the token budget alone), and
    the most a step spends of the decodes' slack; `decode_slack_s`: the longest step that keeps
    every running decode's mean gap within the target (module docstring; None: the flat target)."""
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
    prefill = _prefill_tokens(cost, max(step_target_s - decodes_s, 0.0), prefills, max_prefill)
    prefill = min(max(prefill, MIN_PREFILL_TOKENS), max_prefill)
    return StepPlan(num_decodes + prefill, seats, room_s)


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


@dataclass(frozen=True)
class ClassLoad:
    """The work ahead of a new request of one class (that class and the higher ones)."""

    num_prefill_tokens: int  # prompt tokens still to prefill: waiting (less cached), running chunks
    num_decodes: int  # running sequences past their prompt: one token of budget each per step
    num_running: int = 0  # sequences holding a seat in the running batch
    num_waiting: int = 0  # requests queued for a seat
    # steps until each seat held frees (its remaining output tokens), soonest first, at most
    # MAX_SEAT_SAMPLES
    seat_free_steps: tuple[int, ...] = ()
    num_prefill_pairs: int = 0  # the attention work of those prompt tokens (prompt_pairs)


@dataclass(frozen=True)
class QueueLoad:
    """The scheduler's load as admission sees it, taken on the engine thread after each change
    (read from any thread: it is immutable)."""

    by_class: dict[int, ClassLoad]  # every class present and the standard ones
    num_decodes: int  # all running decodes (they all make the step longer)
    token_budget: int  # the current step plan's
    cost: StepCost | None
    max_num_running: int = 0  # the current step plan's seats (0: a seat is never waited for)
    num_decode_pairs: int = 0  # the running decodes' contexts (their attention work a step)
    prefill_room_s: float | None = None  # the plan's prefill seconds a step (None: tokens only)

    def ahead_of(self, priority: int) -> ClassLoad:
        """The load ahead of a new request of class `priority` (its own class and higher)."""
        classes = [c for c in self.by_class if c <= priority]
        if not classes:
            return ClassLoad(0, 0)
        return self.by_class[max(classes)]


@dataclass(frozen=True)
class Admission:
    is_admitted: bool
    queue_ms: float  # predicted delay before the request's own prefill starts
    ttft_ms: float  # queue plus its own prefill
    target_ms: float | None

    @property
    def retry_after_s(self) -> int:
        """Whole seconds to wait before trying again: the estimate, rounded up, at least 1."""
        return max(1, math.ceil(self.queue_ms / 1000.0))


class QueuedRequest(Protocol):
    """What the load is taken from (engine/request.py::Request)."""

    priority: int
    num_computed_tokens: int
    num_cached_tokens_predicted: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def max_num_tokens(self) -> int: ...


def queue_load_of(waiting: Iterable[QueuedRequest], running: Iterable[QueuedRequest],
                  plan: StepPlan, cost: StepCost | None) -> QueueLoad:
    """The scheduler's load for admission; O(waiting + running). A waiting request's prefill is
    its tokens less the prefix-cache hit found when it arrived (`num_cached_tokens_predicted`);
    a running one's seat frees after its remaining output tokens (max_tokens: with none, the
    context window, an upper bound)."""
    prefill: dict[int, int] = dict.fromkeys(STANDARD_CLASSES, 0)
    pairs: dict[int, int] = dict.fromkeys(STANDARD_CLASSES, 0)
    decodes: dict[int, int] = dict.fromkeys(STANDARD_CLASSES, 0)
    num_decode_pairs = 0
    seated: dict[int, list[int]] = {c: [] for c in STANDARD_CLASSES}
    queued: dict[int, int] = dict.fromkeys(STANDARD_CLASSES, 0)
    for request in waiting:
        c = request.priority
        cached = min(request.num_cached_tokens_predicted, request.num_tokens - 1)
        prefill[c] = prefill.get(c, 0) + request.num_tokens - cached
        pairs[c] = pairs.get(c, 0) + prompt_pairs(cached, request.num_tokens - cached)
        queued[c] = queued.get(c, 0) + 1
    for request in running:
        c = request.priority
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > 1:
            prefill[c] = prefill.get(c, 0) + remaining
            pairs[c] = pairs.get(c, 0) + prompt_pairs(request.num_computed_tokens, remaining)
        else:
            decodes[c] = decodes.get(c, 0) + 1
            num_decode_pairs += request.num_tokens
        seated.setdefault(c, []).append(max(request.max_num_tokens - request.num_tokens, 1))
    by_class: dict[int, ClassLoad] = {}
    num_prefill = num_pairs = num_decodes = num_running = num_waiting = 0
    seat_steps: tuple[int, ...] = ()
    for c in sorted(prefill.keys() | decodes.keys() | seated.keys() | queued.keys()):
        num_prefill += prefill.get(c, 0)  # cumulative: this class and the higher ones
        num_pairs += pairs.get(c, 0)
        num_decodes += decodes.get(c, 0)
        num_running += len(seated.get(c, ()))
        num_waiting += queued.get(c, 0)
        own = heapq.nsmallest(MAX_SEAT_SAMPLES, seated.get(c, ()))
        seat_steps = tuple(islice(heapq.merge(seat_steps, own), MAX_SEAT_SAMPLES))
        by_class[c] = ClassLoad(num_prefill, num_decodes, num_running, num_waiting, seat_steps,
                                num_pairs)
    return QueueLoad(by_class, num_decodes, plan.token_budget, cost, plan.max_num_running,
                     num_decode_pairs, plan.prefill_room_s)


def seat_wait_steps(load: QueueLoad, ahead: ClassLoad) -> int:
    """Steps until a seat is free for a new request behind `ahead` (0: one is free now): the
    batch at its cap, it waits for as many of its classes' seats to free as are taken beyond it
    (the requests waiting ahead take the first ones)."""
    if not load.max_num_running:
        return 0
    num_needed = ahead.num_running + ahead.num_waiting + 1 - load.max_num_running
    if num_needed <= 0 or not ahead.seat_free_steps:
        return 0
    return ahead.seat_free_steps[min(num_needed, len(ahead.seat_free_steps)) - 1]


def predict_admission(load: QueueLoad, priority: int, num_prompt_tokens: int,
                      ttft_target_ms: float | None, num_pending_tokens: int = 0,
                      num_cached_tokens: int = 0) -> Admission:
    """Whether a request of class `priority` with `num_prompt_tokens` would meet its class's TTFT
    target (module docstring). `num_pending_tokens`: prompts accepted ahead of it that the engine
    thread has not queued yet (they count as waiting); `num_cached_tokens`: its prompt's prefix
    the cache holds (not computed again)."""
    target_ms = class_ttft_target_ms(ttft_target_ms, priority)
    queue_s, own_s = predict_queue_s(load, priority, num_prompt_tokens, num_pending_tokens,
                                     num_cached_tokens)
    queue_ms, ttft_ms = queue_s * 1000.0, (queue_s + own_s) * 1000.0
    if target_ms is None:
        return Admission(True, queue_ms, ttft_ms, target_ms)
    own_ms = own_s * 1000.0
    breaks = ttft_ms > target_ms if own_ms <= target_ms else queue_ms > target_ms
    return Admission(not (breaks and queue_ms > 0.0), queue_ms, ttft_ms, target_ms)


def predict_queue_s(load: QueueLoad, priority: int, num_prompt_tokens: int = 0,
                    num_pending_tokens: int = 0, num_cached_tokens: int = 0) -> tuple[float, float]:
    """(seconds before a new request of class `priority` starts its prefill: the prefill ahead or
    the wait for a seat, whichever is longer; seconds of its own prefill, the prompt less its
    cached prefix); (0, 0) before the step-time model has been fitted.

    Prefill work (its tokens and attention, in seconds) takes as many steps as the plan's token
    budget less the decodes ahead, or its prefill room (policy slo), allow; each step also costs
    its fixed part and every running decode."""
    cost = load.cost
    if cost is None:
        return 0.0, 0.0
    ahead = load.ahead_of(priority)
    tokens_per_step = max(load.token_budget - ahead.num_decodes, 1)
    overhead_s = cost.step_s(0, load.num_decodes, load.num_decode_pairs)

    def prefill_s(num_tokens: int, num_pairs: int, min_steps: float) -> float:
        work_s = cost.prefill_s_per_token * num_tokens + cost.attention_s_per_pair * num_pairs
        num_steps = num_tokens / tokens_per_step
        if load.prefill_room_s:
            num_steps = max(num_steps, work_s / load.prefill_room_s)
        return max(num_steps, min_steps) * overhead_s + work_s

    pending_pairs = num_pending_tokens * num_prompt_tokens // 2  # (prompts like this one)
    queue_s = prefill_s(ahead.num_prefill_tokens + num_pending_tokens,
                        ahead.num_prefill_pairs + pending_pairs, 0.0)
    step_s = overhead_s + cost.chunk_s(0, tokens_per_step)
    if load.prefill_room_s:
        step_s = min(step_s, overhead_s + load.prefill_room_s)
    queue_s = max(queue_s, seat_wait_steps(load, ahead) * step_s)
    if not num_prompt_tokens:
        return queue_s, 0.0
    num_cached = min(num_cached_tokens, num_prompt_tokens - 1)
    num_uncached = num_prompt_tokens - num_cached
    return queue_s, prefill_s(num_uncached, prompt_pairs(num_cached, num_uncached), 1.0)
