"""`aigw bench slo`: goodput under latency targets, the SLO scheduler against the fixed budget.

Two engines of the same model over the same weights: the baseline with `--scheduler-policy
fixed` and no targets (today's scheduler: the fixed token budget, no admission control; with a
target even `fixed` would refuse), and one with `--scheduler-policy slo` and the targets
(`--ttft-p90-ms`, `--tpot-p90-ms`: the step sized from measured step times, admission refusing
with 429 + Retry-After what would break the TTFT target: engine/slo.py). Both policies' answers
are judged against the same targets at the client. Poisson arrivals (bench/slo_load.py) at each
of `--rates`, for `--duration-s` each.

Clock (`--clock`): virtual by default (bench/slo_virtual.py): both engines in this process, driven
directly, each on its own clock that a step advances by its thread CPU time and that skips idle
time; the engines' step-time models (the SLO policy's plan and admission) learn the same CPU-time
step costs, and the two policies interleave within each cell. On a shared machine wall time
measures the other processes; CPU time the engine. `--clock wall`: real replica servers
(engine/server over AsyncEngine) in this process on 127.0.0.1, driven over HTTP in real time; the
two policies alternate cell by cell, so drift on a shared machine hits both alike.

Workloads (bench/workloads.py, deterministic for `--seed`):
  agent  sessions of `--turns` turns on one system prompt with a tool schema; sessions start as a
         Poisson process of rate / turns, each turn after the previous answer
  mixed  one-shot requests: `--long-fraction` long prompts (`--long-tokens` in, `--long-output`
         out) among short ones (`--short-tokens`, `--short-output`)
A `--priority-fraction` of the requests (agent: of the sessions) are `service_tier: priority`,
the rest `default`.

Per cell: requests sent, refused (429), finished, cut (unanswered when the cell's drain timeout
ends it); TTFT and TPOT p90 of the finished ones; the
priority class's TTFT p90; goodput = requests a second (over the arrival window) that finished
within both targets; attainment = the fraction of those sent. The knee is the highest rate at
which the fixed budget still meets both targets for >= KNEE_ATTAINMENT of what it is sent (when
no rate does, the rate of its best goodput); the report gives slo's best goodput over fixed's best
(the issue: >= 1.3x), and whether priority's TTFT p90 under slo stays inside the target at every
rate up to 2x the knee.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.plotting import fmt, format_table
from bench.slo_load import (
    Arrival,
    CellSummary,
    agent_plan,
    mixed_plan,
    run_plan,
    summarize,
)
from bench.workloads import TokenSource, agent_sessions

POLICIES = ("fixed", "slo")
WORKLOADS = ("agent", "mixed")
KNEE_ATTAINMENT = 0.9
TARGET_GOODPUT_RATIO = 1.3
RESULTS_PATHS = {"wall": Path("bench/results/slo.md"),
                 "virtual": Path("bench/results/slo-virtual-cpu.md")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.engine_args import add_engine_arguments

    add_engine_arguments(parser)
    # threads: None -> 1 on the virtual clock (a step's thread CPU time is then its whole work),
    # 2 on the wall clock
    parser.set_defaults(threads=None, ttft_p90_ms=3000.0, tpot_p90_ms=200.0,
                        kv_cache_memory=256 << 20)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rates", default="0.25,0.5,1,1.5,2,3",
                        help="offered requests per second, comma-separated, rising")
    parser.add_argument("--duration-s", type=float, default=60.0, help="arrival window per cell")
    parser.add_argument("--drain-timeout-s", type=float, default=60.0,
                        help="after the window, how long a cell waits for its last answers")
    parser.add_argument("--priority-fraction", type=float, default=0.2)
    parser.add_argument("--sessions", type=int, default=64, help="agent: distinct session plans")
    parser.add_argument("--turns", type=int, default=3, help="agent: turns per session")
    parser.add_argument("--agent-system-tokens", type=int, default=600)
    parser.add_argument("--long-fraction", type=float, default=0.2, help="mixed: long prompts")
    parser.add_argument("--short-tokens", type=int, default=64)
    parser.add_argument("--short-output", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=768)
    parser.add_argument("--long-output", type=int, default=8)
    parser.add_argument("--clock", choices=("virtual", "wall"), default="virtual",
                        help="virtual: in-process engines, a step costs its thread CPU time, idle "
                             "time skipped, the policies interleaved; wall: replica servers over "
                             "HTTP in real time")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke-test sizes; the figures mean nothing")
    parser.add_argument("--plot", default=None, help="write a PNG of goodput vs rate here")
    parser.add_argument("--json", default=None, help="write the cells as JSON here")
    parser.add_argument("--step-log", default=None,
                        help="virtual clock: write every engine step (plan, predicted and "
                             "measured cost, sequences) as JSON lines here")
    parser.add_argument("--results", default=None,
                        help="write the raw results (markdown) here (default: "
                             "bench/results/slo-virtual-cpu.md, or slo.md with --clock wall); "
                             "'none': nowhere")


def apply_tiny(args: argparse.Namespace) -> None:
    args.rates, args.duration_s, args.drain_timeout_s = "2,8", 1.5, 30.0
    args.sessions, args.turns, args.agent_system_tokens = 4, 2, 120
    args.short_tokens, args.short_output, args.long_tokens, args.long_output = 16, 3, 64, 2
    args.threads = 1
    args.kv_cache_memory = min(args.kv_cache_memory, 64 << 20)


# ---- the two replicas, served in this process ----------------------------------------------------
class ReplicaThread:
    """One replica server (engine/server) over its own AsyncEngine, on a loop thread."""

    def __init__(self, engine: Any) -> None:
        from engine.async_engine import AsyncEngine

        self.engine = AsyncEngine(engine)
        self.model = engine.model_config.model_id
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="slo-bench-replica", daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the replica server did not start")

    def _run(self) -> None:
        from engine.server import ReplicaServerSettings
        from engine.server.app import create_runner

        async def serve() -> None:
            from aiohttp import web

            runner = create_runner(self.engine, ReplicaServerSettings(), shutdown_timeout_s=1.0)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            self.url = f"http://{host}:{port}"
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

        self._loop.run_until_complete(serve())

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self.engine.shutdown()


def policy_args(args: argparse.Namespace, policy: str) -> argparse.Namespace:
    """The engine arguments of `policy`. The baseline is the scheduler as it runs without targets:
    the fixed budget and no admission control (a target would make even `fixed` refuse); the
    targets still judge its answers at the client."""
    targets = {} if policy == "slo" else {"ttft_p90_ms": None, "tpot_p90_ms": None}
    return argparse.Namespace(**{**vars(args), "scheduler_policy": policy, **targets})


def start_replicas(args: argparse.Namespace) -> dict[str, ReplicaThread]:
    from bench.engine_bench import build_engine

    return {policy: ReplicaThread(build_engine(policy_args(args, policy))) for policy in POLICIES}


# ---- the run -------------------------------------------------------------------------------------
def make_plan(args: argparse.Namespace, workload: str, rate: float, tokenizer: Any,
              sessions: list[Any]) -> list[Arrival]:
    rng = random.Random(f"{args.seed}/{workload}/{rate}")  # the same plan for both policies
    if workload == "agent":
        return agent_plan(sessions, rate, args.duration_s, rng,
                          priority_fraction=args.priority_fraction)
    source = TokenSource(tokenizer, seed=rng.randrange(1 << 30))
    return mixed_plan(source, rate, args.duration_s, rng, priority_fraction=args.priority_fraction,
                      long_fraction=args.long_fraction,
                      short=(args.short_tokens, args.short_output),
                      long=(args.long_tokens, args.long_output))


def run_cell(replica: ReplicaThread, plan: list[Arrival], args: argparse.Namespace, rate: float,
             tokenizer: Any) -> CellSummary:
    filler = TokenSource(tokenizer, seed=args.seed + 1)
    records = asyncio.run(run_plan(replica.url, replica.model, plan, args.drain_timeout_s, filler))
    return summarize(records, rate, args.duration_s, args.ttft_p90_ms / 1000.0,
                     args.tpot_p90_ms / 1000.0)


def knee_rate(cells: list[CellSummary]) -> tuple[float | None, str]:
    """(the knee, how it was found): the highest rate at which the policy met both targets for
    KNEE_ATTAINMENT of its requests; when not even the lowest rate did (targets tight for the
    machine), the rate of its best goodput."""
    met = [c.rate_per_s for c in cells if c.attainment >= KNEE_ATTAINMENT]
    if met:
        return max(met), f"attainment >= {KNEE_ATTAINMENT:.0%}"
    if not cells:
        return None, "no cells"
    best = max(cells, key=lambda c: c.goodput_per_s)
    return (best.rate_per_s,
            f"no rate reached {KNEE_ATTAINMENT:.0%} attainment: fixed's best goodput")


def verdicts(results: dict[str, dict[str, list[CellSummary]]],
             args: argparse.Namespace) -> list[str]:
    lines = []
    target_s = args.ttft_p90_ms / 1000.0
    for workload, by_policy in results.items():
        fixed, slo = by_policy["fixed"], by_policy["slo"]
        best_fixed = max((c.goodput_per_s for c in fixed), default=0.0)
        best_slo = max((c.goodput_per_s for c in slo), default=0.0)
        ratio = best_slo / best_fixed if best_fixed else None
        knee, found = knee_rate(fixed)
        at_knee = next((c for c in fixed if c.rate_per_s == knee), None)
        lines.append(f"{workload}: knee (fixed; {found}) {fmt(knee, 2)} req/s, goodput there "
                     f"{fmt(at_knee.goodput_per_s if at_knee else None, 2)}; best goodput fixed "
                     f"{best_fixed:.2f} vs slo {best_slo:.2f} req/s: slo/fixed {fmt(ratio, 2)}x "
                     f"(>= {TARGET_GOODPUT_RATIO}x: "
                     f"{'met' if ratio and ratio >= TARGET_GOODPUT_RATIO else 'NOT met'})")
        if knee is None:
            continue
        upto = [c for c in slo if c.rate_per_s <= 2 * knee + 1e-9 and c.priority_num_sent]
        inside = [c for c in upto if c.priority_ttft_p90_s is not None
                  and c.priority_ttft_p90_s <= target_s]
        worst = max((c.priority_ttft_p90_s for c in upto if c.priority_ttft_p90_s is not None),
                    default=None)
        tested = max((c.rate_per_s for c in upto), default=0.0)
        short = "" if tested >= 2 * knee else " (the rates stop short of 2x: add higher ones)"
        lines.append(f"  priority TTFT p90 under slo up to 2x the knee ({2 * knee:g} req/s; rates "
                     f"run up to {tested:g}): worst {fmt(worst, 3)} s vs target {target_s:g} s: "
                     f"{'met' if upto and len(inside) == len(upto) else 'NOT met'}"
                     f"{short}")
    return lines


def report(results: dict[str, dict[str, list[CellSummary]]], args: argparse.Namespace) -> str:
    headers = ["workload", "rate/s", "policy", "sent", "refused", "done", "cut", "good",
               "goodput/s", "attain %", "TTFT p90 s", "TPOT p90 ms", "prio TTFT p90 s",
               "prio refused", "slo/fixed"]
    rows = []
    for workload, by_policy in results.items():
        for fixed, slo in zip(by_policy["fixed"], by_policy["slo"], strict=True):
            for policy, c in (("fixed", fixed), ("slo", slo)):
                rows.append([workload, fmt(c.rate_per_s, 2), policy, str(c.num_sent),
                             str(c.num_refused), str(c.num_finished), str(c.num_unfinished),
                             str(c.num_good),
                             fmt(c.goodput_per_s, 2), fmt(100 * c.attainment),
                             fmt(c.ttft_p90_s, 3),
                             fmt(c.tpot_p90_s * 1000 if c.tpot_p90_s is not None else None),
                             fmt(c.priority_ttft_p90_s, 3),
                             f"{c.priority_num_refused}/{c.priority_num_sent}",
                             "" if policy == "fixed" else _ratio_text(slo, fixed)])
    return "\n".join([format_table(headers, rows), "", *verdicts(results, args)])


def _ratio_text(slo: CellSummary, fixed: CellSummary) -> str:
    """slo's goodput over fixed's at one rate ("inf": fixed had none)."""
    if not fixed.goodput_per_s:
        return "inf" if slo.goodput_per_s else "-"
    return f"{slo.goodput_per_s / fixed.goodput_per_s:.2f}x"


def plot(results: dict[str, dict[str, list[CellSummary]]], path: str, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.0), squeeze=False)
    for ax, (workload, by_policy) in zip(axes.flat, results.items(), strict=False):
        for policy, cells in by_policy.items():
            ax.plot([c.rate_per_s for c in cells], [c.goodput_per_s for c in cells], marker="o",
                    label=f"{policy} goodput")
        rates = [c.rate_per_s for c in by_policy["fixed"]]
        ax.plot(rates, rates, color="grey", linestyle=":", linewidth=1, label="offered")
        ax.set_title(workload, fontsize=10)
        ax.set_xlabel("offered requests/s", fontsize=9)
        ax.set_ylabel("requests/s within both targets", fontsize=9)
        ax.legend(fontsize=8)
    import textwrap

    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def raw_cells(results: dict[str, dict[str, list[CellSummary]]]) -> dict[str, Any]:
    return {workload: {policy: [asdict(c) for c in cells] for policy, cells in by_policy.items()}
            for workload, by_policy in results.items()}


CLOCK_NOTES = {
    "wall": "A shared 2-core machine is noisy: read the ratios of the two policies (measured "
            "alternately in one run), not the absolute figures.",
    "virtual": "Virtual clock: each policy's engine in this process on its own clock, advanced by "
               "each step's thread CPU time (idle time skipped), the policies interleaved within "
               "each cell; other processes' load on a shared machine stretches the run's wall "
               "time, not the figures.",
}


def write_results(path: Path, text: str, title: str,
                  results: dict[str, dict[str, list[CellSummary]]], clock: str = "wall") -> None:
    import json

    command = (" ".join(["aigw", "bench", "slo", *sys.argv[3:]])
               if sys.argv[1:3] == ["bench", "slo"] else "aigw bench slo")
    raw = raw_cells(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# `aigw bench slo`: goodput under latency targets, slo vs fixed scheduler\n\n"
        f"Raw results of the last run, as it printed them. {CLOCK_NOTES[clock]}"
        f"\n\nCommand: `{command}`\n\n{title}\n\n```\n{text}\n```\n\n"
        f"Raw cells:\n\n```json\n{json.dumps(raw, indent=1)}\n```\n")


def run_wall(args: argparse.Namespace, workloads: list[str], rates: list[float], tokenizer: Any,
             sessions: list[Any]) -> dict[str, dict[str, list[CellSummary]]]:
    """Replica servers over HTTP in real time, the policies alternating cell by cell."""
    replicas = start_replicas(args)
    results: dict[str, dict[str, list[CellSummary]]] = {}
    try:
        for workload in workloads:
            results[workload] = {policy: [] for policy in POLICIES}
            for i, rate in enumerate(rates):
                plan = make_plan(args, workload, rate, tokenizer, sessions)
                for policy in (POLICIES if i % 2 == 0 else POLICIES[::-1]):
                    started = time.perf_counter()
                    cell = run_cell(replicas[policy], plan, args, rate, tokenizer)
                    results[workload][policy].append(cell)
                    print(f"  {workload} {rate:g}/s {policy}: goodput {cell.goodput_per_s:.2f}/s, "
                          f"{cell.num_refused} refused ({time.perf_counter() - started:.0f} s)",
                          file=sys.stderr)
    finally:
        for replica in replicas.values():
            replica.close()
    return results


def run_virtual(args: argparse.Namespace, workloads: list[str], rates: list[float], tokenizer: Any,
                sessions: list[Any], notes: list[str]) -> dict[str, dict[str, list[CellSummary]]]:
    """In-process engines on virtual clocks, the policies interleaved within each cell
    (bench/slo_virtual.py)."""
    from bench.slo_virtual import Lane, StepLog, VirtualClock, build_engine, probe_costs, run_lanes

    clocks = {policy: VirtualClock() for policy in POLICIES}
    engines = {policy: build_engine(policy_args(args, policy), clocks[policy])
               for policy in POLICIES}
    for policy in POLICIES:  # the step-time models start fitted, as a warm replica's are
        costs = probe_costs(engines[policy], TokenSource(tokenizer, seed=args.seed + 2),
                            args.short_tokens, args.long_tokens)
        notes.append(f"{policy}: {costs.line()}")
    step_log = StepLog(args.step_log) if args.step_log else None
    if step_log is not None:
        for policy in POLICIES:
            step_log.attach(policy, engines[policy], clocks[policy])
    print(f"  {notes[-2]}", file=sys.stderr)
    results: dict[str, dict[str, list[CellSummary]]] = {}
    for workload in workloads:
        results[workload] = {policy: [] for policy in POLICIES}
        for rate in rates:
            plan = make_plan(args, workload, rate, tokenizer, sessions)
            started = time.perf_counter()
            if step_log is not None:
                step_log.cell = {"workload": workload, "rate": rate}
            lanes = [Lane(policy, engines[policy], clocks[policy], plan,
                          TokenSource(tokenizer, seed=args.seed + 1), args.drain_timeout_s,
                          args.ttft_p90_ms / 1000.0, args.tpot_p90_ms / 1000.0, step_log)
                     for policy in POLICIES]
            run_lanes(lanes)
            for lane in lanes:
                cell = summarize(lane.records, rate, args.duration_s, args.ttft_p90_ms / 1000.0,
                                 args.tpot_p90_ms / 1000.0)
                results[workload][lane.policy].append(cell)
            print(f"  {workload} {rate:g}/s: goodput " + ", ".join(
                f"{p} {results[workload][p][-1].goodput_per_s:.2f}/s "
                f"({results[workload][p][-1].num_refused} refused)" for p in POLICIES)
                + f" ({time.perf_counter() - started:.0f} s wall)", file=sys.stderr)
    if step_log is not None:
        step_log.close()
    return results


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.engine_bench import load_model
    from engine.engine_args import engine_config_from_args

    if args.threads is None:
        args.threads = 1 if args.clock == "virtual" else 2
    if args.tiny:
        apply_tiny(args)
    rates = [float(r) for r in args.rates.split(",") if r]
    workloads = [w for w in args.workloads.split(",") if w]
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        raise SystemExit(f"unknown workload {unknown[0]!r} (choose from {', '.join(WORKLOADS)})")
    if not rates or any(not r > 0 for r in rates):
        raise SystemExit("--rates: positive requests per second, comma-separated")
    torch.set_num_threads(args.threads)
    config = engine_config_from_args(args)
    if not (config.scheduler.ttft_p90_ms and config.scheduler.tpot_p90_ms):
        raise SystemExit("aigw bench slo needs both targets (--ttft-p90-ms, --tpot-p90-ms)")
    _, tokenizer = load_model(config.model_path)
    sessions = []
    if "agent" in workloads:
        sessions = agent_sessions(tokenizer, num_sessions=args.sessions, num_turns=args.turns,
                                  system_tokens=args.agent_system_tokens,
                                  message_tokens=(20, 60) if args.tiny else (60, 120),
                                  answer_tokens=(2, 4) if args.tiny else (16, 32), seed=args.seed)
    clock = ("virtual clock (a step costs its thread CPU time)" if args.clock == "virtual"
             else "wall clock (HTTP)")
    title = (f"{Path(config.model_path).name}: targets TTFT p90 {args.ttft_p90_ms:g} ms, TPOT p90 "
             f"{args.tpot_p90_ms:g} ms; threads={args.threads}; {args.duration_s:g} s per cell; "
             f"priority fraction {args.priority_fraction:g}; {clock}")
    print(f"slo bench, {title}", file=sys.stderr)
    notes: list[str] = []
    if args.clock == "virtual":
        results = run_virtual(args, workloads, rates, tokenizer, sessions, notes)
    else:
        results = run_wall(args, workloads, rates, tokenizer, sessions)
    text = "\n".join([report(results, args), *notes])
    print(f"\n{title}\n\n{text}")
    results_path = args.results or str(RESULTS_PATHS[args.clock])
    if results_path != "none":
        write_results(Path(results_path), text, title, results, args.clock)
        print(f"wrote {results_path}")
    if args.json:
        import json

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"title": title, "notes": notes,
                                               "results": raw_cells(results)}))
    if args.plot:
        print("wrote "
              f"{plot(results, args.plot, 'aigw bench slo: goodput vs offered rate - ' + title)}")
    return 0
