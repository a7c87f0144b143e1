"""LLMEngine: add_request / abort_request / step. One step = schedule -> run -> postprocess.

Synchronous and single-threaded; engine/async_engine.py runs it on its own thread for the server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from contracts.block_hash import hash_blocks
from contracts.kv_events import EventPublisher, KVEventLog, KVSnapshot
from contracts.sampling_params import SamplingParams
from engine.admission import (
    STANDARD_CLASSES,
    Admission,
    QueueLoad,
    predict_admission,
    predict_queue_s,
    service_tier_of,
)
from engine.batch import ScheduledBatch
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache.host_storage import HostTierStorage
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.manager import KVCacheManager
from engine.loader import Tokenizer
from engine.model_runner import ModelRunner
from engine.outputs import FinishReason, PromptTooLongError, RequestOutput
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, SamplingRow, logprobs_of
from engine.scheduler import Scheduler
from engine.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_running_requests: int
    num_waiting_requests: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_cached: int
    num_kv_blocks_retained: int  # kept from eviction by KV retention (engine/kv_cache/retention.py)
    num_prefix_cache_queried_tokens: int
    num_prefix_cache_hit_tokens: int
    num_host_tier_hit_tokens: int  # of the hit tokens, those restored from the host tier
    num_host_tier_blocks: int  # blocks the host tier holds now
    num_host_tier_bytes: int  # their bytes (at most host_tier_budget_bytes)
    host_tier_budget_bytes: int  # 0: no host tier
    num_host_tier_offloaded_blocks_total: int  # blocks evicted from the pool into the tier
    num_host_tier_restored_blocks_total: int  # blocks copied back into the pool (tier hits)
    num_host_tier_dropped_blocks_total: int  # gave their slot up to newer blocks, or found none
    num_prompt_tokens_total: int
    # prompt tokens prefilled (not served by the prefix cache)
    num_prompt_tokens_computed_total: int
    num_generation_tokens_total: int
    num_preemptions_total: int
    # admission control (engine/admission.py): predicted queueing delay of a new request per
    # service_tier
    predicted_queue_delay_ms: tuple[tuple[str, float], ...] = ()
    step_token_budget: int = 0  # the current step plan's token budget (policy slo: adaptive)
    max_num_running: int = 0  # and its cap on the running batch
    prefill_ms_per_token: float = 0.0  # the step-time model's (0: not measured yet)
    num_share_preemptions_total: int = 0  # preemptions that took a reserved share back
    num_flex_promotions_total: int = 0  # flex requests scheduled as default after waiting too long


class LLMEngine:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, runner: ModelRunner,
                 tokenizer: Tokenizer, publishers: tuple[EventPublisher, ...] = (),
                 kv_events_token_ids: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 step_timer: Callable[[], float] = time.perf_counter) -> None:
        """`clock`: the engine's seconds (request timings, retention expiry); time.monotonic
        unless a benchmark drives the engine in virtual time (bench/agent_pauses.py).
        `step_timer`: what a step's cost is measured with, the unit of the step-time model that
        the SLO policy plans and admission predicts in (engine/slo.py): wall time by default; a
        virtual-clock benchmark passes time.thread_time so both learn the steps' CPU time, the
        same cost its clock advances by (`last_step_s`; bench/slo_virtual.py)."""
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.runner = runner
        self.compute_info: dict[str, object] = dict(getattr(runner, "compute_info", {}))
        self.block_size = config.cache.block_size
        self.max_model_len = min(model_config.max_position_embeddings,
                                 config.max_model_len or model_config.max_position_embeddings,
                                 runner.max_num_tokens_per_sequence(
                                     config.scheduler.max_num_batched_tokens))
        # token ids stay out of KV events (they are tenants' prompts) unless asked for (debugging)
        self.kv_events = KVEventLog(config.replica_id, publishers=publishers,
                                    include_token_ids=kv_events_token_ids)
        self.kv_cache = KVCacheManager(runner.num_blocks, self.block_size,
                                       config.cache.enable_prefix_caching, self.kv_events,
                                       group_windows=runner.kv_layout.group_windows,
                                       group_chunks=runner.kv_layout.group_chunks,
                                       retention_share_per_owner=config.cache.retention_share_per_project,
                                       retention_share_total=config.cache.retention_share_total,
                                       host_tier=self._host_tier(config, runner))
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, clock)
        self.step_timer = step_timer
        self.last_step_s = 0.0  # the last step's cost by step_timer (what the step-time model saw)
        # replaced, never mutated: any thread reads it
        self.queue_load: QueueLoad = self.scheduler.queue_load()
        self.sampler = Sampler(seed=config.seed)
        self.grammars = GrammarCompiler(tokenizer.backend, model_config.vocab_size,
                                        model_config.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._num_prompt_tokens_total = 0
        self._num_generation_tokens_total = 0

    def _host_tier(self, config: EngineConfig, runner: ModelRunner) -> HostTier | None:
        """The second KV tier's storage (self.host_storage) and bookkeeping, when it has a
        budget."""
        self.host_storage: HostTierStorage | None = None
        if not config.cache.host_tier_bytes or not config.cache.enable_prefix_caching:
            return None
        self.host_storage = HostTierStorage.for_kv([t for kv in runner.kv_caches for t in kv],
                                                   config.cache.host_tier_bytes,
                                                   config.cache.host_tier_dir)
        logger.info("KV host tier: %d blocks (%.0f MiB) in %s", self.host_storage.num_slots,
                    self.host_storage.num_slots * self.host_storage.bytes_per_block / 2**20,
                    "pinned memory" if self.host_storage.device.type == "cuda" else "a mapped file")
        return HostTier(self.host_storage.num_slots, self.host_storage.bytes_per_block,
                        self.block_size, self.kv_events)

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True,
                    publishers: tuple[EventPublisher, ...] = (),
                    kv_events_token_ids: bool = False) -> LLMEngine:
        from engine.loader import load_checkpoint, load_tokenizer

        if config.tensor_parallel_size > 1:  # N processes, this one rank 0 (engine/parallel/)
            from engine.parallel.executor import TensorParallelRunner

            tokenizer = load_tokenizer(config.model_path)
            tp_runner = TensorParallelRunner(config, progress)
            try:
                return cls(config, tp_runner.full_model_config, tp_runner, tokenizer,  # type: ignore[arg-type]
                           publishers, kv_events_token_ids)
            except BaseException:
                tp_runner.close()  # no workers left behind by a config the engine refuses
                raise
        checkpoint = load_checkpoint(config.model_path, dtype=torch.float32, progress=progress)
        tokenizer = load_tokenizer(config.model_path)
        runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights),
                             dict(checkpoint.raw))
        runner.warmup()
        return cls(config, checkpoint.config, runner, tokenizer, publishers, kv_events_token_ids)

    # ---- requests --------------------------------------------------------------------------------
    def check_prompt(self, num_prompt_tokens: int) -> None:
        """Raise PromptTooLongError when a prompt can never be served (context window or KV
        cache)."""
        if num_prompt_tokens + 1 > self.max_model_len:
            what = ("context window"
                    if self.max_model_len < self.runner.num_blocks * self.block_size
                    else "context window (bounded by the KV cache)")
            raise PromptTooLongError(num_prompt_tokens, self.max_model_len, what)
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, retain_s: float = 0.0,
                    retention_id: str | None = None, priority: int = 0) -> None:
        """`retain_s` > 0: keep the prompt's cached blocks safe from eviction that long after the
        request finishes (clamped to CacheConfig.max_retention_s; bounded per cache salt;
        `retention_id` names the session whose last retention this one supersedes;
        engine/kv_cache/retention.py). `priority`: the scheduling class, lower first (-1 priority, 0
        default, 1 flex; engine/scheduler.py)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if not retain_s >= 0.0:  # (NaN too)
            raise ValueError(f"retain_s must be >= 0, got {retain_s}")
        retain_s = min(retain_s, self.config.cache.max_retention_s)
        self.check_prompt(len(prompt_token_ids))
        self._check_token_ids(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params,
                          () if params.ignore_eos else self.model_config.eos_token_ids,
                          self.max_model_len, cache_salt, arrival_time=self.scheduler.clock())
        request.retain_s, request.retention_id = retain_s, retention_id
        request.priority = priority
        if params.grammar is not None:
            # OutputGrammarError
            request.grammar = self.grammars.matcher(params.grammar, cache_salt)
        if self.kv_cache.enable_caching:
            request.update_block_hashes(self.block_size, self.model_config.model_id)
            request.num_cached_tokens_predicted = (  # admission's estimate of its prefill
                self.kv_cache.get_computed_blocks(request).num_computed_tokens)
        self._requests[request_id] = request
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer.backend, params.stop)
        self._num_prompt_tokens_total += len(prompt_token_ids)
        self.scheduler.add_request(request)

    def _check_token_ids(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError for a prompt or stop token id outside the vocabulary: the model's embedding
        and the sampler's logits are indexed with them, and an IndexError there would fail the
        step, every request in it and the engine loop (the replica's HTTP layer answers 400
        first; this keeps any other caller from killing the engine)."""
        vocab_size = self.model_config.vocab_size
        for name, ids in (("prompt", prompt_token_ids), ("stop", params.stop_token_ids)):
            if ids and (min(ids) < 0 or max(ids) >= vocab_size):
                raise ValueError(f"{name} token ids must be in [0, {vocab_size})")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, FinishReason.ABORT)
        return self._final_output(request, [], "")

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started_s = self.step_timer()  # the step-time model's unit (wall time unless injected)
        batch = self.scheduler.schedule()
        if self.host_storage is not None:  # evicted blocks out, tier hits in, before the model runs
            self.host_storage.apply(self.kv_cache.take_transfers())
        sampled = self._run(batch)
        outputs = self._postprocess(batch, sampled)
        self.kv_events.seal()
        self.last_step_s = self.step_timer() - started_s
        self.scheduler.record_step(batch, self.last_step_s)
        self.publish_load()
        return outputs

    # ---- admission control -----------------------------------------------------------------------
    def publish_load(self) -> None:
        """Take the scheduler's queue load for admission (engine thread; after adds and steps)."""
        self.queue_load = self.scheduler.queue_load()

    def admission(self, priority: int, num_prompt_tokens: int, num_pending_tokens: int = 0,
                  num_cached_tokens: int = 0) -> Admission:
        """Whether a new request would meet its class's TTFT target (engine/admission.py); any
        thread.
        `num_cached_tokens`: its prompt's prefix the cache holds (`num_cached_prefix_tokens`)."""
        return predict_admission(self.queue_load, priority, num_prompt_tokens,
                                 self.config.scheduler.ttft_p90_ms, num_pending_tokens,
                                 num_cached_tokens)

    def num_cached_prefix_tokens(self, prompt_token_ids: Sequence[int],
                                 cache_salt: str | None = None) -> int:
        """Prompt tokens a new request would find in the prefix cache, as of the last step (the
        KV event log's held blocks; any thread). At least the last token is left to compute."""
        if not self.kv_cache.enable_caching or len(prompt_token_ids) <= self.block_size:
            return 0
        num_full = (len(prompt_token_ids) - 1) // self.block_size
        hashes = hash_blocks(prompt_token_ids[:num_full * self.block_size], self.block_size,
                             self.model_config.model_id, cache_salt)
        return self.kv_events.num_leading_held(hashes) * self.block_size

    def predicted_queue_delay_ms(self) -> tuple[tuple[str, float], ...]:
        """(service_tier, ms of work ahead of a new request of that class), the standard classes."""
        load = self.queue_load
        return tuple((service_tier_of(c), predict_queue_s(load, c)[0] * 1000.0)
                     for c in STANDARD_CLASSES)

    def _run(self, batch: ScheduledBatch) -> tuple[list[str], SamplerOutput | None]:
        if batch.is_empty:
            return [], None
        step_logits = self.runner.execute(batch)
        if step_logits.prompt_logits:
            self._record_prompt_logprobs(batch, step_logits.prompt_logits)
        if not step_logits.request_ids:
            return [], None
        requests = [self._requests[request_id] for request_id in step_logits.request_ids]
        bitmasks = self._grammar_bitmasks(requests)
        rows = [SamplingRow(r.params, r.generator, r.output_token_ids, r.num_output_tokens,
                            self.model_config.eos_token_ids, bitmasks.get(r.request_id))
                for r in requests]
        return step_logits.request_ids, self.sampler(step_logits.logits, rows)

    def _record_prompt_logprobs(self, batch: ScheduledBatch, prompt_logits: dict[str, torch.Tensor]
                                ) -> None:
        """Row p of a chunk's logits predicts prompt token p + 1: its logprob joins the request's
        `prompt_logprobs` (positions recorded before a preemption are not recorded again)."""
        for seq in batch.sequences:
            logits = prompt_logits.get(seq.request_id)
            if logits is None:
                continue
            request = self._requests[seq.request_id]
            first = max(seq.start_position, len(request.prompt_logprobs))  # next position to record
            # the last prompt token predicts output
            end = min(seq.seq_len, request.num_prompt_tokens - 1)
            if first >= end:
                continue
            targets = torch.tensor(request.prompt_token_ids[first + 1:end + 1])  # [end - first]
            # [end - first, vocab]
            rows = logits[first - seq.start_position:end - seq.start_position]
            request.prompt_logprobs.extend(logprobs_of(
                rows, targets, [request.params.prompt_logprobs or 0] * (end - first)))

    def _grammar_bitmasks(self, requests: list[Request]) -> dict[str, torch.Tensor]:
        """The allowed-token bitmask (int32 [num_words]) of each request that has a grammar."""
        constrained = [r for r in requests if r.grammar is not None]
        if not constrained:
            return {}
        bitmask = torch.empty((len(constrained), self.grammars.num_words), dtype=torch.int32)
        for row, request in zip(bitmask, constrained, strict=True):
            request.grammar.fill_bitmask(row)  # type: ignore[union-attr]
        return {r.request_id: row for r, row in zip(constrained, bitmask, strict=True)}

    def _postprocess(self, batch: ScheduledBatch,
                     sampled: tuple[list[str], SamplerOutput | None]) -> list[RequestOutput]:
        request_ids, sampler_output = sampled
        if sampler_output is None:
            return []
        now = self.scheduler.clock()
        outputs = []
        for i, request_id in enumerate(request_ids):
            request = self._requests[request_id]
            if request.params.max_tokens == 0:  # scoring only: the prompt's logprobs, no token
                self.scheduler.finish(request, FinishReason.LENGTH)
                outputs.append(self._final_output(request, [], "", None, request.prompt_logprobs))
                continue
            token_id = sampler_output.token_ids[i]
            request.output_token_ids.append(token_id)
            if request.grammar is not None and not request.grammar.accept(token_id):
                logger.warning("request %s: the grammar refused token %d", request_id, token_id)
            self._num_generation_tokens_total += 1
            if request.first_token_time is None:
                request.first_token_time = now
            if self.kv_cache.enable_caching:
                request.update_block_hashes(self.block_size, self.model_config.model_id)
            logprob = sampler_output.logprobs[i]
            outputs.append(self._advance(request, token_id, [logprob] if logprob else None))
        return outputs

    def _advance(self, request: Request, token_id: int, logprobs: list | None) -> RequestOutput:
        """Detokenize the new token and decide whether the request is done."""
        params = request.params
        detok = self._detokenizers[request.request_id]
        reason: FinishReason | None = None
        stop_reason: str | int | None = None
        text = ""
        min_reached = request.num_output_tokens >= params.min_tokens
        if token_id in request.eos_token_ids and min_reached:
            reason, logprobs = FinishReason.STOP, None  # (not part of the answer: no logprob entry)
        elif token_id in params.stop_token_ids and min_reached:
            reason, stop_reason, logprobs = FinishReason.STOP, token_id, None
        else:
            update = detok.push([token_id], check_stop=min_reached)
            text = update.text
            if update.stop_matched is not None:
                reason, stop_reason = FinishReason.STOP, update.stop_matched
        if reason is None and request.grammar is not None and request.grammar.is_stopped():
            reason = FinishReason.STOP  # the grammar is complete (or failed): nothing may follow
        if reason is None and request.num_tokens >= request.max_num_tokens:
            reason = FinishReason.LENGTH
        prompt_logprobs = (request.prompt_logprobs if request.wants_prompt_logprobs
                           and request.num_output_tokens == 1 else None)
        if reason is None:
            return RequestOutput(request.request_id, [token_id], text, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs,
                                 num_prompt_tokens=request.num_prompt_tokens,
                                 num_cached_tokens=request.num_cached_tokens,
                                 num_output_tokens=request.num_output_tokens)
        if not isinstance(stop_reason, str):
            text += detok.finish()
        self.scheduler.finish(request, reason, stop_reason)
        return self._final_output(request, [token_id], text, logprobs, prompt_logprobs)

    def _final_output(self, request: Request, new_token_ids: list[int], text: str,
                      logprobs: list | None = None, prompt_logprobs: list | None = None
                      ) -> RequestOutput:
        del self._requests[request.request_id]
        del self._detokenizers[request.request_id]
        now = self.scheduler.clock()
        first_token = request.first_token_time or now
        scheduled = request.first_scheduled_time or request.arrival_time
        return RequestOutput(
            request.request_id, new_token_ids, text, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
            timings={"queue_s": max(scheduled - request.arrival_time, 0.0),
                     "prefill_s": max(first_token - scheduled, 0.0),
                     "decode_s": max(now - first_token, 0.0),
                     "num_prefill_chunks": float(request.num_prefill_chunks),
                     "num_host_cached_tokens": float(request.num_host_cached_tokens)},
        )

    # ---- cache and introspection -----------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        self.kv_cache.reset_prefix_cache()
        self.kv_events.seal()

    def kv_snapshot(self) -> KVSnapshot:
        """Every hash held as of the last sealed event batch (safe from any thread)."""
        return self.kv_events.snapshot(self.block_size)

    def stats(self) -> EngineStats:
        pool = self.kv_cache.pool
        tier = self.kv_cache.host_tier
        return EngineStats(
            num_running_requests=len(self.scheduler.running),
            num_waiting_requests=len(self.scheduler.waiting),
            num_kv_blocks_total=pool.num_blocks,
            num_kv_blocks_used=pool.num_used_blocks,
            num_kv_blocks_cached=pool.num_cached_blocks,
            num_kv_blocks_retained=self.kv_cache.retention.num_blocks,
            num_prefix_cache_queried_tokens=self.kv_cache.num_queried_tokens,
            num_prefix_cache_hit_tokens=self.kv_cache.num_hit_tokens,
            num_host_tier_hit_tokens=self.kv_cache.num_host_hit_tokens,
            num_host_tier_blocks=tier.num_blocks if tier else 0,
            num_host_tier_bytes=tier.used_bytes if tier else 0,
            host_tier_budget_bytes=tier.budget_bytes if tier else 0,
            num_host_tier_offloaded_blocks_total=tier.num_offloaded_blocks_total if tier else 0,
            num_host_tier_restored_blocks_total=tier.num_restored_blocks_total if tier else 0,
            num_host_tier_dropped_blocks_total=tier.num_dropped_blocks_total if tier else 0,
            num_prompt_tokens_total=self._num_prompt_tokens_total,
            num_prompt_tokens_computed_total=self.scheduler.num_prompt_tokens_computed_total,
            num_generation_tokens_total=self._num_generation_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_share_preemptions_total=self.scheduler.num_share_preemptions_total,
            num_flex_promotions_total=self.scheduler.aging.num_promoted_total,
            predicted_queue_delay_ms=self.predicted_queue_delay_ms(),
            step_token_budget=self.scheduler.plan.token_budget,
            max_num_running=self.scheduler.plan.max_num_running,
            prefill_ms_per_token=(cost.prefill_s_per_token * 1000.0
                                  if (cost := self.scheduler.step_costs.cost) else 0.0),
        )
