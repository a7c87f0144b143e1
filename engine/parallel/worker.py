"""A tensor-parallel worker process (ranks 1..N-1), started by rank 0 (engine/parallel/executor.py):

    python -m engine.parallel.worker      # reads its WorkerSpec (pickled) from stdin

It joins the process group, loads its shard, reports its start-up status to rank 0 (one gathered
line: None or the error), warms up in lockstep with the others, then runs one forward pass per
batch rank 0 broadcasts until rank 0 broadcasts None (stop). It ignores SIGINT and SIGTERM (rank 0
drains the replica and then stops it) and exits when rank 0 is gone (its parent changed), so a
replica never leaves a worker behind.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass

from engine.config import EngineConfig

logger = logging.getLogger("aigw.tp.worker")


@dataclass(frozen=True)
class WorkerSpec:
    config: EngineConfig
    rank: int
    world_size: int
    store_port: int
    timeout_s: float


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)  # rank 0 is gone: no orphan
        time.sleep(0.2)


def startup_error(exc: BaseException) -> str:
    """One line for a failed start: the exception's own message, not a traceback."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def main() -> int:
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {spec.rank} %(levelname)s "
                        "%(name)s: %(message)s")
    from engine.parallel.group import join_group, worker_store
    from engine.parallel.rank import build_rank_runner, step_kind

    store = worker_store(spec.store_port, spec.world_size, spec.timeout_s)
    store.set(f"joined/{spec.rank}", "1")
    device_type = "cuda" if spec.config.device.startswith("cuda") else "cpu"
    group = join_group(store, spec.rank, spec.world_size, device_type, spec.timeout_s)
    status: str | None = None
    try:
        runner, _ = build_rank_runner(spec.config, group)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0 as one line
        status = startup_error(exc)
    statuses = group.all_gather_object((status, None if status else step_kind(runner)))
    if any(line for line, _ in statuses) or len({kind for _, kind in statuses}) > 1:
        return 1  # (rank 0 says why in one line)
    runner.warmup()
    while True:
        batch = group.broadcast_object()
        if batch is None:
            return 0
        runner.execute(batch)


if __name__ == "__main__":
    sys.exit(main())
