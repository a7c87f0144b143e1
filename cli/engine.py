"""Engine subcommands of `aigw`: `replica` (serve one engine over HTTP) and `generate` (one prompt)."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that builds an engine (replica, generate, benchmarks)."""
    parser.add_argument("--model", default=None,
                        help="GGUF file or Hugging Face directory (default: bundled SmolLM2-135M-Instruct)")
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
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model's step")
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--decode-weights", choices=["float", "q4"], default="float",
                        help="q4: compute with the GGUF's 4-bit weights and 8-bit activations (native AVX2 "
                             "kernels; ~5x float32 single-stream decode; approximate; CPU only)")
    parser.add_argument("--seed", type=int, default=0)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, not {value}")
    return value


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
            raise ValueError(f"device {device!r}: CUDA is not available to this torch build or machine")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type != "cpu":
        raise ValueError(f"unsupported device {device!r} (cpu, cuda or cuda:N)")


def engine_config_from_args(args: argparse.Namespace, replica_id: str = "replica-0"):  # type: ignore[no-untyped-def]
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.loader import default_model_path

    check_device(args.device)
    return EngineConfig(
        model_path=str(args.model or default_model_path()),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs),
        device=args.device, dtype=args.dtype, num_threads=args.threads, compile=args.compile,
        quantization=args.quantization, decode_weights=args.decode_weights, replica_id=replica_id, max_model_len=args.max_model_len,
        seed=args.seed,
    )


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    replica = subparsers.add_parser("replica", help="serve one engine replica over HTTP (OpenAI API)")
    replica.add_argument("--host", default="127.0.0.1")
    replica.add_argument("--port", type=_port, default=8001)
    replica.add_argument("--replica-id", default=None, help="id in KV events (default: host:port)")
    replica.add_argument("--redis-url", default=None,
                         help="also publish KV events to a Redis stream (default: $AIGW_REDIS_URL)")
    replica.add_argument("--no-auth", action="store_true",
                         help="local development only: serve every route without the gateway's "
                              "credential (else AIGW_REPLICA_SECRET or AIGW_REPLICA_SECRET_FILE "
                              "is required)")
    replica.add_argument("--kv-events-token-ids", action="store_true",
                         help="debugging only: KV events carry each cached block's token ids "
                              "(tenants' prompts) besides its hash")
    add_engine_arguments(replica)
    replica.set_defaults(func=run_replica_command)

    generate = subparsers.add_parser("generate", help="generate from one prompt, streamed to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    add_engine_arguments(generate)
    generate.set_defaults(func=run_generate_command)


def run_replica_command(args: argparse.Namespace) -> int:
    import os

    from engine.async_engine import AsyncEngine
    from engine.engine import LLMEngine
    from engine.server import ReplicaServerSettings, run_replica
    from infra.ports import cannot_listen

    if problem := cannot_listen(args.host, args.port):  # before the model load, not after it
        print(f"aigw: cannot listen on {args.host}:{args.port}: {problem}", file=sys.stderr)
        return 1
    try:
        server_settings = ReplicaServerSettings.from_env()
    except (OSError, ValueError) as exc:  # an unreadable or empty AIGW_REPLICA_SECRET_FILE
        return _usage_error(exc)
    if server_settings.secret is None and not args.no_auth:
        print("aigw: the replica needs the gateway's credential: set AIGW_REPLICA_SECRET or "
              "AIGW_REPLICA_SECRET_FILE (the gateway sends the same), or pass --no-auth "
              "(local development: anyone who can reach the port may use every route)",
              file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if server_settings.secret is None:
        logging.getLogger("aigw.replica").warning(
            "--no-auth: every route (KV events, /kv/reset, generation) is open to any caller")
    replica_id = args.replica_id or f"{args.host}:{args.port}"
    publishers = ()
    redis_url = args.redis_url or os.environ.get("AIGW_REDIS_URL")
    if redis_url:
        from redis.exceptions import RedisClusterException

        from engine.kv_cache.redis_publisher import RedisEventPublisher
        from infra.redis_client import check_redis_url

        try:  # a plain server may come up later (batches are dropped meanwhile); a cluster
            # client must reach a node to be built at all
            publishers = (RedisEventPublisher(check_redis_url(redis_url), replica_id),)
        except (ValueError, RedisClusterException) as exc:
            return _usage_error(exc)
    try:
        engine = LLMEngine.from_config(engine_config_from_args(args, replica_id),
                                       publishers=publishers,
                                       kv_events_token_ids=args.kv_events_token_ids)
    except (FileNotFoundError, ValueError) as exc:  # a bad flag or model path: no traceback
        return _usage_error(exc)
    async_engine = AsyncEngine(engine)
    try:
        run_replica(async_engine, args.host, args.port, server_settings)
    finally:
        async_engine.shutdown()
    return 0


def run_generate_command(args: argparse.Namespace) -> int:
    from contracts.sampling_params import SamplingParams
    from engine.engine import LLMEngine

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        engine = LLMEngine.from_config(engine_config_from_args(args), progress=sys.stderr.isatty())
        tokenizer = engine.tokenizer
        if args.raw:
            prompt = tokenizer.encode(args.prompt, add_special_tokens=True)
        else:
            prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        engine.add_request(uuid.uuid4().hex, prompt, params)
    except (FileNotFoundError, ValueError) as exc:  # a bad flag, model path or prompt length
        return _usage_error(exc)
    while engine.has_unfinished_requests:
        for output in engine.step():
            sys.stdout.write(output.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _usage_error(exc: Exception) -> int:
    """`aigw: <Type>: <message>` on stderr and status 1, as the other subcommands report errors."""
    print(f"aigw: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1
