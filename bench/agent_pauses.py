"""`aigw bench agent --pauses`: agent sessions that pause for their tools, on a KV pool too small
for them, with another tenant's one-shot traffic churning it: plain LRU, retention, retention + the
second KV tier, and an oracle pool that holds everything, in one run.

Workload (deterministic for `--seed`): S sessions (16) of T turns share one system prompt with a
tool schema (bench/workloads.py: agent_sessions); between turns each session pauses for its tool, a
log-uniform 2-60 s, times `--pause-scale` (0.1: 0.2-6 s, so a run takes minutes on 2 cores: the
pauses are compressed, retention times with them). Sessions start spread over the first pause range.
A second tenant (another cache salt) sends a unique prompt every `--background-interval-s` (scaled
too), never reused: it is what evicts a paused session's prefix under plain LRU.

Pool: `--pool-fraction` (0.8) of the sessions' distinct KV footprint (their shared head counted once
plus every session's own final context), in blocks; the oracle's holds sessions and background with
room to spare. Retention: every agent turn asks `--retention-s` (300 s, the gateway's session
default, scaled), keyed by its session; shares `--retention-share-per-project` /
`--retention-share-total`. Second tier: `--host-tier-fraction` of the footprint in bytes (engine
flag --kv-host-tier-bytes; the mode is skipped, and the report says so, on an engine without it).

Clock (`--clock`): virtual by default. Idle time is skipped (a pause costs no wall time) and the
four modes run interleaved, each on its own clock, the one furthest behind stepped next; a step
advances its mode's clock by the CPU time of the thread that ran it (`--step-cost cpu`), what it
would take on an idle machine. On a shared machine wall time is stretched many times over by other
processes (a 200-token prefill: 1.06 s of thread CPU time, sd 5%, against 17.2 s wall, sd 7%, at a
load average of 15 on 2 cores), and with one mode after another each mode met a different load: the
comparison measured the machine, not the cache. `--clock wall` keeps real time, mode after mode.
With the virtual clock `--pause-scale` no longer buys run time; it sets how densely turns arrive
(0.1: ten times tighter than the real pauses, so turns queue behind each other).

After the modes, the fan-out case (bench/agent_fanout.py): N requests sharing a new prefix at once
against one request alone.

Figures for the agent turns only (the background never hits by construction): token hit ratio, TTFT
p50/p90, and input tok/s as the median over turns of prompt tokens / TTFT. Targets: the best mode's
hit ratio >= 90% of the oracle's, its TTFT p90 <= 1.3x the oracle's.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import agent_fanout
from bench.agent_lanes import Lane, Turn, run_lanes, tail_breakdown, turn_record
from bench.plotting import BarPanel, fmt, format_table, percentile, write_bar_chart
from bench.workloads import AgentSession, TokenSource, agent_sessions

MODES = ("lru", "retention", "retention+tier", "oracle")
TARGET_HIT_FRACTION, TARGET_TTFT_P90_RATIO = 0.90, 1.3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--pauses (agent sessions with tool pauses)")
    group.add_argument("--pauses", action="store_true", help="run the tool-pause workload instead")
    group.add_argument("--pause-sessions", type=int, default=16)
    group.add_argument("--pause-turns", type=int, default=3)
    group.add_argument("--pause-min-s", type=float, default=2.0)
    group.add_argument("--pause-max-s", type=float, default=60.0)
    group.add_argument("--pause-scale", type=float, default=0.1,
                       help="multiply every pause and retention time (compressed time)")
    group.add_argument("--pause-system-tokens", type=int, default=400)
    group.add_argument("--pause-message-tokens", default="40,80",
                       help="each turn's new message: min,max")
    group.add_argument("--pause-answer-tokens", default="8,12", help="each answer: min,max")
    group.add_argument("--pool-fraction", type=float, default=0.8,
                       help="the KV pool as a fraction of the sessions' distinct footprint")
    group.add_argument("--host-tier-fraction", type=float, default=1.0,
                       help="the second tier as a fraction of the sessions' footprint")
    group.add_argument("--background-interval-s", type=float, default=4.0,
                       help="another tenant's unique prompt every this many (unscaled) seconds")
    group.add_argument("--background-tokens", type=int, default=48)
    group.add_argument("--retention-s", type=float, default=300.0)
    group.add_argument("--retention-share-per-project", type=float, default=0.75)
    group.add_argument("--retention-share-total", type=float, default=0.75)
    group.add_argument("--modes", default=",".join(MODES))
    group.add_argument("--clock", choices=("virtual", "wall"), default="virtual",
                       help="virtual: idle time is skipped and the modes run interleaved on their "
                            "own clocks; wall: real time, one mode after another")
    group.add_argument("--step-cost", choices=("cpu", "wall"), default="cpu",
                       help="virtual clock: a step costs its thread's CPU time (cpu: robust to "
                            "other processes' load) or its wall time")
    group.add_argument("--turns-json", default=None,
                       help="write every agent turn of every mode here")
    agent_fanout.add_arguments(group)


def apply_tiny(args: argparse.Namespace) -> None:
    """Smoke-test sizes (seconds; the figures mean nothing)."""
    args.pause_sessions, args.pause_turns, args.pause_system_tokens = 3, 2, 150
    args.pause_scale, args.background_interval_s, args.background_tokens = 0.01, 10.0, 32
    args.threads = 1
    args.fanout_requests, args.fanout_prefix_tokens, args.fanout_suffix_tokens = 3, 96, 8


@dataclass(frozen=True)
class Plan:
    sessions: list[AgentSession]
    starts_s: list[float]  # scaled
    pauses_s: list[list[float]]  # scaled, per session, after each turn
    background: list[tuple[float, list[int]]]  # (scaled arrival, prompt)
    footprint_blocks: int
    total_blocks: int  # sessions + background


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split(","))
    return low, high


def make_plan(args: argparse.Namespace, tokenizer: Any, block_size: int) -> Plan:
    rng = random.Random(args.seed)
    sessions = agent_sessions(tokenizer, num_sessions=args.pause_sessions,
                              num_turns=args.pause_turns, system_tokens=args.pause_system_tokens,
                              message_tokens=_pair(args.pause_message_tokens),
                              answer_tokens=_pair(args.pause_answer_tokens), seed=args.seed)
    lo, hi = math.log(args.pause_min_s), math.log(args.pause_max_s)
    scale = args.pause_scale
    pauses = [[math.exp(rng.uniform(lo, hi)) * scale for _ in range(args.pause_turns)]
              for _ in sessions]
    starts = [rng.uniform(0.0, args.pause_max_s * scale / 4) for _ in sessions]
    head = len(sessions[0].segments.system_ids)
    own = 0
    for s in sessions:  # each session's final context beyond the shared head (answers at their max)
        own += (sum(len(m) for m in s.turn_message_ids) + sum(s.answer_lengths)
                + 8 * args.pause_turns)
    footprint = -(-(head + own) // block_size)
    horizon = max(st + sum(p) for st, p in zip(starts, pauses, strict=True)) + 10 * scale
    source = TokenSource(tokenizer, seed=args.seed + 1)
    interval = args.background_interval_s * scale
    background = [(k * interval, source.take(args.background_tokens))
                  for k in range(int(horizon / interval))] if interval > 0 else []
    total = footprint + len(background) * -(-args.background_tokens // block_size)
    return Plan(sessions, starts, pauses, background, footprint, total)


def summarize(turns: list[Turn]) -> dict[str, float | None]:
    num_prompt = sum(t.num_prompt_tokens for t in turns)
    ttfts = [t.ttft_s for t in turns]
    return {"num_turns": len(turns), "num_prompt_tokens": num_prompt,
            "hit_ratio": sum(t.num_cached_tokens for t in turns) / num_prompt,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "input_tok_s": percentile([t.num_prompt_tokens / t.ttft_s for t in turns], 50)}


def has_host_tier() -> bool:
    from engine.config import CacheConfig

    return "host_tier_bytes" in {f.name for f in dataclasses.fields(CacheConfig)}


def build(args: argparse.Namespace, num_blocks: int, bytes_per_block: int, mode: str,
          host_tier_bytes: int, clock: Any = time.monotonic) -> Any:
    from bench.engine_bench import load_model
    from engine.engine import LLMEngine
    from engine.engine_args import engine_config_from_args
    from engine.model_runner import ModelRunner

    config = engine_config_from_args(args)
    cache = dataclasses.replace(config.cache, kv_cache_memory_bytes=num_blocks * bytes_per_block,
                                retention_share_per_project=args.retention_share_per_project,
                                retention_share_total=args.retention_share_total)
    if mode == "retention+tier":
        cache = dataclasses.replace(cache, host_tier_bytes=host_tier_bytes)  # type: ignore[call-arg]
    config = dataclasses.replace(config, cache=cache)
    checkpoint, tokenizer = load_model(config.model_path)
    runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))
    runner.warmup()
    return LLMEngine(config, checkpoint.config, runner, tokenizer, clock=clock)


def bytes_per_block(args: argparse.Namespace) -> int:
    """The KV bytes of one block on this model and dtype, from a small engine."""
    probe = build(args, 64, 1 << 20, "lru", 0)  # 64 MiB: many blocks
    per_block = (64 << 20) // probe.kv_cache.num_blocks
    del probe
    gc.collect()
    return int(per_block)


# ---- report --------------------------------------------------------------------------------------
def verdicts(results: dict[str, dict[str, Any]]) -> list[str]:
    oracle = results.get("oracle")
    if oracle is None:
        return ["no oracle run: no targets checked"]
    lines = []
    for mode in ("retention", "retention+tier"):
        r = results.get(mode)
        if r is None:
            continue
        hit = r["hit_ratio"] / oracle["hit_ratio"] if oracle["hit_ratio"] else 0.0
        p90 = r["ttft_p90_s"] / oracle["ttft_p90_s"] if oracle["ttft_p90_s"] else float("inf")
        lines.append(f"{mode}: hit ratio {hit:.0%} of the oracle's (>= {TARGET_HIT_FRACTION:.0%}: "
                     f"{'met' if hit >= TARGET_HIT_FRACTION else 'NOT met'}), TTFT p90 {p90:.2f}x "
                     "the "
                     f"oracle's (<= {TARGET_TTFT_P90_RATIO}x: "
                     f"{'met' if p90 <= TARGET_TTFT_P90_RATIO else 'NOT met'})")
    return lines


def report(results: dict[str, dict[str, Any]], plan: Plan, pools: dict[str, int], notes: list[str],
           args: argparse.Namespace) -> str:
    headers = ["mode", "pool blocks", "turns", "hit %", "TTFT p50 s", "TTFT p90 s",
               "in tok/s (p50)", "vs LRU hit", "vs oracle TTFT p90"]
    lru, oracle = results.get("lru"), results.get("oracle")
    rows = []
    for mode, r in results.items():
        rows.append([mode, str(pools[mode]), str(r["num_turns"]), fmt(100 * r["hit_ratio"]),
                     fmt(r["ttft_p50_s"], 3), fmt(r["ttft_p90_s"], 3), fmt(r["input_tok_s"]),
                     fmt(r["hit_ratio"] / lru["hit_ratio"], 2) + "x" if lru and lru["hit_ratio"]
                     else "-",
                     fmt(r["ttft_p90_s"] / oracle["ttft_p90_s"], 2) + "x" if oracle else "-"])
    lines = [format_table(headers, rows), "",
             f"workload: {args.pause_sessions} sessions x {args.pause_turns} turns, "
             f"{len(plan.sessions[0].segments.system_ids)}-token shared system prompt with tools, "
             f"tool pauses log-uniform {args.pause_min_s:g}-{args.pause_max_s:g} s x "
             f"{args.pause_scale:g} (compressed time), {len(plan.background)} background prompts "
             f"of {args.background_tokens} tokens every "
             f"{args.background_interval_s * args.pause_scale:g} s from another tenant",
             f"sessions' distinct footprint {plan.footprint_blocks} blocks; pool "
             f"{args.pool_fraction:g} of it; retention {args.retention_s * args.pause_scale:g} s "
             f"(= {args.retention_s:g} s scaled), shares {args.retention_share_per_project:g} per "
             f"project / {args.retention_share_total:g} in all",
             *notes, "", "targets (best retention mode vs the oracle):",
             *("  " + v for v in verdicts(results))]
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: str, title: str) -> Path:
    modes = list(results)

    def series(key: str, scale: float = 1.0) -> dict[str, list[float | None]]:
        return {m: [v * scale if (v := results[m][key]) is not None else None] for m in modes}

    panels = [BarPanel("token hit ratio", "%", ["agent turns"], series("hit_ratio", 100.0)),
              BarPanel("TTFT p50", "s", ["agent turns"], series("ttft_p50_s")),
              BarPanel("TTFT p90", "s", ["agent turns"], series("ttft_p90_s")),
              BarPanel("input tokens/s (median turn)", "tokens/s", ["agent turns"],
                       series("input_tok_s"))]
    return write_bar_chart(path, title, panels)


def run(args: argparse.Namespace) -> int:
    import json

    import torch

    from bench.engine_bench import load_model
    from engine.engine_args import engine_config_from_args

    torch.set_num_threads(args.threads)
    config = engine_config_from_args(args)
    _, tokenizer = load_model(config.model_path)
    plan = make_plan(args, tokenizer, config.cache.block_size)
    per_block = bytes_per_block(args)
    pools = {"lru": int(plan.footprint_blocks * args.pool_fraction)}
    pools["retention"] = pools["retention+tier"] = pools["lru"]
    pools["oracle"] = int(plan.total_blocks * 1.25) + 64
    tier_bytes = int(plan.footprint_blocks * args.host_tier_fraction * per_block)
    notes = [f"KV block: {per_block / 1024:.0f} KiB; second tier {tier_bytes / 2**20:.0f} MiB"]
    modes = [m for m in args.modes.split(",") if m]
    if "retention+tier" in modes and not has_host_tier():
        modes.remove("retention+tier")
        notes.append("retention+tier: not run, this engine has no second KV tier "
                     "(CacheConfig.host_tier_bytes)")
    title = (f"{Path(config.model_path).name}: threads={args.threads} "
             f"decode_weights={config.decode_weights} "
             f"max_num_batched_tokens={config.scheduler.max_num_batched_tokens}")
    virtual = args.clock == "virtual"
    clock = f"virtual clock, step cost {args.step_cost} time" if virtual else "wall clock"
    notes.append(f"clock: {clock}")
    print(f"agent --pauses bench, {title}; modes {modes}; {clock}", file=sys.stderr)
    started = time.perf_counter()
    lanes = [Lane(mode, plan,
                  0.0 if mode in ("lru", "oracle") else args.retention_s * args.pause_scale,
                  virtual, args.step_cost) for mode in modes]

    def make_engine(lane: Lane) -> Any:
        return build(args, pools[lane.mode], per_block, lane.mode, tier_bytes, clock=lane.now)

    run_lanes(lanes, make_engine)
    results: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    for lane in lanes:
        results[lane.mode] = summarize(lane.turns)
        results[lane.mode]["engine_step_s"] = lane.step_s
        stats = lane.engine.stats()
        if lane.mode == "retention+tier":
            notes.append(f"retention+tier: {getattr(stats, 'num_host_tier_hit_tokens', 0)} hit "
                         f"tokens restored from the tier")
        print(f"  {lane.mode}: hit {results[lane.mode]['hit_ratio']:.1%}, engine steps "
              f"{lane.step_s:.0f} s", file=sys.stderr)
    print(f"  all modes: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    notes += tail_breakdown(lanes)
    if args.fanout_requests > 0:
        engine = build(args, pools["oracle"], per_block, "retention", 0)
        fanout = agent_fanout.run_fanout(args, engine, tokenizer)
        notes += fanout.lines()
        extra["fanout"] = dataclasses.asdict(fanout)
        del engine
    if args.turns_json:
        Path(args.turns_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.turns_json).write_text(json.dumps(
            {lane.mode: [turn_record(t) for t in lane.turns] for lane in lanes}, indent=1))
    del lanes
    gc.collect()
    text = report(results, plan, pools, notes, args)
    print(f"\n{title}\n\n{text}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"title": title, "results": results, **extra},
                                              indent=2))
    if args.plot:
        print(f"wrote {plot(results, args.plot, 'aigw bench agent --pauses - ' + title)}")
    return 0
