"""HostTierStorage: the second KV tier's bytes, and the copies between it and the KV pool's tensors.

    storage = HostTierStorage.for_kv(kv_tensors, budget_bytes, directory)   # num_slots whole blocks
    storage.apply(transfers)        # offloads (pool -> tier) first, then restores (tier -> pool)
    storage.synchronize()           # CUDA: wait for the side stream (the next step's copies do)

One slot holds one pool block id: block `b` of every distinct KV tensor (K and V of every tensor
slot, engine/kv_cache/layout.py), so a slot is `bytes_per_block` bytes and a copy is an index copy
per tensor, bit for bit (no conversion, no compression).

Where the bytes live:
  CUDA   pinned host memory; copies on a side stream that waits for the model's stream before it
         reads an evicted block and makes the model's stream wait for it before the step runs, so
         the host thread goes on preparing the step while the DMA runs.
  CPU    the pool is host memory already, so the tier must hold more than memory: a file, mapped
         shared (torch.from_file), `budget_bytes` long and unlinked at once (sparse: a slot takes
         disk only once written). A copy is a memcpy into the page cache; the kernel writes pages
         back in the background, and reads them back from disk only after memory pressure dropped
         them. bench/results/kv-host-tier-cpu.md measured this against an in-memory compressed tier
         (lossless codecs on the default model's KV save at most 16%: floats' mantissas are noise).
"""

from __future__ import annotations

import os
import tempfile

import torch

from engine.kv_cache.host_tier import KVTransfers


class HostTierStorage:
    def __init__(self, kv_tensors: list[torch.Tensor], num_slots: int,
                 directory: str | None = None) -> None:
        if not kv_tensors:
            raise ValueError("no KV tensors")
        unique: dict[int, torch.Tensor] = {}
        for tensor in kv_tensors:  # MLA shares K and V; window groups share slots: copy each once
            unique.setdefault(id(tensor), tensor)
        self.kv_tensors = list(unique.values())
        first = self.kv_tensors[0]
        self.device = first.device
        self.block_shape = tuple(first.shape[1:])  # [block_size, G, Dh]
        self.num_slots = num_slots
        shape = (num_slots, len(self.kv_tensors), *self.block_shape)
        self.path: str | None = None
        self._stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.store = torch.empty(shape, dtype=first.dtype, pin_memory=True)
            self._stream = torch.cuda.Stream(self.device)
        else:
            self.store = _mapped_file(shape, first.dtype, directory)
        # CUDA: staging tensors the side stream still reads
        self._in_flight: list[torch.Tensor] = []

    @classmethod
    def for_kv(cls, kv_tensors: list[torch.Tensor], budget_bytes: int,
               directory: str | None = None) -> HostTierStorage:
        per_block = bytes_per_slot(kv_tensors)
        num_slots = budget_bytes // per_block
        if num_slots < 1:
            raise ValueError(f"the host tier's budget ({budget_bytes} bytes) must hold at least "
                             "one "
                             f"block ({per_block} bytes)")
        return cls(kv_tensors, int(num_slots), directory)

    @property
    def bytes_per_block(self) -> int:
        return int(self.store[0].numel() * self.store.element_size())

    @torch.inference_mode()
    def apply(self, transfers: KVTransfers) -> None:
        if transfers.is_empty:
            return
        if self._stream is not None:
            self._apply_cuda(transfers)
            return
        if transfers.offload_slots:  # before any restore overwrites a block being offloaded
            ids = torch.tensor(transfers.offload_block_ids, dtype=torch.long)
            slots = torch.tensor(transfers.offload_slots, dtype=torch.long)
            for j, tensor in enumerate(self.kv_tensors):
                self.store[:, j].index_copy_(0, slots, tensor.index_select(0, ids))
        if transfers.restore_slots:
            ids = torch.tensor(transfers.restore_block_ids, dtype=torch.long)
            slots = torch.tensor(transfers.restore_slots, dtype=torch.long)
            for j, tensor in enumerate(self.kv_tensors):
                tensor.index_copy_(0, ids, self.store[:, j].index_select(0, slots))

    def _apply_cuda(self, transfers: KVTransfers) -> None:
        assert self._stream is not None
        compute = torch.cuda.current_stream(self.device)
        self.synchronize()
        self._stream.wait_stream(compute)  # the evicted blocks' last writes are done
        with torch.cuda.stream(self._stream):
            if transfers.offload_slots:
                ids = torch.tensor(transfers.offload_block_ids, dtype=torch.long,
                                   device=self.device)
                gathered = torch.stack([t.index_select(0, ids) for t in self.kv_tensors], 1)
                for i, slot in enumerate(transfers.offload_slots):
                    self.store[slot].copy_(gathered[i], non_blocking=True)
                self._in_flight.append(gathered)
            if transfers.restore_slots:
                staged = torch.empty((len(transfers.restore_slots), *self.store.shape[1:]),
                                     dtype=self.store.dtype, device=self.device)
                for i, slot in enumerate(transfers.restore_slots):
                    staged[i].copy_(self.store[slot], non_blocking=True)
                ids = torch.tensor(transfers.restore_block_ids, dtype=torch.long,
                                   device=self.device)
                for j, tensor in enumerate(self.kv_tensors):
                    tensor.index_copy_(0, ids, staged[:, j])
                self._in_flight.append(staged)
        # the step reads restored blocks, overwrites offloaded ones
        compute.wait_stream(self._stream)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
            self._in_flight.clear()

    def read_slot(self, slot: int) -> torch.Tensor:
        """A copy of one slot's bytes, [num_tensors, block_size, G, Dh] (tests, integrity
        checks)."""
        self.synchronize()
        return self.store[slot].clone()


def bytes_per_slot(kv_tensors: list[torch.Tensor]) -> int:
    unique = {id(t): t for t in kv_tensors}
    return sum(int(t[0].numel() * t.element_size()) for t in unique.values())


def _mapped_file(shape: tuple[int, ...], dtype: torch.dtype, directory: str | None) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    fd, path = tempfile.mkstemp(prefix="aigw-kv-host-tier-", suffix=".bin", dir=directory)
    try:
        os.ftruncate(fd, numel * torch.empty((), dtype=dtype).element_size())
        flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    finally:
        os.close(fd)
        os.unlink(path)  # the mapping keeps the file's pages; nothing left behind at exit
    return flat.view(shape)
