"""The collectives of a tensor-parallel step alone, for `aigw bench engine --tensor-parallel-size
N`.

    costs = measure_transport(world_size, hidden_size, rows=(1, 64, 512))  # N fresh gloo processes
    costs["all_reduce"].seconds(num_ops, num_bytes)                        # a + b * bytes per op

In a TP step a collective's time on rank 0 includes waiting for the slower rank to arrive; this
measures what the transport costs when every rank is ready: N processes (1 thread each) run
back-to-back all-reduces and gathers of float32 [rows, hidden] tensors over loopback gloo (a barrier
before each), and per kind a per-op latency + per-byte cost is fitted to the median times (least
squares over the sizes). The
engine run's collectives (engine/parallel/group.py counts their number and bytes) priced with it
give the step's transport cost; the rest of its time in collectives is waiting.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time
from dataclasses import dataclass

NUM_TIMED = 30  # ops per size (after 5 untimed)


@dataclass(frozen=True)
class TransportCost:
    latency_s: float  # per op
    s_per_byte: float  # per byte of one rank's tensor
    samples: tuple[tuple[int, float], ...]  # (bytes, median seconds)

    def seconds(self, num_ops: int, num_bytes: int) -> float:
        return num_ops * self.latency_s + num_bytes * self.s_per_byte


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world_size: int, port: int, hidden: int, rows: tuple[int, ...],
          out: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    samples = []
    for kind in ("all_reduce", "gather"):
        for n in rows:
            x = torch.randn(n, hidden)
            parts = [torch.empty_like(x) for _ in range(world_size)] if rank == 0 else None
            times = []
            for i in range(5 + NUM_TIMED):
                dist.barrier()
                start = time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(x)
                else:
                    dist.gather(x, parts, dst=0)
                if i >= 5:
                    times.append(time.perf_counter() - start)
            samples.append((kind, x.numel() * 4, statistics.median(times)))
    dist.destroy_process_group()
    if rank == 0:
        out.put(samples)


def measure_transport(world_size: int, hidden_size: int, rows: tuple[int, ...] = (1, 64, 512)
                      ) -> dict[str, TransportCost]:
    """Per kind ("all_reduce", "gather"), latency + bytes cost fitted to `world_size` fresh
    processes' collectives (module doc)."""
    context = mp.get_context("spawn")
    out: mp.Queue = context.Queue()  # type: ignore[type-arg]
    port = _free_port()
    procs = [context.Process(target=_rank, args=(r, world_size, port, hidden_size, rows, out))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        samples = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {kind: _fit([(b, t) for k, b, t in samples if k == kind])
            for kind in ("all_reduce", "gather")}


def _fit(points: list[tuple[int, float]]) -> TransportCost:
    xs, ys = [b for b, _ in points], [t for _, t in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points)
                / max(sum((x - mean_x) ** 2 for x in xs), 1e-30))
    return TransportCost(latency_s=max(mean_y - slope * mean_x, 0.0), s_per_byte=slope,
                         samples=tuple(points))
