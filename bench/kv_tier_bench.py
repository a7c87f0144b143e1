"""`aigw bench kv-tier`: what the second KV tier saves, beside a recompute, in one run.

Figures, on the same weights (two engines over one checkpoint, a KV pool of `--pool-tokens`):
  - TTFT of a prompt whose `--prefix-tokens` prefix was evicted from the pool (by fillers that cycle
    the whole pool) with the host tier (`--kv-host-tier-bytes`: the prefix comes back from the tier)
    and without it (recomputed), and, as the floor, of the same prefix still in the pool; median of
    `--rounds`, each round a fresh prefix, the two engines alternating which goes first;
  - which tier (CPU): the real KV's lossless compression ratio and GB/s in and out for the codecs
    this Python has (zlib always; lz4, zstandard when installed; each raw and after a byte-plane
    split), the mapped-file tier's GB/s in and out (HostTierStorage copies), and the recompute
    cost of one block (prefill time / blocks).
The tier is the engine's own (engine/kv_cache/host_tier.py), driven through LLMEngine.step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import zlib
from collections.abc import Callable
from typing import Any

from bench.engine_bench import load_model
from bench.plotting import BarPanel, fmt, format_table, median, write_bar_chart
from bench.workloads import TokenSource


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.engine_args import add_engine_arguments

    add_engine_arguments(parser)
    parser.set_defaults(threads=1, kv_host_tier_bytes=256 << 20)
    parser.add_argument("--prefix-tokens", type=int, default=1024,
                        help="the evicted prefix's length")
    parser.add_argument("--suffix-tokens", type=int, default=32, help="new tokens after the prefix")
    parser.add_argument("--pool-tokens", type=int, default=1536,
                        help="the KV pool's size in tokens (replaces --kv-cache-memory)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-codecs", action="store_true", help="skip the which-tier measurements")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke-test sizes (seconds); the figures mean nothing")
    parser.add_argument("--plot", default=None, help="write a PNG here")
    parser.add_argument("--json", default=None, help="write the figures as JSON here")


def run(args: argparse.Namespace) -> int:
    if args.tiny:
        args.prefix_tokens, args.suffix_tokens, args.pool_tokens, args.rounds = 64, 8, 128, 1
    if args.prefix_tokens + args.suffix_tokens + 1 > args.pool_tokens:
        raise SystemExit("--pool-tokens must hold the prefix, the suffix and a token")
    tier, recompute = build_engine(args, args.kv_host_tier_bytes), build_engine(args, 0)
    source = TokenSource(tier.tokenizer, seed=args.seed)
    ttft: dict[str, list[float]] = {"pool hit": [], "host tier": [], "recompute": []}
    cached: dict[str, list[int]] = {name: [] for name in ttft}
    for round_index in range(args.rounds):
        prefix = source.take(args.prefix_tokens)
        order = [(tier, "host tier"), (recompute, "recompute")]
        for engine, name in order if round_index % 2 == 0 else order[::-1]:
            t, n = evicted_prefix_ttft(engine, prefix, source, args)
            ttft[name].append(t)
            cached[name].append(n)
            if engine is tier:
                # still in the pool
                t, n = first_token(engine, prefix + source.take(args.suffix_tokens))
                ttft["pool hit"].append(t)
                cached["pool hit"].append(n)
    stats = tier.stats()
    results: dict[str, Any] = {"ttft_ms": {k: median(v) * 1000 for k, v in ttft.items()},
                               "cached_tokens": {k: median(v) for k, v in cached.items()},
                               "host_tier_hit_tokens_total": stats.num_host_tier_hit_tokens,
                               "host_tier_bytes": stats.num_host_tier_bytes,
                               "host_tier_budget_bytes": stats.host_tier_budget_bytes}
    rows = [[name, fmt(results["ttft_ms"][name]), fmt(results["cached_tokens"][name], 0),
             fmt(results["ttft_ms"]["recompute"] / results["ttft_ms"][name], 2)] for name in ttft]
    print(f"TTFT of a {args.prefix_tokens}+{args.suffix_tokens}-token prompt, median of "
          f"{args.rounds} (pool {args.pool_tokens} tokens, {args.threads} thread(s); a shared, "
          "noisy machine):")
    print(format_table(["prefix was", "TTFT ms", "cached tokens", "recompute / this"], rows))
    if not args.no_codecs:
        results["which_tier"] = which_tier(tier, source, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"func": None}, "results": results}, f, indent=2,
                      default=str)
    if args.plot:
        panels = [BarPanel("TTFT, prefix evicted from the pool", "ms", list(ttft),
                           {"TTFT": [results["ttft_ms"][k] for k in ttft]})]
        if "which_tier" in results:
            codecs = results["which_tier"]["codecs"]
            panels.append(BarPanel("lossless codecs on real KV", "ratio", list(codecs),
                                   {"ratio": [c["ratio"] for c in codecs.values()]},
                                   (1.0, "no gain")))
        print(f"wrote {write_bar_chart(args.plot, 'aigw bench kv-tier', panels, columns=2)}")
    return 0


def build_engine(args: argparse.Namespace, host_tier_bytes: int) -> Any:
    from engine.engine import LLMEngine
    from engine.engine_args import engine_config_from_args
    from engine.kv_cache.layout import KVCacheLayout, kv_bytes_per_token
    from engine.model_runner import ModelRunner

    config = engine_config_from_args(args)
    checkpoint, tokenizer = load_model(config.model_path)
    layout = KVCacheLayout.for_model(checkpoint.config, checkpoint.config.max_position_embeddings)
    element = 2 if config.decode_weights == "q4" else 4  # the KV dtype: float16 on the q4 path
    per_block = (layout.num_tensor_slots * config.cache.block_size
                 * kv_bytes_per_token(checkpoint.config, element))
    num_blocks = -(-args.pool_tokens // config.cache.block_size)
    cache = dataclasses.replace(config.cache, kv_cache_memory_bytes=num_blocks * per_block,
                                host_tier_bytes=host_tier_bytes)
    config = dataclasses.replace(config, cache=cache)
    runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))
    runner.warmup()
    return LLMEngine(config, checkpoint.config, runner, tokenizer)


def first_token(engine: Any, prompt: list[int], max_tokens: int = 1) -> tuple[float, int]:
    """(seconds from add to the first token, cached prompt tokens); runs the request to the end."""
    from contracts.sampling_params import SamplingParams

    request_id = f"r{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                          ignore_eos=True))
    first: float | None = None
    num_cached = 0
    while engine.has_unfinished_requests:
        for output in engine.step():
            if output.request_id == request_id and first is None:
                first, num_cached = time.perf_counter() - start, output.num_cached_tokens
    assert first is not None
    return first, num_cached


def evicted_prefix_ttft(engine: Any, prefix: list[int], source: TokenSource,
                        args: argparse.Namespace) -> tuple[float, int]:
    """Warm `prefix`, cycle the pool with fillers, then time the prefix with a new suffix."""
    first_token(engine, prefix + source.take(args.suffix_tokens))
    filler_tokens = min(512, args.pool_tokens // 2)
    for _ in range(args.pool_tokens // filler_tokens + 1):
        first_token(engine, source.take(filler_tokens))
    from contracts.block_hash import hash_blocks

    hashes = hash_blocks(prefix, engine.block_size, engine.model_config.model_id)
    if any(engine.kv_cache.pool.get_cached_block(h) is not None for h in hashes):
        raise RuntimeError("the fillers did not evict the prefix from the pool")
    return first_token(engine, prefix + source.take(args.suffix_tokens))


# ---- which tier ----------------------------------------------------------------------------------
def which_tier(engine: Any, source: TokenSource, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine.kv_cache.host_storage import HostTierStorage
    from engine.kv_cache.host_tier import KVTransfers

    num_tokens = min(args.pool_tokens - 1, 1024)
    engine.reset_prefix_cache()
    start = time.perf_counter()
    first_token(engine, source.take(num_tokens))
    recompute_s = (time.perf_counter() - start) / (num_tokens // engine.block_size)
    block_ids = [b.block_id for b in engine.kv_cache.pool.blocks if b.block_hash is not None]
    storage = engine.host_storage
    tensors = storage.kv_tensors
    blocks = [torch.stack([t[i] for t in tensors]).contiguous() for i in block_ids]
    raw = [b.view(-1).view(torch.uint8).numpy().tobytes() for b in blocks]
    element_size = blocks[0].element_size()
    total = sum(len(r) for r in raw)
    codecs: dict[str, dict[str, float]] = {}
    for name, (compress, decompress) in _codecs(element_size).items():
        t0 = time.perf_counter()
        packed = [compress(r) for r in raw]
        t1 = time.perf_counter()
        back = [decompress(p) for p in packed]
        t2 = time.perf_counter()
        assert back == raw, f"{name} is not lossless"
        codecs[name] = {"ratio": total / sum(len(p) for p in packed),
                        "in_gb_s": total / (t1 - t0) / 1e9, "out_gb_s": total / (t2 - t1) / 1e9}
    mapped = HostTierStorage(tensors, len(block_ids))
    slots = tuple(range(len(block_ids)))
    t0 = time.perf_counter()
    mapped.apply(KVTransfers(tuple(block_ids), slots))
    t1 = time.perf_counter()
    mapped.apply(KVTransfers((), (), slots, tuple(block_ids)))
    t2 = time.perf_counter()
    result = {"bytes_per_block": len(raw[0]), "num_blocks": len(raw),
              "recompute_ms_per_block": recompute_s * 1000, "codecs": codecs,
              "mapped_file": {"in_gb_s": total / (t1 - t0) / 1e9,
                              "out_gb_s": total / (t2 - t1) / 1e9,
                              "restore_ms_per_block": (t2 - t1) / len(raw) * 1000}}
    rows = [[name, fmt(c["ratio"], 3), fmt(c["in_gb_s"], 2), fmt(c["out_gb_s"], 2),
             fmt(len(raw[0]) / c["out_gb_s"] / 1e6, 3)] for name, c in codecs.items()]
    m = result["mapped_file"]
    rows.append(["mapped file (chosen)", "1 (no codec)", fmt(m["in_gb_s"], 2),
                 fmt(m["out_gb_s"], 2), fmt(m["restore_ms_per_block"], 3)])
    print(f"\nWhich tier: {len(raw)} blocks of real KV, {len(raw[0]):,} bytes each; recomputing "
          "one "
          f"costs {recompute_s * 1000:.1f} ms here")
    print(format_table(["tier / codec", "ratio", "in GB/s", "out GB/s", "restore ms/block"], rows))
    return result


def _codecs(element_size: int) -> dict[str,
                                       tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]]:
    import numpy as np

    def planes(data: bytes) -> bytes:  # byte k of every element together: exponents compress
        return np.frombuffer(data, dtype=np.uint8).reshape(-1, element_size).T.tobytes()

    def unplanes(data: bytes) -> bytes:
        return np.frombuffer(data, dtype=np.uint8).reshape(element_size, -1).T.tobytes()

    codecs: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {
        "zlib 1": (lambda b: zlib.compress(b, 1), zlib.decompress)}
    try:
        import lz4.block

        codecs["lz4"] = (lz4.block.compress, lz4.block.decompress)
    except ImportError:
        pass
    try:
        import zstandard

        zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
        codecs["zstd 1"] = (zc.compress, zd.decompress)
    except ImportError:
        pass
    for name, (c, d) in list(codecs.items()):
        codecs[f"planes + {name}"] = ((lambda b, c=c: c(planes(b))),
                                      (lambda b, d=d: unplanes(d(b))))
    return codecs
