"""Engine subcommands of `aigw`: `replica` (serve one engine over HTTP) and `generate` (one
prompt)."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

from engine.engine_args import (
    add_engine_arguments,
    add_tensor_parallel_argument,
    engine_config_from_args,
)

ENGINE_MISSING = ("aigw: this command runs the inference engine, which is not installed (no "
                  "torch): pip install 'aigw[engine]'")


def engine_missing() -> str | None:
    """`ENGINE_MISSING` when torch cannot be imported here (a gateway-only `pip install aigw`), else
    None: the one line a command that needs the engine prints, before it imports any of it."""
    import importlib.util

    return ENGINE_MISSING if importlib.util.find_spec("torch") is None else None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, not {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    replica = subparsers.add_parser("replica",
                                    help="serve one engine replica over HTTP (OpenAI API)")
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
    add_tensor_parallel_argument(replica)
    replica.set_defaults(func=run_replica_command)

    generate = subparsers.add_parser("generate",
                                     help="generate from one prompt, streamed to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    add_engine_arguments(generate)
    add_tensor_parallel_argument(generate)
    generate.set_defaults(func=run_generate_command)


def run_replica_command(args: argparse.Namespace) -> int:
    import os

    if problem := engine_missing():
        print(problem, file=sys.stderr)
        return 1
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
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if server_settings.secret is None:
        logging.getLogger("aigw.replica").warning(
            "--no-auth: every route (KV events, /kv/reset, generation) is open to any caller")
    replica_id = args.replica_id or f"{args.host}:{args.port}"
    if args.model is not None:
        from engine.loader.hf_bert import is_encoder_checkpoint

        if is_encoder_checkpoint(args.model):  # an embedding model: its own serving path
            return _run_embedding_replica(args, replica_id, server_settings)
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
    watch = getattr(engine.runner, "watch", None)
    if watch is not None:  # a lost tensor-parallel rank takes the replica down: drain, exit 1
        import signal
        import threading

        watch(lambda exc: threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start())
    try:
        run_replica(async_engine, args.host, args.port, server_settings)
    finally:
        async_engine.shutdown()
    return 1 if getattr(engine.runner, "failure", None) is not None else 0


def _run_embedding_replica(args: argparse.Namespace, replica_id: str, server_settings: object
                           ) -> int:
    """`aigw replica --model <encoder>`: serve POST /v1/embeddings (engine/server/embeddings.py);
    of the engine options only --device, --dtype and --threads apply."""
    import torch

    from engine.embedding.embedder import Embedder
    from engine.engine_args import check_device
    from engine.server.embeddings import run_embedding_replica

    try:
        check_device(args.device)
        if args.threads:
            torch.set_num_threads(args.threads)
        embedder = Embedder.load(args.model, device=args.device,
                                 dtype=getattr(torch, args.dtype or "float32"),
                                 replica_id=replica_id)
    except (FileNotFoundError, ValueError) as exc:
        return _usage_error(exc)
    logging.getLogger("aigw.replica").info("replica %s embedding with %s (%d dimensions)",
                                           replica_id, embedder.model_id,
                                           embedder.config.dimensions)
    try:
        run_embedding_replica(embedder, args.host, args.port, server_settings)  # type: ignore[arg-type]
    finally:
        embedder.shutdown()
    return 0


def run_generate_command(args: argparse.Namespace) -> int:
    if problem := engine_missing():
        print(problem, file=sys.stderr)
        return 1
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
    try:
        while engine.has_unfinished_requests:
            for output in engine.step():
                sys.stdout.write(output.text)
                sys.stdout.flush()
    finally:
        close = getattr(engine.runner, "close", None)  # tensor parallel: stop the workers
        if close is not None:
            close()
    sys.stdout.write("\n")
    return 0


def _usage_error(exc: Exception) -> int:
    """`aigw: <Type>: <message>` on stderr and status 1, as the other subcommands report errors."""
    print(f"aigw: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1
