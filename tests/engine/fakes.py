"""Fakes and drivers for engine tests.

Without a model: requests with made-up token ids, and a fake "compute" step that drives the
Scheduler and KVCacheManager the way LLMEngine does (append one token per sampled row). With a real
LLMEngine: `drive` and `generate`, which step it until idle and gather each request's outputs into a
`Completion`."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from contracts.sampling_params import SamplingParams
from engine.batch import ScheduledBatch
from engine.engine import LLMEngine
from engine.kv_cache.manager import KVCacheManager
from engine.outputs import FinishReason, RequestOutput
from engine.request import Request
from engine.scheduler import Scheduler

BLOCK_SIZE = 16
MODEL_ID = "fake-model"
MAX_MODEL_LEN = 4096
_ids = itertools.count()


def tokens(num_tokens: int, start: int = 1000) -> list[int]:
    """`num_tokens` distinct-looking token ids starting at `start`."""
    return list(range(start, start + num_tokens))


def make_request(prompt_token_ids: list[int], *, max_tokens: int = 8, cache_salt: str | None = None,
                 request_id: str | None = None, hashed: bool = True) -> Request:
    """A real Request with fake token ids, its block hashes computed as LLMEngine.add_request
    does."""
    request = Request(request_id or f"req-{next(_ids)}", list(prompt_token_ids),
                      SamplingParams(temperature=0.0, max_tokens=max_tokens), (), MAX_MODEL_LEN,
                      cache_salt)
    if hashed:
        request.update_block_hashes(BLOCK_SIZE, MODEL_ID)
    return request


def make_manager(num_blocks: int, enable_caching: bool = True, event_log=None,  # type: ignore[no-untyped-def]
                 group_windows: tuple[int | None, ...] = (None,)) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching, event_log, group_windows)


def admit_groups(manager: KVCacheManager, request: Request,
                 num_new_tokens: int | None = None) -> tuple[list[int | None], ...] | None:
    """What the scheduler does for a waiting request: look up hits, allocate, mark computed.
    Returns the block table of every KV cache group."""
    computed = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - computed.num_computed_tokens
    tables = manager.allocate_slots(request, num_new_tokens, computed)
    if tables is not None:
        request.num_cached_tokens = computed.num_computed_tokens
        request.num_computed_tokens = computed.num_computed_tokens + num_new_tokens
    return tables


def admit(manager: KVCacheManager, request: Request,
          num_new_tokens: int | None = None) -> list[int] | None:
    """`admit_groups` for a one-group (full attention) manager: its only block table."""
    tables = admit_groups(manager, request, num_new_tokens)
    return None if tables is None else [b for b in tables[0] if b is not None]


def fake_token(request: Request) -> int:
    """A deterministic 'sampled' token: a function of the request's position only."""
    return 5 + (request.num_tokens * 7 + len(request.request_id)) % 500


def simulate_step(scheduler: Scheduler, batch: ScheduledBatch) -> list[Request]:
    """Pretend the model ran `batch`: append a token to each sampled request, finish those at their
    max_tokens. Returns the requests that finished."""
    by_id = {r.request_id: r for r in scheduler.running}
    finished = []
    for seq in batch.sequences:
        request = by_id.get(seq.request_id)
        if request is None or not seq.needs_sample:
            continue
        request.output_token_ids.append(fake_token(request))
        request.update_block_hashes(BLOCK_SIZE, MODEL_ID)
        if request.num_tokens >= request.max_num_tokens:
            scheduler.finish(request, FinishReason.LENGTH)
            finished.append(request)
    return finished


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[ScheduledBatch]:
    batches: list[ScheduledBatch] = []
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return batches
        batch = scheduler.schedule()
        batches.append(batch)
        simulate_step(scheduler, batch)
        scheduler.kv_cache.check_integrity()
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


# ---- drivers for a real LLMEngine ----------------------------------------------------------------
@dataclass
class Completion:
    """Everything a request produced, gathered from its RequestOutputs."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list = field(default_factory=list)  # type: ignore[type-arg]
    timings: dict[str, float] = field(default_factory=dict)  # the final output's


def drive(engine: LLMEngine, max_steps: int = 5000,
          on_step: Callable[[int], None] | None = None) -> dict[str, Completion]:
    """Step `engine` until it is idle; `on_step(step_index)` runs before each step (to add or
    abort)."""
    results: dict[str, Completion] = {}
    for step_index in range(max_steps):
        if on_step is not None:
            on_step(step_index)
        if not engine.has_unfinished_requests:
            return results
        for output in engine.step():
            collect(results, output)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def drive_to_first_tokens(engine: LLMEngine, on_step: Callable[[int], None],
                          max_steps: int = 5000) -> tuple[dict[str, int], dict[str, Completion]]:
    """`drive`, also returning the index of the step that gave each request its first token."""
    first_token_step: dict[str, int] = {}
    results: dict[str, Completion] = {}
    for step_index in range(max_steps):
        on_step(step_index)
        if not engine.has_unfinished_requests:
            return first_token_step, results
        for output in engine.step():
            if output.new_token_ids:
                first_token_step.setdefault(output.request_id, step_index)
            collect(results, output)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def collect(results: dict[str, Completion], output: RequestOutput) -> None:
    done = results.setdefault(output.request_id, Completion())
    done.token_ids += output.new_token_ids
    done.text += output.text
    done.logprobs += output.logprobs or []
    done.num_prompt_tokens = output.num_prompt_tokens
    done.num_cached_tokens = output.num_cached_tokens
    if output.finished:
        done.finish_reason, done.stop_reason = output.finish_reason, output.stop_reason
        done.timings = output.timings


def generate(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams,
             cache_salt: str | None = None) -> dict[str, Completion]:
    """Add every prompt at once (one concurrent batch) and run them all to completion."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
    return drive(engine)


def assert_idle_and_clean(engine: LLMEngine) -> None:
    """No request holds a block, every block is free or evictable, the allocator is consistent."""
    engine.kv_cache.check_integrity()
    assert not engine.has_unfinished_requests
    assert engine.kv_cache.num_requests == 0
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.num_blocks
    assert all(block.ref_cnt == 0 for block in engine.kv_cache.pool.blocks)
