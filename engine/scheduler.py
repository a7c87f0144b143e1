"""Continuous batching at the iteration level, with one token budget per step.

Each step: running requests first (a decode token each, or the next prefill chunk), then waiting requests
(chunked prefill: a long prompt takes what is left of the budget, so it never stalls requests that are
already streaming). When the KV cache runs out, the youngest running request is preempted (its blocks are
freed; it goes back to the front of the waiting queue and later recomputes, mostly from its own prefix-cache
hits). Requests never leave the running list except by finishing, aborting or preemption.

Prefix-aware admission: among the first `prefix_aware_window` waiting requests the one with the most
cached prompt tokens goes first (it costs the least prefill); the head of the queue is passed over at most
`prefix_aware_window` times, so nothing starves.
"""

from __future__ import annotations

import time
from collections import deque

from engine.batch import ScheduledBatch, ScheduledSequence
from engine.config import SchedulerConfig
from engine.kv_cache.manager import BlockTable, ComputedBlocks, KVCacheManager
from engine.outputs import FinishReason
from engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._num_head_skips = 0
        self.num_preemptions_total = 0
        self.num_prompt_tokens_computed_total = 0  # prompt positions run through the model (recomputes too)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.kv_cache.expire_retention(time.monotonic())
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(batch, budget)
        if not batch.preempted_request_ids:
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            block_tables = self.kv_cache.allocate_slots(request, num_new)
            while block_tables is None:
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
                block_tables = self.kv_cache.allocate_slots(request, num_new)
            if block_tables is None:
                break  # the request preempted itself: nothing younger is left to schedule
            batch.sequences.append(self._scheduled(request, num_new, block_tables))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request, computed = self._pick_waiting()
            num_new = min(request.num_tokens - computed.num_computed_tokens, budget)
            block_tables = self.kv_cache.allocate_slots(request, num_new, computed)
            if block_tables is None and not self.running and self.kv_cache.retention.num_blocks:
                self.kv_cache.release_retention()  # retained prefixes never stall an idle engine
                computed = self.kv_cache.get_computed_blocks(request)
                num_new = min(request.num_tokens - computed.num_computed_tokens, budget)
                block_tables = self.kv_cache.allocate_slots(request, num_new, computed)
            if block_tables is None:
                break  # no room: wait for running requests to finish (they never get preempted for it)
            self.waiting.remove(request)
            if request.num_preemptions == 0:
                request.num_cached_tokens = computed.num_computed_tokens
                self.kv_cache.record_prefix_query(request.num_tokens, computed.num_computed_tokens,
                                                  computed.num_host_tokens)
            request.num_computed_tokens = computed.num_computed_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.sequences.append(self._scheduled(request, num_new, block_tables))
            budget -= num_new

    def _pick_waiting(self) -> tuple[Request, ComputedBlocks]:
        head = self.waiting[0]
        head_computed = self.kv_cache.get_computed_blocks(head)
        if self._num_head_skips >= self.config.prefix_aware_window or len(self.waiting) == 1:
            self._num_head_skips = 0
            return head, head_computed
        best, best_computed = head, head_computed
        for i in range(1, min(self.config.prefix_aware_window, len(self.waiting))):
            candidate = self.waiting[i]
            computed = self.kv_cache.get_computed_blocks(candidate)
            if computed.num_computed_tokens > best_computed.num_computed_tokens:
                best, best_computed = candidate, computed
        self._num_head_skips = self._num_head_skips + 1 if best is not head else 0
        return best, best_computed

    def _scheduled(self, request: Request, num_new: int,
                   block_tables: tuple[BlockTable, ...]) -> ScheduledSequence:
        start = request.num_computed_tokens
        if start < request.num_prompt_tokens:
            request.num_prefill_chunks += 1
            self.num_prompt_tokens_computed_total += min(start + num_new, request.num_prompt_tokens) - start
        request.num_computed_tokens += num_new
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            start_position=start,
            block_table=block_tables[0],
            extra_block_tables=block_tables[1:],
            needs_sample=request.num_computed_tokens == request.num_tokens,
            needs_prompt_logits=(request.wants_prompt_logprobs
                                 and start < request.num_prompt_tokens - 1),
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Take a request out (finished or aborted) and return its blocks at once."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        retain = request.retain_s > 0 and reason != FinishReason.ABORT
        self.kv_cache.free(request, time.monotonic() + request.retain_s if retain else None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
