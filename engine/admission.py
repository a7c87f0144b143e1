"""Admission control: the queueing delay a new request would see, predicted from the scheduler's
load and its step plan (engine/slo.py), and whether that breaks its class's TTFT target.

`predict_admission`: a request of class c waits behind the prefill work of its class
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
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from engine.slo import StepPlan
from engine.step_cost import StepCost, prompt_pairs

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
    # a step's prefill seconds for a prompt at risk of its deadline beside lower classes' decodes
    # only (StepPlan.deadline_room_s), and the token budget such a step may reach
    deadline_room_s: float | None = None
    max_token_budget: int = 0

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
                  plan: StepPlan, cost: StepCost | None, max_token_budget: int = 0) -> QueueLoad:
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
                     num_decode_pairs, plan.prefill_room_s, plan.deadline_room_s,
                     max(max_token_budget, plan.token_budget))


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
    its fixed part and every running decode. A class above a class that decodes gets the room a
    prompt at risk of its deadline takes from lower classes' decodes (`deadline_room_s`,
    engine/slo.py::deadline_step_s): the scheduler gives it up to that much when the plan's room
    would miss the target (less while streams of its own class have no time in hand, so the
    prediction is the optimistic one for a higher class)."""
    cost = load.cost
    if cost is None:
        return 0.0, 0.0
    ahead = load.ahead_of(priority)
    takes_lower = load.deadline_room_s is not None and load.num_decodes > ahead.num_decodes
    token_budget = load.max_token_budget if takes_lower else load.token_budget
    room_s = load.deadline_room_s if takes_lower else load.prefill_room_s
    tokens_per_step = max(token_budget - load.num_decodes if takes_lower
                          else token_budget - ahead.num_decodes, 1)
    overhead_s = cost.step_s(0, load.num_decodes, load.num_decode_pairs)

    def prefill_s(num_tokens: int, num_pairs: int, min_steps: float) -> float:
        work_s = cost.prefill_s_per_token * num_tokens + cost.attention_s_per_pair * num_pairs
        num_steps = num_tokens / tokens_per_step
        if room_s:
            num_steps = max(num_steps, work_s / room_s)
        return max(num_steps, min_steps) * overhead_s + work_s

    pending_pairs = num_pending_tokens * num_prompt_tokens // 2  # (prompts like this one)
    queue_s = prefill_s(ahead.num_prefill_tokens + num_pending_tokens,
                        ahead.num_prefill_pairs + pending_pairs, 0.0)
    step_s = overhead_s + cost.chunk_s(0, tokens_per_step)
    if room_s:
        step_s = min(step_s, overhead_s + room_s)
    queue_s = max(queue_s, seat_wait_steps(load, ahead) * step_s)
    if not num_prompt_tokens:
        return queue_s, 0.0
    num_cached = min(num_cached_tokens, num_prompt_tokens - 1)
    num_uncached = num_prompt_tokens - num_cached
    return queue_s, prefill_s(num_uncached, prompt_pairs(num_cached, num_uncached), 1.0)
