"""Flex aging: a flex request that has waited longer than `max_wait_s` is scheduled as default, so a
steady load of default and priority requests cannot starve it.

    aging = FlexAging(flex_max_wait_s(config))
    aging.promote(scheduler.waiting, now)   # each step, before scheduling
    aging.requeued(request, now)            # a preempted request waits again from now
    aging.forget(request)                   # admitted or finished

A request's wait starts at its arrival, or at its last preemption. Once promoted its class is
default for good (`Request.priority` becomes 0: it is scheduled, preempted and predicted as a
default request; the service tier it was asked with, which metrics and usage report, is not the
scheduler's). It goes into the waiting queue ahead of the default requests that started waiting
after it, so its wait is bounded by `max_wait_s` plus the default work that was queued before it.

The bound (`SchedulerConfig.flex_max_wait_ms`, `--flex-max-wait-ms`): by default
FLEX_AGING_FACTOR times flex's TTFT bound (engine/admission.py: 4 x `--ttft-p90-ms`), or
NO_TARGET_FLEX_MAX_WAIT_MS without a TTFT target; `inf` never promotes.
"""

from __future__ import annotations

import math
from collections import deque

from engine.admission import class_ttft_target_ms
from engine.config import SchedulerConfig
from engine.request import Request

DEFAULT_CLASS, FLEX_CLASS = 0, 1
FLEX_AGING_FACTOR = 2.0  # x flex's TTFT bound
NO_TARGET_FLEX_MAX_WAIT_MS = 60_000.0


def flex_max_wait_s(config: SchedulerConfig) -> float:
    """Seconds a flex request waits before it is scheduled as default (module docstring)."""
    if config.flex_max_wait_ms is not None:
        return config.flex_max_wait_ms / 1000.0
    bound_ms = class_ttft_target_ms(config.ttft_p90_ms, FLEX_CLASS)
    return (FLEX_AGING_FACTOR * bound_ms if bound_ms else NO_TARGET_FLEX_MAX_WAIT_MS) / 1000.0


class FlexAging:
    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self._requeued_at: dict[str, float] = {}  # preempted requests waiting again (request id)
        self.num_promoted_total = 0

    def waiting_since(self, request: Request) -> float:
        return self._requeued_at.get(request.request_id, request.arrival_time)

    def requeued(self, request: Request, now_s: float) -> None:
        self._requeued_at[request.request_id] = now_s

    def forget(self, request: Request) -> None:
        self._requeued_at.pop(request.request_id, None)

    def promote(self, waiting: deque[Request], now_s: float) -> int:
        """Move the waiting flex requests whose wait passed the bound into the default class (the
        queue is in class order, flex last: only its flex tail is read). Returns how many."""
        if math.isinf(self.max_wait_s):
            return 0
        aged: list[Request] = []
        for request in reversed(waiting):
            if request.priority <= DEFAULT_CLASS:
                break
            if now_s - self.waiting_since(request) > self.max_wait_s:
                aged.append(request)
        if not aged:
            return 0
        aged_ids = {id(r) for r in aged}
        queue = [r for r in waiting if id(r) not in aged_ids]
        for request in sorted(aged, key=self.waiting_since):
            since = self.waiting_since(request)
            request.priority = DEFAULT_CLASS
            index = 0  # ahead of the first default request that started waiting after it
            while index < len(queue) and (queue[index].priority < DEFAULT_CLASS or (
                    queue[index].priority == DEFAULT_CLASS
                    and self.waiting_since(queue[index]) <= since)):
                index += 1
            queue.insert(index, request)
        waiting.clear()
        waiting.extend(queue)
        self.num_promoted_total += len(aged)
        return len(aged)
