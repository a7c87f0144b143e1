"""The process group of a tensor-parallel replica and the collectives its layers call.

    store = master_store(timeout_s)  # rank 0, before it starts the workers
    group = join_group(store, rank, world_size, device)  # every rank (rank 0 after workers joined)

Two groups, as vLLM keeps them: `device_group` for tensors (NCCL on CUDA, gloo on the CPU) and
`cpu_group` (always gloo) for the per-step batch metadata, a pickled Python object. Every
collective is timed into `comm_s` / `num_collectives` (wall time on the calling thread: on the CPU
that is the whole cost; on CUDA the NCCL calls are asynchronous and the figure is only the launch),
and per kind into `comm_by_kind` ({"all_reduce" | "gather" | "broadcast": [count, seconds, bytes]};
the bytes are this rank's tensor, 0 for the pickled broadcast).
A collective's time includes waiting for the slowest rank to reach it.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def master_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`store.port`)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def worker_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                         timeout=timedelta(seconds=timeout_s))


class TPGroup:
    """This process's rank in the replica and the collectives over all ranks."""

    def __init__(self, rank: int, world_size: int, device_type: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device_group = dist.group.WORLD
        self.cpu_group = (dist.new_group(backend="gloo") if device_type == "cuda"
                          else dist.group.WORLD)
        self.comm_s = 0.0  # seconds spent in collectives (see the module doc)
        self.num_collectives = 0
        self.comm_by_kind: dict[str, list[float]] = {}  # kind -> [count, seconds, bytes]

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        start = time.perf_counter()
        dist.all_reduce(x, group=self.device_group)
        self._count(start, "all_reduce", x.numel() * x.element_size())
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """On rank 0: every rank's `x` [S, n] side by side, [S, N * n]; on the others: `x`."""
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(x, parts, dst=0, group=self.device_group)
        self._count(start, "gather", x.numel() * x.element_size())
        return torch.cat(parts, dim=-1) if parts is not None else x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled over the gloo group)."""
        start = time.perf_counter()
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        self._count(start, "broadcast", 0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        box: list[Any] = [None] * self.world_size
        dist.all_gather_object(box, obj, group=self.cpu_group)
        return box

    def _count(self, start: float, kind: str, num_bytes: int) -> None:
        elapsed_s = time.perf_counter() - start
        self.comm_s += elapsed_s
        self.num_collectives += 1
        counts = self.comm_by_kind.setdefault(kind, [0, 0.0, 0])
        counts[0] += 1
        counts[1] += elapsed_s
        counts[2] += num_bytes

    def reset_counters(self) -> None:
        self.comm_s, self.num_collectives, self.comm_by_kind = 0.0, 0, {}


def join_group(store: dist.TCPStore, rank: int, world_size: int, device_type: str,
               timeout_s: float) -> TPGroup:
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return TPGroup(rank, world_size, device_type)
