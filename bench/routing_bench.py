"""`aigw bench routing`: routing policies on agent-loop, shared-prefix and zero-reuse traffic.

Policies: round-robin, least-load, session-hash, prefix (ours: gateway/routing/), and in the
simulator an oracle (our scoring on exact cache contents) for the hit-ratio comparison.

  --mode sim    8-16 simulated replicas with LRU block caches (bench/routing_sim.py), costs
                calibrated on a real replica (`--calibrate`) or given (`--prefill-ms-per-token`,
                `--decode-ms-per-token`); each workload at several arrival rates, KV scarce.
  --mode real   2-3 real `aigw replica` processes (small KV) behind the real gateway app, one
                gateway per policy; short runs (this machine has 2 cores).
Reports token hit ratio, TTFT p50/p90, output tokens/s and load imbalance (max/mean busy time or
requests per replica), the targets of issue 6, and a PNG with `--plot`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from bench.plotting import BarPanel, fmt, format_table, write_bar_chart
from bench.routing_sim import (
    BLOCK_SIZE,
    POLICIES,
    SimConfig,
    SimResult,
    agent_workload,
    shared_prefix_workload,
    simulate,
    zero_reuse_workload,
)
from gateway.routing.scoring import ScoringConfig

WORKLOADS = ("agent", "shared-prefix", "zero-reuse")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=["sim", "real", "both"], default="sim")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="write a PNG here")
    parser.add_argument("--json", default=None, help="write the figures as JSON here")
    sim = parser.add_argument_group("simulator")
    sim.add_argument("--replicas", type=int, default=8)
    sim.add_argument("--cache-blocks", type=int, default=400, help="LRU blocks per replica")
    sim.add_argument("--rates", default="0.5,1,2",
                     help="arrival rates, as multiples of the fleet's no-cache capacity")
    sim.add_argument("--prefill-ms-per-token", type=float, default=0.2)
    sim.add_argument("--decode-ms-per-token", type=float, default=1.0,
                     help="marginal decode cost per token of one request in a batch")
    sim.add_argument("--calibrate", action="store_true",
                     help="measure both costs on a real replica first (~1 minute)")
    sim.add_argument("--event-lag-ms", type=float, default=100.0)
    real = parser.add_argument_group("real replicas")
    real.add_argument("--real-replicas", type=int, default=2)
    real.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="bytes per replica")
    real.add_argument("--concurrency", type=int, default=4)


# ---- simulator ---------------------------------------------------------------------------------
def sim_workload(name: str, rng: random.Random, rate: float) -> list[Any]:
    if name == "agent":
        # 6 turns each
        return agent_workload(rng, num_sessions=64, num_turns=6, rate_per_s=rate / 6)
    if name == "shared-prefix":
        return shared_prefix_workload(rng, num_groups=32, prompts_per_group=16, rate_per_s=rate,
                                      system_tokens=1024, question_tokens=64, output_tokens=32)
    return zero_reuse_workload(rng, num_requests=400, rate_per_s=rate, prompt_tokens=1088,
                               output_tokens=32)


def run_sim(args: argparse.Namespace, prefill_s: float, decode_s: float) -> list[dict[str, Any]]:
    decode_blocks = decode_s * 40 / (prefill_s * BLOCK_SIZE)  # ~40 output tokens per request
    config = SimConfig(num_replicas=args.replicas, num_cache_blocks=args.cache_blocks,
                       prefill_s_per_token=prefill_s, decode_s_per_token=decode_s,
                       event_lag_s=args.event_lag_ms / 1000,
                       scoring=ScoringConfig(decode_blocks_per_request=decode_blocks))
    service_s = prefill_s * 1100 + decode_s * 40  # a typical request with no cache hit
    capacity = args.replicas / service_s
    rows = []
    for workload in args.workloads.split(","):
        for multiple in (float(m) for m in args.rates.split(",")):
            for policy in POLICIES:
                result = simulate(config, policy, sim_workload(workload, random.Random(args.seed),
                                                               capacity * multiple))
                rows.append(_sim_row(workload, multiple, policy, result))
    return rows


def _sim_row(workload: str, multiple: float, policy: str, result: SimResult) -> dict[str, Any]:
    return {"mode": "sim", "workload": workload, "load": multiple, "policy": policy,
            "hit_ratio": result.token_hit_ratio, "ttft_p50_s": result.ttft_s(50),
            "ttft_p90_s": result.ttft_s(90), "output_tok_s": result.output_tokens_per_s,
            "imbalance": result.imbalance}


# ---- report ------------------------------------------------------------------------------------
def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 6's targets, checked on the simulator rows at the highest load of each workload."""
    lines = []
    for workload in {r["workload"] for r in rows if r["mode"] == "sim"}:
        top = max(r["load"] for r in rows if r["workload"] == workload and r["mode"] == "sim")
        ours = _find(rows, mode="sim", workload=workload, load=top, policy="prefix")
        oracle = _find(rows, mode="sim", workload=workload, load=top, policy="oracle")
        rr = _find(rows, mode="sim", workload=workload, load=top, policy="round-robin")
        least = _find(rows, mode="sim", workload=workload, load=top, policy="least-load")
        if not (ours and oracle and rr and least):
            continue
        if oracle["hit_ratio"] > 0:
            share = ours["hit_ratio"] / oracle["hit_ratio"]
            lines.append(f"{workload} @{top:g}x: hit ratio {share:.0%} of the oracle's (target >= "
                         "90%)")
        lines.append(f"{workload} @{top:g}x: max/mean load {ours['imbalance']:.2f} (target <= 1.3)")
        if workload == "shared-prefix":
            gain = ours["output_tok_s"] / rr["output_tok_s"]
            lines.append(f"{workload} @{top:g}x: throughput {gain:.2f}x round-robin's (target >= "
                         "2x)")
        if workload == "zero-reuse":
            ratio = ours["output_tok_s"] / least["output_tok_s"]
            lines.append(f"{workload} @{top:g}x: throughput {ratio:.3f}x least-load's (target >= "
                         "~1)")
    return sorted(lines)


def print_rows(rows: list[dict[str, Any]]) -> None:
    headers = ["mode", "workload", "load", "policy", "hit", "TTFT p50 s", "TTFT p90 s", "out tok/s",
               "max/mean"]
    print(format_table(headers, [[r["mode"], r["workload"], f"{r['load']:g}", r["policy"],
                                  f"{r['hit_ratio']:.3f}", fmt(r["ttft_p50_s"], 3),
                                  fmt(r["ttft_p90_s"], 3), fmt(r["output_tok_s"], 0),
                                  f"{r['imbalance']:.2f}"] for r in rows]))


def plot(path: str, rows: list[dict[str, Any]]) -> None:
    panels = []
    for mode in sorted({r["mode"] for r in rows}):
        subset = [r for r in rows if r["mode"] == mode]
        cases = list(dict.fromkeys((r["workload"], r["load"]) for r in subset))
        categories = [f"{w}@{load:g}" for w, load in cases]
        policies = list(dict.fromkeys(r["policy"] for r in subset))
        for key, title in (("hit_ratio", "token hit ratio"), ("ttft_p50_s", "TTFT p50 (s)"),
                           ("output_tok_s", "output tokens/s"), ("imbalance", "max/mean load")):
            series = {p: [(_find(subset, workload=w, load=load, policy=p) or {}).get(key)
                          for w, load in cases] for p in policies}
            panels.append(BarPanel(f"{mode}: {title}", title, categories, series))
    write_bar_chart(path, "aigw bench routing", panels, columns=4)


def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    prefill_s, decode_s = args.prefill_ms_per_token / 1000, args.decode_ms_per_token / 1000
    if args.calibrate or args.mode in ("real", "both"):
        from bench.routing_real import calibrate, run_real

        if args.calibrate:
            prefill_s, decode_s = calibrate(args)
            print(f"calibrated: prefill {prefill_s * 1e3:.3f} ms/token, decode "
                  f"{decode_s * 1e3:.3f} ms/token (marginal, batched)")
        if args.mode in ("real", "both"):
            started = time.perf_counter()
            rows += run_real(args)
            print(f"real replicas: {time.perf_counter() - started:.0f} s")
    if args.mode in ("sim", "both"):
        rows += run_sim(args, prefill_s, decode_s)
    print_rows(rows)
    for line in targets(rows):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(args.plot, rows)
        print(f"wrote {args.plot}")
    return 0
