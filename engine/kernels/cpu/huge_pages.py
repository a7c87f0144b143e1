"""CPU tensors on transparent huge pages, for memory read in scattered pieces every step (the KV
cache).

    zeros(shape, dtype) -> a zeroed, contiguous CPU tensor whose memory starts on a 2 MiB boundary
                           and is advised MADV_HUGEPAGE (Linux); plain memory elsewhere.

Why: a decode step's attention reads each row's K/V from its own cache blocks (6 KiB a block in
SmolLM2's float16 cache, the blocks of 32 sequences interleaved over the cache), ~3 MB a layer at 32
rows of 128 positions, from memory. With 4 KiB pages every block crosses a page or two (a TLB miss
each, and the hardware prefetchers stop at page boundaries); on 2 MiB pages the 32-row attention
took 15-30% less time in single-thread micro-benchmarks with cold caches
(bench/results/engine-cpu.md). Linux often leaves transparent huge pages to `madvise`
(/sys/kernel/mm/transparent_hugepage/enabled), which PyTorch's allocator does not call unless
THP_MEM_ALLOC_ENABLE=1 is set for the whole process.
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = math.prod(shape)
    element_size = torch.empty((), dtype=dtype).element_size()
    if sys.platform != "linux" or numel * element_size < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    padded = torch.empty(numel + HUGE_PAGE_BYTES // element_size, dtype=dtype)  # not touched yet
    start = (-padded.data_ptr()) % HUGE_PAGE_BYTES // element_size  # data_ptr is 64-byte aligned
    tensor = padded[start:start + numel]
    _advise_huge_pages(tensor.data_ptr(), numel * element_size // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    # the first touch: the kernel backs advised ranges with 2 MiB pages
    return tensor.zero_().view(shape)


def _advise_huge_pages(address: int, length: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass  # an advice only: without it the memory is plain 4 KiB pages
