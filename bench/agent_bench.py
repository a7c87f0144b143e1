"""`aigw bench agent`: what the prefix cache buys on agent-shaped traffic, cache ON vs OFF in one
run.

Workloads (bench/workloads.py; deterministic for `--seed`):
  agent          S sessions x T turns in closed loops; one system prompt with a JSON tool schema
                 (~1,500 tokens, through the chat template); each turn appends a user message or a
                 tool result (100-200 tokens) after the previous answer, and generates 32-64 tokens.
  shared-prefix  SGLang's generated-shared-prefix shape: groups x prompts per group, all at t=0.
                 Default: the issue's comparison case, 16 requests sharing an 898-token prefix, 32
                 new tokens each.
  hit30          primed so that 30% of every prompt's tokens are cached (640-token prompts, 1 new
                 token): prefill throughput ON/OFF against the bound 1 / (1 - 0.3).
  zero-reuse     unique prompts: what the cache costs when it never hits.
Two engines over the same weights, one with prefix caching and one without; the ON engine's cache is
reset before each workload. Each (workload, mode) runs `--repeats` times, alternating which mode
goes first, and the run with the shortest wall time is kept.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engine_bench import build_engine, load_model
from bench.plotting import BarPanel, fmt, format_table, percentile, write_bar_chart
from bench.workloads import (
    AgentSession,
    Client,
    RequestRecord,
    TokenSource,
    agent_sessions,
    hit_ratio_prompts,
    one_shot,
    replay,
    shared_prefix_prompts,
    unique_prompts,
)

WORKLOADS = ("agent", "shared-prefix", "hit30", "zero-reuse")
VLLM_SHARED_PREFIX_OUT_TOK_S, VLLM_SHARED_PREFIX_TTFT_P50_S = 256.0, 0.90
TARGET_AGENT_TTFT_SPEEDUP, TARGET_AGENT_INPUT_SPEEDUP = 5.0, 3.0
TARGET_HIT_FRACTION_OF_BOUND, TARGET_ZERO_REUSE_MAX_COST = 0.90, 0.03


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.engine_args import add_engine_arguments

    add_engine_arguments(parser)
    parser.set_defaults(threads=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per (workload, mode); the fastest is kept")
    parser.add_argument("--sessions", type=int, default=8, help="agent: concurrent sessions (S)")
    parser.add_argument("--turns", type=int, default=4,
                        help="agent: sequential turns per session (T)")
    parser.add_argument("--agent-system-tokens", type=int, default=1500)
    parser.add_argument("--num-groups", type=int, default=1, help="shared-prefix: groups")
    parser.add_argument("--prompts-per-group", type=int, default=16)
    parser.add_argument("--system-prompt-len", type=int, default=898)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--hit-ratio", type=float, default=0.3)
    parser.add_argument("--hit-prompts", type=int, default=16)
    parser.add_argument("--hit-prompt-tokens", type=int, default=640)
    parser.add_argument("--zero-prompts", type=int, default=16)
    parser.add_argument("--zero-prompt-tokens", type=int, default=512)
    parser.add_argument("--zero-output-tokens", type=int, default=16)
    parser.add_argument("--tiny", action="store_true",
                        help="smoke-test sizes; the figures mean nothing")
    parser.add_argument("--plot", default=None, help="write a PNG here")
    parser.add_argument("--json", default=None, help="write the figures as JSON here")
    from bench import agent_pauses

    agent_pauses.add_arguments(parser)  # --pauses and its options (bench/agent_pauses.py)


def apply_tiny(args: argparse.Namespace) -> None:
    args.sessions, args.turns, args.agent_system_tokens = 2, 2, 150
    args.num_groups, args.prompts_per_group, args.system_prompt_len = 1, 3, 64
    args.question_len, args.output_len = 8, 3
    args.hit_prompts, args.hit_prompt_tokens, args.hit_ratio = 2, 64, 0.25
    args.zero_prompts, args.zero_prompt_tokens, args.zero_output_tokens = 2, 32, 2
    args.threads, args.repeats = 1, 1
    args.kv_cache_memory = min(args.kv_cache_memory, 64 << 20)


@dataclass(frozen=True)
class Workload:
    name: str
    describe: str
    # fresh clients per run (agent sessions hold state)
    make_clients: Callable[[], Sequence[Client]]
    primers: list[list[int]]  # run (1 token each) before the measured requests, not measured
    design_hit_ratio: float | None = None


def make_workloads(args: argparse.Namespace, tokenizer: Any, block_size: int) -> list[Workload]:
    source = TokenSource(tokenizer, seed=args.seed)
    out: list[Workload] = []
    for name in [w for w in args.workloads.split(",") if w]:
        if name == "agent":
            turn_tokens = (min(100, args.agent_system_tokens // 4),
                           min(200, args.agent_system_tokens // 3))
            answer_tokens = (32, 64) if not args.tiny else (3, 5)

            sessions = agent_sessions(tokenizer, num_sessions=args.sessions, num_turns=args.turns,
                                      system_tokens=args.agent_system_tokens,
                                      message_tokens=turn_tokens,
                                      answer_tokens=answer_tokens, seed=args.seed)
            system_tokens = len(sessions[0].segments.system_ids)
            out.append(Workload(name,
                                f"{args.sessions} sessions x {args.turns} turns, "
                                f"{system_tokens}-token "
                                      f"system prompt with tools, {turn_tokens} tokens per turn "
                                      "message, "
                                      f"{answer_tokens} out",
                                functools.partial(_fresh_sessions, sessions), []))
        elif name == "shared-prefix":
            prompts = shared_prefix_prompts(source, num_groups=args.num_groups,
                                            prompts_per_group=args.prompts_per_group,
                                            system_tokens=args.system_prompt_len,
                                            question_tokens=args.question_len)
            out.append(Workload(name, f"{args.num_groups} x {args.prompts_per_group} requests, "
                                      f"{args.system_prompt_len}-token prefix + "
                                      f"{args.question_len}, {args.output_len} out",
                                functools.partial(one_shot, prompts, args.output_len), []))
        elif name == "hit30":
            primers, prompts = hit_ratio_prompts(source, num_prompts=args.hit_prompts,
                                                 prompt_tokens=args.hit_prompt_tokens,
                                                 hit_ratio=args.hit_ratio, block_size=block_size)
            ratio = len(primers[0]) / args.hit_prompt_tokens
            out.append(Workload(name, f"{args.hit_prompts} x {args.hit_prompt_tokens} tokens, "
                                      f"{len(primers[0])} primed ({ratio:.0%}), 1 out",
                                functools.partial(one_shot, prompts, 1), primers, ratio))
        elif name == "zero-reuse":
            prompts = unique_prompts(source, num_prompts=args.zero_prompts,
                                     prompt_tokens=args.zero_prompt_tokens)
            out.append(Workload(name,
                                f"{args.zero_prompts} unique x {args.zero_prompt_tokens} tokens, "
                                      f"{args.zero_output_tokens} out",
                                functools.partial(one_shot, prompts, args.zero_output_tokens), []))
        else:
            raise SystemExit(f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})")
    return out


def _fresh_sessions(sessions: list[AgentSession]) -> list[Client]:
    return [s.fresh() for s in sessions]


def summarize(records: list[RequestRecord], num_preemptions: int) -> dict[str, float | None]:
    wall = max(r.finish_s or 0.0 for r in records) - min(r.arrival_s for r in records)
    num_prompt = sum(r.num_prompt_tokens for r in records)
    ttfts, e2es = [r.ttft_s for r in records], [r.e2e_s for r in records]
    return {"num_requests": len(records), "wall_s": wall, "num_prompt_tokens": num_prompt,
            "hit_ratio": sum(r.num_cached_tokens for r in records) / num_prompt,
            "input_tok_s": num_prompt / wall,
            "output_tok_s": sum(r.num_output_tokens for r in records) / wall,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "e2e_p50_s": percentile(e2es, 50), "e2e_p90_s": percentile(e2es, 90),
            "num_preemptions": num_preemptions}


def run_once(engine: Any, workload: Workload, caching: bool) -> dict[str, float | None]:
    if caching:
        engine.reset_prefix_cache()
    if workload.primers:
        replay(engine, one_shot(workload.primers, 1))
    preemptions = engine.stats().num_preemptions_total
    records = replay(engine, workload.make_clients())
    return summarize(records, engine.stats().num_preemptions_total - preemptions)


# ---- report --------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def verdicts(name: str, on: dict[str, Any], off: dict[str, Any], workload: Workload,
             args: argparse.Namespace) -> list[str]:
    """The issue's targets for one workload, each as 'figure vs target: met / NOT met'."""
    def check(ok: bool) -> str:
        return "met" if ok else "NOT met"

    if name == "shared-prefix":
        default_shape = (args.num_groups, args.prompts_per_group, args.system_prompt_len,
                         args.output_len) == (1, 16, 898, 32)
        note = "" if default_shape else " (not the issue's 16 x 898 + 32 shape: compare with care)"
        return [f"output tok/s with cache {fmt(on['output_tok_s'])} vs vLLM CPU "
                f"{VLLM_SHARED_PREFIX_OUT_TOK_S:.0f}: "
                f"{check(on['output_tok_s'] >= VLLM_SHARED_PREFIX_OUT_TOK_S)}{note}",
                f"TTFT p50 with cache {fmt(on['ttft_p50_s'], 2)} s vs vLLM CPU "
                f"{VLLM_SHARED_PREFIX_TTFT_P50_S} s: "
                f"{check(on['ttft_p50_s'] <= VLLM_SHARED_PREFIX_TTFT_P50_S)}"]
    if name == "agent":
        ttft = _ratio(off["ttft_p50_s"], on["ttft_p50_s"]) or 0.0
        tput = _ratio(on["input_tok_s"], off["input_tok_s"]) or 0.0
        return [f"TTFT p50 off/on {ttft:.2f}x (>= {TARGET_AGENT_TTFT_SPEEDUP:.0f}x): "
                f"{check(ttft >= TARGET_AGENT_TTFT_SPEEDUP)}",
                f"input tok/s on/off {tput:.2f}x (>= {TARGET_AGENT_INPUT_SPEEDUP:.0f}x): "
                f"{check(tput >= TARGET_AGENT_INPUT_SPEEDUP)}"]
    if name == "hit30":
        bound = 1.0 / (1.0 - (workload.design_hit_ratio or 0.0))
        gain = _ratio(on["input_tok_s"], off["input_tok_s"]) or 0.0
        return [f"prefill tok/s on/off {gain:.2f}x, bound 1/(1-{workload.design_hit_ratio:.2f}) = "
                f"{bound:.2f}x: {gain / bound:.0%} of bound (>= "
                f"{TARGET_HIT_FRACTION_OF_BOUND:.0%}): "
                f"{check(gain / bound >= TARGET_HIT_FRACTION_OF_BOUND)}"]
    if name == "zero-reuse":
        cost = 1.0 - (_ratio(on["input_tok_s"], off["input_tok_s"]) or 0.0)
        return [f"cache cost {cost:+.1%} of input tok/s (<= {TARGET_ZERO_REUSE_MAX_COST:.0%}): "
                f"{check(cost <= TARGET_ZERO_REUSE_MAX_COST)}"]
    return []


def report(results: dict[str, dict[str, Any]], workloads: list[Workload],
           args: argparse.Namespace) -> str:
    headers = ["workload", "cache", "hit %", "in tok/s", "out tok/s", "TTFT p50 s", "TTFT p90 s",
               "e2e p50 s", "e2e p90 s", "wall s", "preempt"]
    rows = []
    for w in workloads:
        for mode in ("on", "off"):
            r = results[w.name][mode]
            rows.append([w.name, mode, fmt(100 * r["hit_ratio"]), fmt(r["input_tok_s"]),
                         fmt(r["output_tok_s"]),
                         *(fmt(r[k], 3)
                           for k in ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "e2e_p90_s")),
                         fmt(r["wall_s"], 2), str(r["num_preemptions"])])
    lines = [format_table(headers, rows), "", "workloads:"]
    lines += [f"  {w.name}: {w.describe}" for w in workloads]
    lines += ["",
              "on/off and targets (issue: prompt caching; vLLM CPU on this machine, 16 x 898 + 32: "
                  "256 out tok/s and 0.90 s TTFT p50 with its cache, 47.5 and 5.68 s without):"]
    for w in workloads:
        on, off = results[w.name]["on"], results[w.name]["off"]
        lines.append(f"  {w.name}: TTFT p50 off/on "
                     f"{fmt(_ratio(off['ttft_p50_s'], on['ttft_p50_s']), 2)}x, input tok/s on/off "
                     f"{fmt(_ratio(on['input_tok_s'], off['input_tok_s']), 2)}x, output tok/s "
                     f"on/off {fmt(_ratio(on['output_tok_s'], off['output_tok_s']), 2)}x")
        lines += [f"    {v}" for v in verdicts(w.name, on, off, w, args)]
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: str, title: str) -> Path:
    names = list(results)

    def series(key: str, scale: float = 1.0) -> dict[str, list[float | None]]:
        return {f"cache {m}": [v * scale if (v := results[n][m][key]) is not None else None
                               for n in names]
                for m in ("on", "off")}

    panels = [BarPanel("TTFT p50", "s", names, series("ttft_p50_s")),
              BarPanel("input tokens/s", "tokens/s", names, series("input_tok_s")),
              BarPanel("output tokens/s", "tokens/s", names, series("output_tok_s")),
              BarPanel("e2e latency p50", "s", names, series("e2e_p50_s")),
              BarPanel("token hit ratio", "%", names, series("hit_ratio", 100.0))]
    return write_bar_chart(path, title, panels)


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.engine_args import engine_config_from_args

    if args.pauses:
        from bench import agent_pauses

        if args.tiny:
            agent_pauses.apply_tiny(args)
        return agent_pauses.run(args)
    if args.tiny:
        apply_tiny(args)
    torch.set_num_threads(args.threads)
    config = engine_config_from_args(args)
    _, tokenizer = load_model(config.model_path)
    workloads = make_workloads(args, tokenizer, config.cache.block_size)
    engines = {"on": build_engine(args, enable_prefix_caching=True),
               "off": build_engine(args, enable_prefix_caching=False)}
    title = (f"{Path(config.model_path).name}: threads={args.threads} "
             f"dtype={config.resolved_dtype} decode_weights={config.decode_weights} "
             f"compile={config.compile} "
             f"max_num_batched_tokens={config.scheduler.max_num_batched_tokens}")
    print(f"agent bench, {title}", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {}
    for w in workloads:
        started = time.perf_counter()
        runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        for repeat in range(args.repeats):
            for mode in (("on", "off") if repeat % 2 == 0 else ("off", "on")):
                runs[mode].append(run_once(engines[mode], w, caching=mode == "on"))
        results[w.name] = {mode: min(rs, key=lambda r: r["wall_s"]) for mode, rs in runs.items()}
        print(f"  {w.name} done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(f"\n{title}\n")
    print(report(results, workloads, args))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"title": title, "results": results}, indent=2))
    if args.plot:
        print(f"wrote {plot(results, args.plot, 'aigw bench agent (cache on vs off) - ' + title)}")
    return 0
