"""The engine's options on a command line, and the EngineConfig they make: shared by `aigw
replica`, `aigw generate` (cli/engine.py) and the benchmarks (bench/). Torch is imported only to
check the device, when a config is made.

    add_engine_arguments(parser)
    config = engine_config_from_args(args, replica_id)    # ValueError: a device this machine lacks
"""

from __future__ import annotations

import argparse


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that builds an engine (replica, generate, benchmarks)."""
    parser.add_argument("--model", default=None,
                        help="GGUF file or Hugging Face directory (default: bundled "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30,
                        help="KV cache budget in bytes (default 1 GiB)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--kv-retention-max-s", type=float, default=3600.0,
                        help="longest KV retention a request may ask for, in seconds (longer is "
                             "clamped)")
    parser.add_argument("--kv-retention-share-per-project", type=float, default=0.25,
                        help="fraction of the KV pool one project's retained prefixes may hold")
    parser.add_argument("--kv-retention-share-total", type=float, default=0.5,
                        help="fraction of the KV pool all retained prefixes together may hold")
    parser.add_argument("--kv-host-tier-bytes", type=int, default=0,
                        help="second KV tier in bytes: blocks evicted from the KV cache wait there "
                             "and are restored on a prefix hit instead of recomputed (CUDA: pinned "
                             "host memory; CPU: a mapped file; default 0: none)")
    parser.add_argument("--kv-host-tier-dir", default=None,
                        help="CPU: the directory of the host tier's file (default: the temporary "
                             "directory; put it on a disk, not a tmpfs, to hold more than memory)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: all cores)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model's step")
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--decode-weights", choices=["float", "q4"], default=None,
                        help="q4: compute with the GGUF's 4-bit weights and 8-bit activations "
                             "(native kernels; ~5x float32 single-stream decode; approximate; CPU "
                             "only). float: float32 weights. Default: q4 on the CPU in float32 (a "
                             "checkpoint without Q4 blocks then runs in float32), float elsewhere")
    parser.add_argument("--quantize-at-load", choices=["q8_0", "q4_1"], default="q8_0",
                        help="the q4 mode: the block format of weights the checkpoint holds in no "
                             "native block type (safetensors, k-quants, MoE experts). q8_0: "
                             "near-lossless; q4_1: ~2x the prefill of q8_0 and faster decode, ~10x "
                             "its weight error")
    parser.add_argument("--exact", action="store_true",
                        help="compute in float32 (greedy output equal to transformers'): "
                             "--decode-weights float")
    parser.add_argument("--seed", type=int, default=0)
    add_slo_arguments(parser)


def add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    """Latency targets, the scheduler policy and reserved shares (engine/slo.py)."""
    parser.add_argument("--ttft-p90-ms", type=float, default=None,
                        help="target p90 time to first token in ms: a request whose predicted "
                             "queueing would break its class's target is refused at once (429, "
                             "Retry-After); flex is held to 4x it (default: no target, no "
                             "refusals)")
    parser.add_argument("--tpot-p90-ms", type=float, default=None,
                        help="target p90 time per output token in ms: under --scheduler-policy slo "
                             "each step's prefill chunk and running batch are sized to keep it")
    parser.add_argument("--scheduler-policy", choices=["fixed", "slo"], default=None,
                        help="slo: step budgets from measured step times and the TPOT target; "
                             "fixed: --max-num-batched-tokens every step (default: slo when a "
                             "target is set)")
    parser.add_argument("--reserved-share", action="append", default=[], metavar="PROJECT=FRACTION",
                        help="a project's provisioned share of each step's token budget and of the "
                             "KV blocks, which other projects cannot take while it has work "
                             "(repeatable)")
    parser.add_argument("--flex-max-wait-ms", type=float, default=None,
                        help="a flex request waiting longer than this is scheduled as default "
                             "(default: 2x flex's TTFT bound, i.e. 8x --ttft-p90-ms, or 60000 "
                             "without a target; inf: never)")


def slo_scheduler_fields(args: argparse.Namespace) -> dict[str, object]:
    """SchedulerConfig's latency-target fields from the flags (ValueError: a malformed share)."""
    targets = {"ttft_p90_ms": args.ttft_p90_ms or None, "tpot_p90_ms": args.tpot_p90_ms or None}
    policy = args.scheduler_policy or ("slo" if any(targets.values()) else "fixed")
    shares = []
    for item in args.reserved_share:
        project, sep, fraction = item.rpartition("=")
        try:
            shares.append((project, float(fraction)))
        except ValueError:
            sep = ""
        if not sep or not project:
            raise ValueError(f"--reserved-share {item!r}: expected PROJECT=FRACTION, e.g. "
                             "acme=0.25")
    return {**targets, "policy": policy, "reserved_shares": tuple(shares),
            "flex_max_wait_ms": args.flex_max_wait_ms}


def add_tensor_parallel_argument(parser: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size, for the commands that build their engine with LLMEngine.from_config
    (replica, generate, bench engine); engine_config_from_args reads it when present."""
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model across N processes: one per CUDA device "
                             "(cuda:0..N-1), or on the CPU each with 1/N of the cores (gloo); the "
                             "KV budget is the replica's (default 1)")


def check_device(device: str) -> None:
    """A ValueError, not torch's RuntimeError or AssertionError deep in loading, for a device
    string torch cannot parse or one this build or machine does not have."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r} (cpu, cuda or cuda:N)") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available to this torch build or "
                             "machine")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type != "cpu":
        raise ValueError(f"unsupported device {device!r} (cpu, cuda or cuda:N)")


def resolve_decode_weights(args: argparse.Namespace) -> str:
    """The decode-weights mode the flags ask for: --exact is float; no flag is q4 on the CPU in
    float32 without --quantization / --compile (the fast path), float elsewhere."""
    if args.exact:
        if args.decode_weights == "q4":
            raise ValueError("--exact computes in float32: it contradicts --decode-weights q4")
        return "float"
    if args.decode_weights is not None:
        return str(args.decode_weights)
    on_cpu = str(args.device).startswith("cpu")
    plain = args.dtype in (None, "float32") and args.quantization is None and not args.compile
    return "q4" if on_cpu and plain else "float"


def engine_config_from_args(args: argparse.Namespace, replica_id: str = "replica-0"):  # type: ignore[no-untyped-def]
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.loader import default_model_path

    check_device(args.device)
    if str(args.device).startswith("cpu"):
        from engine.kernels.cpu import isa

        isa.selection()  # a bad AIGW_CPU_ISA is refused here, before the model loads
    return EngineConfig(
        model_path=str(args.model or default_model_path()),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory,
                          enable_prefix_caching=not args.no_prefix_caching,
                          max_retention_s=args.kv_retention_max_s,
                          retention_share_per_project=args.kv_retention_share_per_project,
                          retention_share_total=args.kv_retention_share_total,
                          host_tier_bytes=args.kv_host_tier_bytes,
                          host_tier_dir=args.kv_host_tier_dir),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, **slo_scheduler_fields(args)),
        device=args.device, dtype=args.dtype, num_threads=args.threads, compile=args.compile,
        quantization=args.quantization, decode_weights=resolve_decode_weights(args),
        quantize_at_load=getattr(args, "quantize_at_load", "q8_0"), replica_id=replica_id,
        max_model_len=args.max_model_len,
        seed=args.seed, tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
    )
