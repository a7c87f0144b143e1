"""`aigw serve`: the gateway, on configured upstreams or on embedded replicas it starts itself."""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import secrets
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.config_errors import one_line

if TYPE_CHECKING:
    from gateway.fleet.supervisor import ReplicaSupervisor


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("serve", help="run the gateway (OpenAI + Anthropic APIs)")
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default 8000)")
    parser.add_argument("--config", default=None, help="TOML or YAML config (else $AIGW_CONFIG)")
    parser.add_argument("--replicas", type=_positive_int, default=1,
                        help="embedded replicas to start when no models are configured")
    parser.add_argument("--workers", type=_positive_int, default=1,
                        help="gateway processes sharing the port (SO_REUSEPORT)")
    parser.add_argument("--model", default=None, help="model path for the embedded replicas")
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="KV cache bytes per embedded replica")
    parser.add_argument("--kv-host-tier-bytes", type=int, default=None,
                        help="second KV tier bytes per embedded replica (evicted blocks restored "
                             "on a prefix hit; `aigw replica --kv-host-tier-bytes`)")
    parser.add_argument("--embedding-model", default=None,
                        help="embedding model for one more embedded replica (default: the bundled "
                             "all-MiniLM-L6-v2 when installed; `none`: no embedding replica)")
    parser.add_argument("--replica-args", type=_shell_words, default="",
                        help="extra `aigw replica` options for the embedded replicas, one string "
                             "(e.g. \"--decode-weights q4\" for the native 4-bit decode path)")
    parser.add_argument("--no-auth", action="store_true",
                        help="local development only: no API keys, no metering, no /admin API")
    parser.set_defaults(func=run)


def _shell_words(text: str) -> str:
    """`text` unchanged, once it splits as shell words (an unclosed quote is a usage error)."""
    try:
        shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}: {text!r}") from None
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _unusable_directory(path: Any) -> str | None:
    """Why `path` cannot hold the key store and default-key.txt (not creatable, not a directory,
    not writable), or None; it is created here, readable by this user only (it holds the key
    hashes, the pepper, prompts and default-key.txt); an existing one keeps its mode."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    if not os.access(path, os.W_OK | os.X_OK):
        return "not writable"
    return None


def _redis_unreachable(url: str) -> str | None:
    """Why one PING to `url` failed, or None. Checked before any replica loads, so a stopped or
    misnamed Redis is one line at start rather than a traceback from every worker."""
    from redis.exceptions import RedisClusterException, RedisError

    from infra.redis_client import connect_redis_sync

    client = None
    try:  # a cluster client connects (and may fail) as it is built
        client = connect_redis_sync(url, socket_connect_timeout=5.0, socket_timeout=5.0)
        client.ping()
    except (RedisError, RedisClusterException) as exc:
        return str(exc) or type(exc).__name__
    finally:
        if client is not None:
            client.close()
    return None


def attach_replica_args(argv: list[str]) -> list[str]:
    """`--replica-args "--no-prefix-caching"` -> `--replica-args=--no-prefix-caching`.

    argparse takes a lone value that starts with `-` for an option of its own ("expected one
    argument"); the flag always takes exactly the next word, so glue it on before parsing."""
    argv = list(argv)
    if not argv or argv[0] != "serve":
        return argv
    for i, arg in enumerate(argv[:-1]):
        if arg == "--replica-args":
            argv[i:i + 2] = [f"--replica-args={argv[i + 1]}"]
            break
    return argv


def run(args: argparse.Namespace) -> int:
    import yaml

    from auth.settings import AuthSettings
    from cli.engine import engine_missing
    from gateway.backends import get_backend_class
    from gateway.fleet import embedded
    from gateway.settings import load_settings
    from infra import ports
    from infra.telemetry.settings import TelemetrySettings

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    if args.no_auth:
        overrides["auth_enabled"] = False
    try:
        settings = load_settings(args.config, **overrides)
        for model in settings.models:  # a misspelt backend fails here, not in every worker
            get_backend_class(model.backend)
        AuthSettings.from_env()  # AIGW_JWT_* and the telemetry variables: likewise
        TelemetrySettings.from_env()
        configured_secret = settings.read_replica_secret()  # an unreadable or empty file: here
    except (OSError, ValueError, TypeError, ImportError, yaml.YAMLError) as exc:
        # unreadable, unparsable or invalid
        print(f"aigw: invalid configuration: {one_line(exc)}", file=sys.stderr)
        return 1
    if settings.auth_enabled and (problem := _unusable_directory(settings.data_dir)):
        print(f"aigw: cannot use data_dir {str(settings.data_dir)!r}: {problem}", file=sys.stderr)
        return 1
    if problem := ports.cannot_listen(settings.host, settings.port):
        print(f"aigw: cannot listen on {settings.host}:{settings.port}: {problem}", file=sys.stderr)
        return 1
    if settings.redis_url and (problem := _redis_unreachable(settings.redis_url)):
        print(f"aigw: cannot reach Redis at redis_url: {problem}", file=sys.stderr)
        return 1
    configured = embedded.embedded_model(settings.models)  # served by embedded replicas, if any
    if (not settings.models or configured) and (problem := engine_missing()):  # they need it
        print(f"{problem} (or configure [[models]] upstreams)", file=sys.stderr)
        return 1
    replicas: list[embedded.ReplicaProcess] = []
    # until the gateway installs its own handlers: a SIGTERM while replicas load still stops
    # them (they have sessions of their own; the default action would leave them running)
    previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        if not settings.models or configured:
            # the credential the embedded replicas require: the configured one, else a new one
            secret = configured_secret or secrets.token_urlsafe(32)
            # the configured model's targets and shares (ModelSettings.replica_args), then
            # --replica-args (whose later flags win)
            replica_args = [*(configured.replica_args() if configured else []),
                            *shlex.split(args.replica_args)]
            replicas = embedded.start_replicas(args.replicas, args.model, args.kv_cache_memory,
                                               extra_args=replica_args,
                                               secret=secret,
                                               host_tier_bytes=args.kv_host_tier_bytes,
                                               embedding_model_path=_embedding_model(args))
            try:
                embedded.wait_healthy(replicas)
            # a replica exited (its error is above) or hung
            except (RuntimeError, TimeoutError) as exc:
                print(f"aigw: {exc}", file=sys.stderr)
                return 1
            served = embedded.models_for(replicas, secret)
            settings = settings.model_copy(update={
                "models": embedded.fill_embedded(settings.models, served) if configured else served,
                "replica_secret": secret, "replica_secret_file": None})
        signal.signal(signal.SIGTERM, previous_sigterm)
        with _supervised(replicas):  # stopped before the replicas are
            return _serve_workers(settings.model_dump(mode="json"), args.workers)
    finally:
        embedded.stop_replicas(replicas)


def _embedding_model(args: argparse.Namespace) -> str | None:
    """The embedded embedding replica's model: `--embedding-model` (`none`: no such replica),
    else the bundled all-MiniLM-L6-v2 if its package is installed, else none."""
    if args.embedding_model is not None:
        return None if args.embedding_model == "none" else str(args.embedding_model)
    from contracts.default_model import default_embedding_model_path

    try:
        return str(default_embedding_model_path())
    except FileNotFoundError:
        return None


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _supervised(replicas: list[Any]) -> Iterator[ReplicaSupervisor | None]:
    """Restart any embedded replica that dies while the gateway serves
    (gateway/fleet/supervisor.py); its restart counts reach the workers' /metrics through a file
    named in their environment."""
    from gateway.fleet.supervisor import RESTARTS_FILE_ENV, ReplicaSupervisor, SupervisorSettings

    if not replicas:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="aigw-supervisor-") as directory:
        restarts_file = Path(directory) / "restarts.json"
        supervisor = ReplicaSupervisor(replicas, SupervisorSettings(), restarts_file)
        os.environ[RESTARTS_FILE_ENV] = str(restarts_file)
        supervisor.start()
        try:
            yield supervisor
        finally:
            supervisor.stop()
            del os.environ[RESTARTS_FILE_ENV]


def _serve_workers(settings_data: dict[str, Any], num_workers: int) -> int:
    """Serve until a signal; the exit status: 1 when a worker failed (its error is above), else
    0."""
    from gateway.web.server import run_worker

    if num_workers == 1:
        run_worker(settings_data, reuse_port=False)
        return 0
    with _shared_metrics_dir():
        return _run_workers(settings_data, num_workers)


@contextlib.contextmanager
def _shared_metrics_dir() -> Iterator[None]:
    """PROMETHEUS_MULTIPROC_DIR for the workers (a fresh directory, removed after them), so that
    /metrics sums every worker's numbers (gateway/telemetry/metrics.py); one set by the operator
    is used as it is (prometheus_client's rule: empty it between runs)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="aigw-metrics-") as directory:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
        try:
            yield
        finally:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]


def _run_workers(settings_data: dict[str, Any], num_workers: int) -> int:
    from gateway.web.server import run_worker

    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=run_worker, args=(settings_data, True), daemon=False)
               for _ in range(num_workers)]
    for worker in workers:
        worker.start()

    def forward(signum: int, _frame: object) -> None:
        for worker in workers:
            if worker.pid is not None and worker.is_alive():
                worker.terminate()  # SIGTERM: each worker drains

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for worker in workers:
            worker.join()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    # a worker that ended on the SIGTERM/SIGINT forwarded to it (before its own handlers were
    # installed) stopped as asked; any other signal or a non-zero status is a failure
    stopped_as_asked = (0, -signal.SIGTERM, -signal.SIGINT)
    return 1 if any(worker.exitcode not in stopped_as_asked for worker in workers) else 0
