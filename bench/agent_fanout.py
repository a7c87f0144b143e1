"""The fan-out case of `aigw bench agent --pauses`: N subagent requests that share a new (uncached)
prefix arrive together; the first computes the prefix and the others wait for its blocks, so the N
cost about one prefill, not N.

Measured on one engine, in the same run: one request alone (its own new prefix), then N at once
(another new prefix, each with its own suffix), twice, alternating, the faster of each kept.
Figures: prompt tokens the engine computed (its counter) against one prefill (prefix + N suffixes)
and N prefills (N x (prefix + suffix)), and the wall time until the last of the N has its first
token against the single request's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from bench.plotting import fmt
from bench.workloads import TokenSource

TARGET_FANOUT_COST = 1.5  # "about one prefill": at most this many single prefills' time


@dataclass(frozen=True)
class FanoutResult:
    num_requests: int
    num_prefix_tokens: int
    num_suffix_tokens: int
    num_computed_tokens: int  # prompt tokens the engine ran through the model for the N
    single_s: float  # one request alone: arrival to first token
    fanout_s: float  # N at once: arrival to the last first token

    @property
    def one_prefill_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_requests * self.num_suffix_tokens

    @property
    def n_prefills_tokens(self) -> int:
        return self.num_requests * (self.num_prefix_tokens + self.num_suffix_tokens)

    def lines(self) -> list[str]:
        cost = self.fanout_s / self.single_s
        return [f"fan-out: {self.num_requests} requests sharing a new "
                f"{self.num_prefix_tokens}-token prefix (+{self.num_suffix_tokens} own tokens "
                f"each) computed {self.num_computed_tokens:,} prompt tokens (one prefill: "
                f"{self.one_prefill_tokens:,}; {self.num_requests} prefills: "
                f"{self.n_prefills_tokens:,}); last first token after {fmt(self.fanout_s, 2)} s vs "
                f"{fmt(self.single_s, 2)} s for one request alone: {cost:.2f}x one prefill (<= "
                f"{TARGET_FANOUT_COST}x: {'met' if cost <= TARGET_FANOUT_COST else 'NOT met'})"]


def _first_tokens(engine: Any, prompts: list[list[int]], tag: str) -> float:
    """Add every prompt at once and step until each has its first token; returns the wall time."""
    from contracts.sampling_params import SamplingParams

    started = time.perf_counter()
    pending = set()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt,
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        pending.add(f"{tag}-{i}")
    elapsed = 0.0
    while engine.has_unfinished_requests:
        for output in engine.step():
            if output.new_token_ids and output.request_id in pending:
                pending.discard(output.request_id)
                if not pending:
                    elapsed = time.perf_counter() - started
    return elapsed


def run_fanout(args: argparse.Namespace, engine: Any, tokenizer: Any) -> FanoutResult:
    source = TokenSource(tokenizer, seed=args.seed + 7)
    n, prefix_len, suffix_len = (args.fanout_requests, args.fanout_prefix_tokens,
                                 args.fanout_suffix_tokens)
    singles, fanouts, computed = [], [], []
    for repeat in range(2):
        single = source.take(prefix_len + suffix_len)
        prefix = source.take(prefix_len)
        group = [prefix + source.take(suffix_len) for _ in range(n)]
        for what in (("single", "fanout") if repeat == 0 else ("fanout", "single")):
            if what == "single":
                singles.append(_first_tokens(engine, [single], f"single{repeat}"))
                continue
            before = engine.scheduler.num_prompt_tokens_computed_total
            fanouts.append(_first_tokens(engine, group, f"fanout{repeat}"))
            computed.append(engine.scheduler.num_prompt_tokens_computed_total - before)
    engine.kv_cache.check_integrity()
    return FanoutResult(n, prefix_len, suffix_len, min(computed), min(singles), min(fanouts))


def add_arguments(group: Any) -> None:
    group.add_argument("--fanout-requests", type=int, default=8,
                       help="the fan-out case: requests sharing a new prefix; 0: skip the case")
    group.add_argument("--fanout-prefix-tokens", type=int, default=2000)
    group.add_argument("--fanout-suffix-tokens", type=int, default=32)
