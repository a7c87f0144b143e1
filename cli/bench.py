"""`aigw bench <name>`: each benchmark is a module `bench/<name>_bench.py` exposing
`add_arguments(parser)` and `run(args) -> int`. Benchmarks print their figures beside a baseline
measured in the same run, and write a PNG when given `--plot PATH`.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

BENCHMARKS = {  # name -> (module, what `aigw bench --help` says it measures)
    "engine": ("bench.engine_bench", "prefill, decode and concurrency vs transformers"),
    "agent": ("bench.agent_bench", "prompt caching on agent-loop and shared-prefix workloads"),
    "gateway": ("bench.gateway_bench", "gateway overhead vs a bare proxy and LiteLLM"),
    "routing": ("bench.routing_bench", "routing policies, simulated and on real replicas"),
    "soak": ("bench.soak_bench", "many mixed requests: RSS flat, no KV leak, ledger exact"),
    "kv-tier": ("bench.kv_tier_bench", "TTFT of an evicted prefix: second KV tier vs recompute"),
    "embed": ("bench.embed_bench", "embedding texts/s vs transformers + pooling"),
    "batch": ("bench.batch_bench", "Batch API lines in prefix order vs file order"),
    "slo": ("bench.slo_bench", "goodput under TTFT/TPOT targets: slo vs fixed scheduler"),
    "calls": ("bench.calls_bench", "Python calls per request: gateway vs a baseline, replica"),
}


def register(subparsers: argparse._SubParsersAction,  # type: ignore[type-arg]
             argv: Sequence[str] | None = None) -> None:
    """Add `aigw bench <name>` for every benchmark. With `argv` (the command line to be parsed),
    only the benchmark it names is imported (a benchmark module imports the engine, the gateway,
    aiohttp...: seconds); the others get a parser with their help line alone, which is all
    `aigw --help`, `aigw bench --help` or `aigw keys ...` show. Without it, every benchmark's
    flags are there (the docs' check of docs/reference/cli.md reads them)."""
    bench = subparsers.add_parser("bench", help="run a benchmark (not a test)")
    names = bench.add_subparsers(dest="benchmark", required=True)
    for name, (module_name, what) in BENCHMARKS.items():
        parser = names.add_parser(name, help=what, description=f"aigw bench {name}: {what}")
        if argv is not None and list(argv[:2]) != ["bench", name]:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            parser.set_defaults(func=lambda _args, n=name: print(f"benchmark {n!r} is not "
                                                                 "built") or 2)
            continue
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)
