"""Continuous batching at the iteration level, with one token budget per step.

Each step: running requests first (a decode token each, or the next prefill chunk), then waiting
requests (chunked prefill: a long prompt takes what is left of the budget, so it never stalls
requests that are already streaming). When the KV cache runs out, the youngest running request of
the lowest class is preempted (its blocks are freed; it goes back to the front of its class in the
waiting queue and later recomputes, mostly from its own prefix-cache hits). Requests never leave the
running list except by finishing, aborting or preemption.

Prefix-aware admission: among the first `prefix_aware_window` waiting requests of the head's class
the one with the most cached prompt tokens goes first (it costs the least prefill); the head of the
queue is passed over at most `prefix_aware_window` times, so nothing starves, and with a TTFT
target only while a seat is left for the head too.

Priority classes (`Request.priority`, lower first: OpenAI's service_tier priority -1, default 0,
flex 1): both queues are kept in class order (FIFO within a class), and each step goes class by
class, highest first: the class's running requests, then its waiting ones. So a waiting request of a
higher class takes the budget before lower classes' decodes, and when it finds no KV room (or no
free seat) it preempts running requests of lower classes, lowest and youngest first; a running
request that needs a block preempts the lowest class's youngest request too (itself, when it is
that). A request is never preempted to make room for a lower class's, and a waiting request never
preempts its own class.

Latency targets (engine/slo.py, engine/step_planner.py): every step's time is measured
(`record_step`) into a step-time model. Under policy "slo" with a TPOT target, each step's token
budget and the running batch's size come from `plan_next_step` (decodes keep their target, prefill
takes the rest, a prompt at risk of its TTFT target takes time from lower classes' streams); under
"fixed" the budget is `max_num_batched_tokens` every step. `queue_load()` is what admission control
(engine/admission.py) predicts from.

Reserved shares (engine/reserved_shares.py): with `reserved_shares`, each step other projects'
requests schedule only what the reserved projects with work leave of the budget, the KV blocks and
the seats; a waiting request that may not (its project has no room) is passed over for the next
one that may. Before anything is scheduled, a reserved project owed blocks or seats that others
hold takes them back (`_take_back_shares`): other projects' running requests are preempted, lowest
class and youngest first, never one of a reserved project within its own share.

Flex aging (engine/flex_aging.py): a flex request that waited longer than `flex_max_wait_ms` is
scheduled as default from then on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice

from engine.admission import QueueLoad, queue_load_of
from engine.batch import ScheduledBatch, ScheduledSequence
from engine.config import SchedulerConfig
from engine.flex_aging import FlexAging, flex_max_wait_s
from engine.kv_cache.manager import BlockTable, ComputedBlocks, KVCacheManager
from engine.outputs import FinishReason
from engine.request import Request, RequestStatus
from engine.reserved_shares import ReservedShares
from engine.slo import StepPlan
from engine.step_cost import StepCostModel, attention_pairs
from engine.step_planner import plan_next_step

MAX_SHARE_SCAN = 256  # waiting requests looked at for one that a reserved share lets in


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: seconds for queue/first-token times and retention expiry (a benchmark passes a
        virtual clock; engine/engine.py shares it)."""
        self.config = config
        self.kv_cache = kv_cache
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._num_head_skips = 0
        self.num_preemptions_total = 0
        self.num_share_preemptions_total = 0  # of them, to take a reserved share back
        # prompt positions run through the model (recomputes too)
        self.num_prompt_tokens_computed_total = 0
        self.step_costs = StepCostModel(prefill_scale=config.max_num_batched_tokens,
                                        decode_scale=config.max_num_seqs)
        self.plan = StepPlan(config.max_num_batched_tokens, config.max_num_seqs)
        self.shares = (ReservedShares(dict(config.reserved_shares), kv_cache.num_blocks,
                                      kv_cache.block_size) if config.reserved_shares else None)
        self.aging = FlexAging(flex_max_wait_s(config))
        self._taken_back: set[str] = set()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        """Queue `request` behind every waiting request of its class or a higher one."""
        index = len(self.waiting)
        while index > 0 and self.waiting[index - 1].priority > request.priority:
            index -= 1
        self.waiting.insert(index, request)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        now_s = self.clock()
        self.kv_cache.expire_retention(now_s)
        self.aging.promote(self.waiting, now_s)
        self.plan = self._plan_step()
        budget = self.plan.token_budget
        if self.shares is not None:
            self.shares.begin_step(budget, self.plan.max_num_running, self.running, self.waiting)
            if self.shares.is_active:
                self._take_back_shares(batch)
        num_taken_back = len(batch.preempted_request_ids)
        # not readmitted in the step that took them
        self._taken_back = set(batch.preempted_request_ids)
        # running[:index] are scheduled in this step; running[index:] (lower classes) are not yet
        index = 0
        classes = sorted({r.priority for r in self.running} | {r.priority for r in self.waiting})
        for priority in classes:
            if budget <= 0:
                break
            index, budget = self._schedule_running(batch, budget, index, priority)
            if len(batch.preempted_request_ids) == num_taken_back:  # none in a step out of blocks
                index, budget = self._schedule_waiting(batch, budget, index, priority)
        return batch

    def _plan_step(self) -> StepPlan:
        return plan_next_step(self.config, self.step_costs.cost, self.running, self.waiting,
                              self.clock())

    def record_step(self, batch: ScheduledBatch, step_s: float) -> None:
        """The measured wall time of the step that ran `batch` (schedule, model, sampling)."""
        num_decodes = num_pairs = 0
        for seq in batch.sequences:
            num_decodes += seq.num_scheduled_tokens == 1
            num_pairs += attention_pairs(seq.start_position, seq.num_scheduled_tokens)
        self.step_costs.observe(batch.num_scheduled_tokens - num_decodes, num_decodes, step_s,
                                num_pairs)

    def queue_load(self) -> QueueLoad:
        """The work ahead of each class (engine/admission.py::queue_load_of); O(waiting +
        running)."""
        return queue_load_of(self.waiting, self.running, self.plan, self.step_costs.cost,
                             self.config.max_num_batched_tokens)

    def _schedule_running(self, batch: ScheduledBatch, budget: int, index: int,
                          priority: int) -> tuple[int, int]:
        """The running requests of class `priority` from running[index]: a decode token each, or the
        next prefill chunk. Out of blocks (or growing into another project's unmet reservation), the
        last running request (lowest class, youngest) it may preempt is, until the request fits or
        was that one. A prefill chunk leaves a token for every decode behind it
        (`_num_decodes_from`)."""
        while index < len(self.running) and self.running[index].priority == priority and budget > 0:
            request = self.running[index]
            num_left = request.num_tokens - request.num_computed_tokens
            free = budget - self._num_decodes_from(index + 1) if num_left > 1 else budget
            allowed = self._num_tokens_for(request, free)
            if allowed <= 0:  # the budget left is other projects' reserved share, or decodes'
                index += 1
                continue
            num_new = min(num_left, allowed)
            num_new_blocks = self._num_new_blocks(request.num_computed_tokens, num_new)
            block_tables = self._allocate_running(request, num_new, num_new_blocks)
            while block_tables is None:
                position = self._victim(request, index, lower_only=False)
                assert position is not None  # (at worst the request itself)
                victim = self.running.pop(position)
                self._preempt(victim, batch)
                if victim is request:
                    break
                block_tables = self._allocate_running(request, num_new, num_new_blocks)
            if block_tables is None:
                break  # the request preempted itself: nothing younger is left to schedule
            batch.sequences.append(self._scheduled(request, num_new, block_tables))
            self._spend(request, num_new, num_new_blocks)
            budget -= num_new
            index += 1
        return index, budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int, index: int,
                          priority: int) -> tuple[int, int]:
        """Admit waiting requests of class `priority`, in order, into running[index]; each may
        preempt running requests of lower classes (not yet scheduled in this step) for a seat or
        for KV room. Its prompt leaves a token for every running decode not yet scheduled."""
        while self.waiting and budget > 0 and (self.waiting[0].priority == priority or (
                self._holds_shares and self.waiting[0].priority < priority)):
            free = budget - self._num_decodes_from(index)  # (a victim below only frees more)
            if free <= 0:
                break
            num_seats = self.plan.max_num_running
            has_lower = self._has_lower(index, priority)
            if len(self.running) >= num_seats and not has_lower and not self._owed_seat(priority):
                break
            if self._holds_shares:
                num_free_seats = max(num_seats - len(self.running), int(has_lower))
                picked = self._pick_within_shares(priority, free, num_free_seats)
            else:
                picked = self._pick_waiting(num_seats - len(self.running))
            if picked is None:
                break  # every waiting request of the class meets another project's reserved share
            request, computed = picked
            if (len(self.running) >= num_seats and self._holds_shares
                    and self.shares.owes_seat(request)):  # type: ignore[union-attr]
                num_seats = len(self.running) + 1  # a seat its reservation took back this step
            if len(self.running) >= num_seats:
                victim = self._victim(request, index, lower_only=True)
                if victim is None:
                    break
                # one lower-class request gives its seat
                self._preempt(self.running.pop(victim), batch)
                num_seats = max(num_seats, len(self.running) + 1)
            num_new = min(request.num_tokens - computed.num_computed_tokens,
                          self._num_tokens_for(request, free))
            block_tables = self.kv_cache.allocate_slots(request, num_new, computed)
            while block_tables is None:
                victim = self._victim(request, index, lower_only=True)
                if victim is None:
                    break
                self._preempt(self.running.pop(victim), batch)
                block_tables = self.kv_cache.allocate_slots(request, num_new, computed)
            while block_tables is None and self.kv_cache.release_one_retention():
                # retained prefixes yield to a waiting request, the soonest to expire first: they
                # are safe from LRU eviction, never from demand (no request waits on a retention)
                computed = self.kv_cache.get_computed_blocks(request)
                num_new = min(request.num_tokens - computed.num_computed_tokens,
                              self._num_tokens_for(request, free))
                block_tables = self.kv_cache.allocate_slots(request, num_new, computed)
            if block_tables is None:
                break  # no room: wait for running requests of its class or higher to finish
            self.waiting.remove(request)
            self.aging.forget(request)
            if request.num_preemptions == 0:
                request.num_cached_tokens = computed.num_computed_tokens
                request.num_host_cached_tokens = computed.num_host_tokens
                self.kv_cache.record_prefix_query(request.num_tokens, computed.num_computed_tokens,
                                                  computed.num_host_tokens)
            request.num_computed_tokens = computed.num_computed_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
            request.status = RequestStatus.RUNNING
            self.running.insert(index, request)  # behind its class, ahead of the lower ones
            index += 1
            num_new_blocks = self._num_new_blocks(request.num_computed_tokens, num_new)
            batch.sequences.append(self._scheduled(request, num_new, block_tables))
            self._spend(request, num_new, num_new_blocks)
            if self.shares is not None:
                self.shares.took_seat(request)
            budget -= num_new
        return index, budget

    # ---- reserved shares -------------------------------------------------------------------------
    @property
    def _holds_shares(self) -> bool:
        return self.shares is not None and self.shares.is_active

    def _num_tokens_for(self, request: Request, budget: int) -> int:
        return self.shares.num_tokens_for(request, budget) if self._holds_shares else budget  # type: ignore[union-attr]

    def _spend(self, request: Request, num_tokens: int, num_new_blocks: int) -> None:
        if self.shares is not None:
            self.shares.spend(request, num_tokens)
            self.shares.took_blocks(request, num_new_blocks)

    def _pick_within_shares(self, priority: int, budget: int, num_free_seats: int
                            ) -> tuple[Request, ComputedBlocks] | None:
        """The first waiting request of class `priority` (of the first MAX_SHARE_SCAN) whose project
        may take tokens, a seat and the blocks of its first chunk without touching another
        project's reserved share. Past a higher class's request the share kept waiting, only a
        request of a project owed its share may go; past the scan, a request of a project owed its
        share is still found, however deep the queue."""
        assert self.shares is not None
        passed_higher = False
        for request in islice(self.waiting, MAX_SHARE_SCAN):
            if request.priority < priority:
                passed_higher = True
                continue
            if request.priority > priority:
                break
            if passed_higher and not self.shares.is_short(request):
                continue
            if (picked := self._fits_shares(request, budget, num_free_seats)) is not None:
                return picked
        for request in self._owed_waiting(priority):
            if (picked := self._fits_shares(request, budget, num_free_seats)) is not None:
                return picked
        return None

    def _fits_shares(self, request: Request, budget: int, num_free_seats: int
                     ) -> tuple[Request, ComputedBlocks] | None:
        assert self.shares is not None
        if request.request_id in self._taken_back:
            return None  # not readmitted in the step that took it back
        allowed = self.shares.num_tokens_for(request, budget)
        if allowed <= 0:
            return None
        if not (self.shares.owes_seat(request)
                or self.shares.can_take_seat(request, num_free_seats)):
            return None
        computed = self.kv_cache.get_computed_blocks(request)
        start = computed.num_computed_tokens
        num_new_blocks = self._num_new_blocks(start, min(request.num_tokens - start, allowed))
        if self.shares.can_take_blocks(request, num_new_blocks, self.kv_cache.num_free_blocks):
            return request, computed
        return None

    def _owed_waiting(self, priority: int) -> Iterator[Request]:
        """The waiting requests of class `priority` whose reserved project is owed its share this
        step, in queue order (from the list begin_step took: no scan of the whole queue)."""
        assert self.shares is not None
        for request in self.shares.waiting_reserved:
            if (request.priority == priority and request.status != RequestStatus.RUNNING
                    and not request.is_finished and self.shares.is_short(request)):
                yield request

    def _owed_seat(self, priority: int) -> bool:
        """Whether a waiting request of class `priority` belongs to a reserved project owed a seat
        this step."""
        if not self._holds_shares:
            return False
        assert self.shares is not None
        return any(self.shares.owes_seat(r) for r in self._owed_waiting(priority))

    def _take_back_shares(self, batch: ScheduledBatch) -> None:
        """Before the step schedules anything: while the reserved projects with work are owed more
        blocks than are free, or more seats, preempt other projects' running requests (the lowest
        class and the youngest first; not those of projects owed a share themselves, nor those of
        reserved projects within their share). Retained prefixes go before any running request."""
        shares = self.shares
        assert shares is not None
        owed_blocks, owed_seats = shares.shortfall()
        num_seats_to_free = owed_seats - max(self.plan.max_num_running - len(self.running), 0)
        while owed_blocks > self.kv_cache.num_free_blocks or num_seats_to_free > 0:
            if (owed_blocks > self.kv_cache.num_free_blocks
                and self.kv_cache.release_one_retention()):
                continue
            victim = next((r for r in reversed(self.running)
                           if not shares.is_short(r) and not shares.is_protected(r, None)), None)
            if victim is None:
                return  # what is left is the reserved projects' own (or theirs to finish)
            self.running.remove(victim)
            self._preempt(victim, batch)
            self.num_share_preemptions_total += 1
            num_seats_to_free -= 1

    def _num_new_blocks(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        return (self.kv_cache.num_blocks_needed(num_computed_tokens + num_new_tokens)
                - self.kv_cache.num_blocks_needed(num_computed_tokens))

    def _allocate_running(self, request: Request, num_new: int,
                          num_new_blocks: int) -> tuple[BlockTable, ...] | None:
        """A running request's next slots, or None when blocks ran out or its new blocks would be
        another project's unmet reservation."""
        if num_new_blocks > 0 and self._holds_shares and not self.shares.can_take_blocks(  # type: ignore[union-attr]
                request, num_new_blocks, self.kv_cache.num_free_blocks):
            return None
        return self.kv_cache.allocate_slots(request, num_new)

    def _victim(self, preemptor: Request, index: int, lower_only: bool) -> int | None:
        """The position in `running` of the request `preemptor` preempts: the last one (lowest
        class, youngest) of those not yet scheduled in this step (running[index:]), of a lower
        class than the preemptor's if `lower_only`, and not inside another reserved project's
        share. A running preemptor (at running[index]) finds itself at worst."""
        for position in range(len(self.running) - 1, index - 1, -1):
            candidate = self.running[position]
            if lower_only and candidate.priority <= preemptor.priority:
                return None  # (class order: nothing of a lower class before it)
            if not (self._holds_shares and self.shares.is_protected(candidate, preemptor)):  # type: ignore[union-attr]
                return position
        return None

    def _num_decodes_from(self, position: int) -> int:
        """Running decodes at running[position:] (not yet scheduled in this step): a prefill
        leaves each its token, so a prompt of a higher class (or admitted earlier) never stalls
        a stream."""
        return sum(1 for r in islice(self.running, position, None)
                   if r.num_tokens - r.num_computed_tokens <= 1)

    def _has_lower(self, index: int, priority: int) -> bool:
        """Whether a running request not yet scheduled in this step is of a lower class."""
        return len(self.running) > index and self.running[-1].priority > priority

    def _pick_waiting(self, num_free_seats: int) -> tuple[Request, ComputedBlocks]:
        """The head of the waiting queue, or the request of its class in the prefix-aware window
        with the most cached tokens. With a TTFT target, the head is passed over only while a seat
        is left for it too: a request that takes the last free seat holds it until it finishes, so
        passing over the head there costs it a whole answer's time, which admission's FIFO
        prediction did not count (under the slo plan's seat cap the agent workload's first turns
        waited 8 answers behind later turns' cache hits)."""
        head = self.waiting[0]
        head_computed = self.kv_cache.get_computed_blocks(head)
        if (self._num_head_skips >= self.config.prefix_aware_window or len(self.waiting) == 1
                or (self.config.ttft_p90_ms is not None and num_free_seats < 2)):
            self._num_head_skips = 0
            return head, head_computed
        best, best_computed = head, head_computed
        for i in range(1, min(self.config.prefix_aware_window, len(self.waiting))):
            candidate = self.waiting[i]
            if candidate.priority != head.priority:
                break  # (the queue is in class order: never past the head's class)
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
            self.num_prompt_tokens_computed_total += min(start + num_new,
                                                         request.num_prompt_tokens) - start
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

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        """Free a running request's blocks (already out of `running`); it waits at the front of
        its class and later recomputes."""
        if self.shares is not None:
            self.shares.released(request, self.shares.blocks_of(request))
        self.aging.requeued(request, self.clock())
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        batch.preempted_request_ids.append(request.request_id)
        index = 0
        while index < len(self.waiting) and self.waiting[index].priority < request.priority:
            index += 1
        self.waiting.insert(index, request)

    def finish(self, request: Request, reason: FinishReason,
               stop_reason: str | int | None = None) -> None:
        """Take a request out (finished or aborted) and return its blocks at once."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.aging.forget(request)
        retain = request.retain_s > 0 and reason != FinishReason.ABORT
        self.kv_cache.free(request, self.clock() + request.retain_s if retain else None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
