"""Rank 0 of a tensor-parallel replica: starts and supervises the workers, and runs each step on
every rank at once.

    runner = TensorParallelRunner(config)   # ModelRunner's interface to LLMEngine
    runner.execute(batch)                   # broadcast the batch (once a step), run rank 0's shard
    runner.watch(callback)                  # called once with RankFailedError when a rank is lost
    runner.close()                          # stop the workers (they exit), or kill what is left

Rank 0 is the replica's own process: it runs the scheduler, the one KV block table and prefix
cache, the KV events and the HTTP server; the workers hold only their shards of the weights and of
every KV block, and follow rank 0's batches. Start-up: a loopback TCP store, N - 1 worker
processes (`python -m engine.parallel.worker`), the process group once every worker has joined,
each rank's load, then one gathered status (the first failure becomes one line,
TensorParallelStartError), then a warm-up step in lockstep. A worker that exits later (crash, kill,
out of memory) fails the replica as a whole: the watchers are told, the other workers are killed,
and every step from then on raises RankFailedError.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from engine.batch import ScheduledBatch
from engine.config import EngineConfig
from engine.model_runner import StepLogits
from engine.parallel.group import TPGroup, join_group, master_store
from engine.parallel.rank import build_rank_runner, step_kind
from engine.parallel.worker import WorkerSpec, startup_error

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # rendezvous and load, per rank
COLLECTIVE_TIMEOUT_S = 300.0  # a collective waiting this long on a silent rank fails the replica


class TensorParallelStartError(ValueError):
    """A rank could not start (one line: which rank, why). A ValueError: the CLI prints it as one
    line."""


class RankFailedError(RuntimeError):
    """A rank of a running replica is gone; the replica is down."""


class TensorParallelRunner:
    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self._failure: RankFailedError | None = None
        self._watchers: list[Callable[[RankFailedError], None]] = []
        self._closing = False
        self._lock = threading.Lock()  # one collective sequence at a time (steps, close)
        self.num_steps = 0
        if config.device.startswith("cuda"):
            if torch.cuda.device_count() < self.world_size:
                raise TensorParallelStartError(
                    f"tensor_parallel_size {self.world_size} needs as many CUDA devices, this "
                    "machine "
                    f"has {torch.cuda.device_count()}")
        store = master_store(self.world_size, START_TIMEOUT_S)
        self._workers = [self._start_worker(rank, store.port) for rank in range(1, self.world_size)]
        atexit.register(self._kill_workers)
        try:
            self._wait_joined(store)
            device_type = "cuda" if config.device.startswith("cuda") else "cpu"
            self.group: TPGroup = join_group(store, 0, self.world_size, device_type,
                                             COLLECTIVE_TIMEOUT_S)
            self.runner, self.full_model_config = self._load(progress)
            self.runner.warmup()
        except BaseException:
            self._kill_workers()
            raise
        for rank, proc in enumerate(self._workers, start=1):
            threading.Thread(target=self._supervise, args=(rank, proc), name=f"tp-rank-{rank}",
                             daemon=True).start()

    # ---- start-up --------------------------------------------------------------------------------
    def _start_worker(self, rank: int, port: int) -> subprocess.Popen[bytes]:
        root = str(Path(__file__).resolve().parents[2])  # the directory holding engine/
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.Popen([sys.executable, "-m", "engine.parallel.worker"],
                                stdin=subprocess.PIPE, env=env)
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps(WorkerSpec(self.config, rank, self.world_size, port,
                                                 COLLECTIVE_TIMEOUT_S)))
        proc.stdin.close()
        return proc

    def _wait_joined(self, store: dist.TCPStore) -> None:
        keys = [f"joined/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not store.check(keys):
            for rank, proc in enumerate(self._workers, start=1):
                if proc.poll() is not None:
                    raise TensorParallelStartError(
                        f"tensor-parallel rank {rank} exited with code {proc.returncode} before "
                        "joining the replica")
            if time.monotonic() > deadline:
                raise TensorParallelStartError("tensor-parallel ranks did not join in "
                                               f"{START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _load(self, progress: bool) -> tuple:  # type: ignore[type-arg]
        status: str | None = None
        built = None
        try:
            built = build_rank_runner(self.config, self.group, progress)
        except Exception as exc:  # noqa: BLE001 - every rank's status is gathered first
            status = startup_error(exc)
        try:
            statuses = self.group.all_gather_object((status,
                                                     step_kind(built[0]) if built else None))
        except RuntimeError as exc:
            raise TensorParallelStartError(self._lost_rank_message(exc)) from None
        for rank, (line, _) in enumerate(statuses):
            if line:
                raise TensorParallelStartError(f"tensor-parallel rank {rank} failed to start: "
                                               f"{line}")
        kinds = [kind for _, kind in statuses]
        if len(set(kinds)) > 1:  # their collectives or block ids would not line up
            raise TensorParallelStartError("tensor-parallel ranks would run different "
                                           "steps: " + "; ".join(
                f"rank {rank}: {kind}" for rank, kind in enumerate(kinds)))
        assert built is not None
        return built

    # ---- ModelRunner's interface -----------------------------------------------------------------
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        with self._lock:
            if self._failure is not None:
                raise self._failure
            try:
                self.group.broadcast_object(batch)
                logits = self.runner.execute(batch)
            except RuntimeError as exc:  # gloo / NCCL: a peer closed the connection or timed out
                failure = RankFailedError(self._lost_rank_message(exc))
                self._fail(failure)
                raise failure from None
            self.num_steps += 1
            if not logits.request_ids and not logits.prompt_logits:  # (rank 0's local vocab width)
                return StepLogits([], torch.empty(0, self.full_model_config.vocab_size))
            return logits

    def warmup(self) -> float:
        return 0.0  # every rank warmed up in lockstep at start-up

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def compute_info(self) -> dict[str, object]:
        """Rank 0's (every rank runs the same step, checked at start), with the world size: the
        replica's /v1/models metadata and aigw_replica_decode_weights."""
        return {**self.runner.compute_info, "tensor_parallel_size": self.world_size}

    @property
    def kv_layout(self):  # type: ignore[no-untyped-def]
        return self.runner.kv_layout

    @property
    def kv_caches(self):  # type: ignore[no-untyped-def]
        return self.runner.kv_caches  # rank 0's slices only

    @property
    def model(self):  # type: ignore[no-untyped-def]
        return self.runner.model

    def max_num_tokens_per_sequence(self, chunk_tokens: int) -> int:
        return self.runner.max_num_tokens_per_sequence(chunk_tokens)

    # ---- supervision -----------------------------------------------------------------------------
    @property
    def failure(self) -> RankFailedError | None:
        return self._failure

    def watch(self, callback: Callable[[RankFailedError], None]) -> None:
        """Call `callback(error)` once when a rank is lost (at once if one already is)."""
        self._watchers.append(callback)
        if self._failure is not None:
            callback(self._failure)

    def _supervise(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._closing:
            self._fail(RankFailedError(f"tensor-parallel rank {rank} exited with code {code}"))

    def _fail(self, failure: RankFailedError) -> None:
        if self._failure is not None:
            return
        self._failure = failure
        for callback in list(self._watchers):  # first: /health turns unready, streams end
            try:
                callback(failure)
            except Exception:  # noqa: BLE001 - one watcher must not silence the next
                logger.exception("tensor-parallel failure watcher raised")
        logger.error("replica down: %s", failure)
        self._kill_workers()  # the others too: a TP replica lives or dies whole

    def _lost_rank_message(self, exc: BaseException) -> str:
        deadline = time.monotonic() + 2.0  # a dead peer's exit code may trail the closed socket
        while time.monotonic() < deadline:
            for rank, proc in enumerate(self._workers, start=1):
                if proc.poll() is not None:
                    return f"tensor-parallel rank {rank} exited with code {proc.returncode}"
            time.sleep(0.05)
        return ("tensor-parallel collective failed: "
                f"{str(exc).splitlines()[0] if str(exc) else exc!r}")

    # ---- shutdown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (a None batch: they exit 0), waiting up to 10 s; kill what is left."""
        if self._closing:
            return
        self._closing = True
        if self._failure is None and self._lock.acquire(timeout=10):
            try:
                self.group.broadcast_object(None)
            except RuntimeError:
                pass
            finally:
                self._lock.release()
        for proc in self._workers:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():  # with a peer gone it may hang: at most 5 s, on a daemon thread
            done = threading.Thread(target=dist.destroy_process_group, daemon=True)
            done.start()
            done.join(timeout=5)

    def _kill_workers(self) -> None:
        for proc in self._workers:
            if proc.poll() is None:
                proc.kill()

