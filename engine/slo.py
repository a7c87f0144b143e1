"""Latency targets: the step-time model the engine measures, the step plan that keeps decodes inside
their TPOT target, and the queueing-delay prediction that admission control refuses on.

Everything here is a pure function or a small value object; the scheduler (engine/scheduler.py)
owns one `StepCostModel` and calls these each step.

The step-time model (fitted from every step the engine runs, recent steps weigh most):

    step_s = base_s + prefill_s_per_token * num_prefill_tokens + decode_s_per_seq * num_decode_seqs

The control loop (`plan_step`, policy `slo` with a TPOT target): a step must last at most
`tpot_target * HEADROOM` (each running decode gets one token per step, so a step's time is their
time per output token). The running decodes' share of it is fixed (base + their cost); prefill takes
the rest, at least MIN_PREFILL_TOKENS so prompts always advance. New sequences are admitted to the
running batch only while the batch's decodes alone (plus that minimum prefill) still fit the step.

    |<------------------ tpot_target * HEADROOM ------------------>|
    | base_s | decode_s_per_seq * num_decodes | prefill (the rest) |

Admission (`predict_admission`): a request of class c waits behind the prefill work of its class
and the higher ones (waiting prompts less what the prefix cache holds of them, running prompts'
unfinished chunks); per step that work gets the token budget less those classes' decodes. It also
waits for a seat: when the running batch is at the plan's cap, until enough of the seats its class
can take (its own class's and higher; a lower class gives its seat up) free up, each after its
remaining output tokens, one a step. The queue is the longer of the two; the predicted TTFT is the
queue plus its own prefill, the prompt less its prefix-cache hit. Classes' TTFT targets (`class_ttft_target_ms`): priority and default have the operator's
target; flex is best effort with a looser bound (FLEX_TTFT_FACTOR times it) so its queue stays
bounded too. A request is refused only when the queue is what breaks its target: one whose own
prefill fits the target is refused when queue + prefill exceed it; one whose own prefill alone takes
longer (a long prompt, or a machine slower than the target) only when the queue alone exceeds it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

HEADROOM = 0.8  # the step aims at 80% of the TPOT target: the target is a p90, steps are noisy
MIN_PREFILL_TOKENS = 16  # prefill's floor per step while any prompt waits
FLEX_TTFT_FACTOR = 4.0  # flex's TTFT bound for admission: this many times the target
MIN_STEPS_FITTED = 4  # steps measured before the model predicts anything
STANDARD_CLASSES = (-1, 0, 1)  # priority, default, flex (contracts/replica_protocol.py)
MAX_SEAT_SAMPLES = 64  # per class, the soonest seat releases admission looks at
_RIDGE = 1e-6  # keeps the fit solvable before the steps vary in every feature


def service_tier_of(priority: int) -> str:
    """The OpenAI service_tier name of a scheduling class (a metric label)."""
    return "priority" if priority < 0 else "default" if priority == 0 else "flex"


def class_ttft_target_ms(ttft_target_ms: float | None, priority: int) -> float | None:
    """The TTFT bound admission holds class `priority` to (None: never refused)."""
    if not ttft_target_ms:
        return None
    return ttft_target_ms * FLEX_TTFT_FACTOR if priority > 0 else ttft_target_ms


@dataclass(frozen=True)
class StepCost:
    """Seconds a step takes: base + per prefill token + per decoding sequence."""

    base_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float

    def step_s(self, num_prefill_tokens: float, num_decode_seqs: float) -> float:
        return (self.base_s + self.prefill_s_per_token * num_prefill_tokens
                + self.decode_s_per_seq * num_decode_seqs)


class StepCostModel:
    """Least squares of step_s on (1, prefill tokens, decode seqs) with exponential forgetting
    (`half_life_steps`): the model follows the machine as load and contexts change.

    The features are scaled by the step's limits (`prefill_scale` tokens, `decode_scale` seqs), so
    where the steps do not tell the terms apart (every step full, say) the minimum-norm solution
    splits a step's time evenly between its fixed part and its per-token part."""

    def __init__(self, half_life_steps: float = 64.0, prefill_scale: float = 512.0,
                 decode_scale: float = 64.0) -> None:
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._scales = (1.0, float(prefill_scale), float(decode_scale))
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self.num_steps = 0
        self.cost: StepCost | None = None  # None until MIN_STEPS_FITTED steps were measured

    def observe(self, num_prefill_tokens: int, num_decode_seqs: int, step_s: float) -> None:
        if num_prefill_tokens + num_decode_seqs <= 0 or not step_s > 0.0:
            return
        x = (1.0, num_prefill_tokens / self._scales[1], num_decode_seqs / self._scales[2])
        for i in range(3):
            for j in range(3):
                self._xtx[i][j] = self._xtx[i][j] * self._decay + x[i] * x[j]
            self._xty[i] = self._xty[i] * self._decay + x[i] * step_s
        self.num_steps += 1
        if self.num_steps >= MIN_STEPS_FITTED:
            base, prefill, decode = _solve3(self._xtx, self._xty)
            self.cost = StepCost(max(base, 0.0), max(prefill, 0.0) / self._scales[1],
                                 max(decode, 0.0) / self._scales[2])


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float]:
    """(a + ridge) x = b by Gaussian elimination with partial pivoting."""
    m = [[a[i][j] + (_RIDGE if i == j else 0.0) for j in range(3)] + [b[i]] for i in range(3)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for row in range(col + 1, 3):
            factor = m[row][col] / m[col][col]
            for k in range(col, 4):
                m[row][k] -= factor * m[col][k]
    x = [0.0, 0.0, 0.0]
    for row in (2, 1, 0):
        x[row] = (m[row][3] - sum(m[row][k] * x[k] for k in range(row + 1, 3))) / m[row][row]
    return x[0], x[1], x[2]


@dataclass(frozen=True)
class StepPlan:
    """What one step may schedule: tokens in all, and sequences in the running batch."""

    token_budget: int
    max_num_running: int


def plan_step(cost: StepCost | None, num_decodes: int, tpot_target_ms: float | None,
              max_num_batched_tokens: int, max_num_seqs: int) -> StepPlan:
    """The next step's budget under the `slo` policy (module docstring); the fixed budget when
    there is no TPOT target, nothing measured yet, or a target this machine cannot meet even
    with one sequence and the minimum prefill (shrinking the batch would then cost throughput and
    buy no latency)."""
    fixed = StepPlan(max_num_batched_tokens, max_num_seqs)
    if cost is None or not tpot_target_ms:
        return fixed
    step_target_s = tpot_target_ms / 1000.0 * HEADROOM
    if cost.step_s(MIN_PREFILL_TOKENS, 1) > step_target_s:
        return fixed
    room_s = step_target_s - cost.base_s - cost.decode_s_per_seq * num_decodes
    max_prefill = max(max_num_batched_tokens - num_decodes, 0)
    if cost.prefill_s_per_token > 0.0:
        prefill = int(max(room_s, 0.0) / cost.prefill_s_per_token)
    else:
        prefill = max_prefill
    prefill = min(max(prefill, MIN_PREFILL_TOKENS), max_prefill)
    seat_room_s = step_target_s - cost.base_s - cost.prefill_s_per_token * MIN_PREFILL_TOKENS
    if cost.decode_s_per_seq > 0.0:
        seats = int(max(seat_room_s, 0.0) / cost.decode_s_per_seq)
    else:
        seats = max_num_seqs
    return StepPlan(token_budget=num_decodes + prefill, max_num_running=min(max(seats, 1), max_num_seqs))


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


@dataclass(frozen=True)
class QueueLoad:
    """The scheduler's load as admission sees it, taken on the engine thread after each change
    (read from any thread: it is immutable)."""

    by_class: dict[int, ClassLoad]  # every class present and the standard ones
    num_decodes: int  # all running decodes (they all make the step longer)
    token_budget: int  # the current step plan's
    cost: StepCost | None
    max_num_running: int = 0  # the current step plan's seats (0: a seat is never waited for)

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
    decodes: dict[int, int] = dict.fromkeys(STANDARD_CLASSES, 0)
    seated: dict[int, list[int]] = {c: [] for c in STANDARD_CLASSES}
    queued: dict[int, int] = dict.fromkeys(STANDARD_CLASSES, 0)
    for request in waiting:
        c = request.priority
        uncached = request.num_tokens - min(request.num_cached_tokens_predicted, request.num_tokens - 1)
        prefill[c] = prefill.get(c, 0) + uncached
        queued[c] = queued.get(c, 0) + 1
    for request in running:
        c = request.priority
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > 1:
            prefill[c] = prefill.get(c, 0) + remaining
        else:
            decodes[c] = decodes.get(c, 0) + 1
        seated.setdefault(c, []).append(max(request.max_num_tokens - request.num_tokens, 1))
    by_class: dict[int, ClassLoad] = {}
    num_prefill = num_decodes = num_running = num_waiting = 0
    seat_steps: tuple[int, ...] = ()
    for c in sorted(prefill.keys() | decodes.keys() | seated.keys() | queued.keys()):
        num_prefill += prefill.get(c, 0)  # cumulative: this class and the higher ones
        num_decodes += decodes.get(c, 0)
        num_running += len(seated.get(c, ()))
        num_waiting += queued.get(c, 0)
        own = heapq.nsmallest(MAX_SEAT_SAMPLES, seated.get(c, ()))
        seat_steps = tuple(islice(heapq.merge(seat_steps, own), MAX_SEAT_SAMPLES))
        by_class[c] = ClassLoad(num_prefill, num_decodes, num_running, num_waiting, seat_steps)
    return QueueLoad(by_class, num_decodes, plan.token_budget, cost, plan.max_num_running)


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
    cached prefix); (0, 0) before the step-time model has been fitted."""
    cost = load.cost
    if cost is None:
        return 0.0, 0.0
    ahead = load.ahead_of(priority)
    prefill_per_step = max(load.token_budget - ahead.num_decodes, 1)
    step_s = cost.step_s(prefill_per_step, load.num_decodes)
    prefill_s = (ahead.num_prefill_tokens + num_pending_tokens) / prefill_per_step * step_s
    queue_s = max(prefill_s, seat_wait_steps(load, ahead) * step_s)
    if not num_prompt_tokens:
        return queue_s, 0.0
    num_uncached = max(num_prompt_tokens - num_cached_tokens, 1)
    return queue_s, max(num_uncached / prefill_per_step, 1.0) * step_s
