"""Block tables -> the CPU tensors of a step's attention metadata (ModelRunner moves them to its
device).

Legend: N rows (sequences), W blocks per row, L positions gathered per row. Table entries that are
None (blocks a sliding window released) become block 0: no attention reads them (the window starts
later).
"""

from __future__ import annotations

import torch


def block_table_tensor(tables: list[list[int | None]]) -> torch.Tensor:
    """Block tables -> [S, widest] int64, padded with block 0; a None entry (a block a window
    released) becomes block 0 too: no attention reads it (the window starts after it)."""
    width = max(len(t) for t in tables)
    out = torch.zeros(len(tables), width, dtype=torch.int64)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.tensor([b if b is not None else 0 for b in t], dtype=torch.int64)
    return out


def window_blocks(tables: torch.Tensor, seq_lens: list[int], window: int, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Each decode row's blocks from the first its window reaches: ([N, W] int64 padded with block
    0, positions to gather, [N] int64 position of each row's first gathered block)."""
    # the query at n - 1 sees n - W ..
    firsts = [max(0, n - window) // block_size for n in seq_lens]
    return blocks_from(tables, seq_lens, firsts, block_size, device)


def blocks_from(tables: torch.Tensor, seq_lens: list[int], firsts: list[int], block_size: int,
                device: torch.device) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Each decode row's blocks from its block `firsts[i]` on (a window's or a chunk's first):
    ([N, W] int64 padded with block 0, positions to gather, [N] int64 position of each row's first
    gathered block)."""
    counts = [-(-n // block_size) - f for n, f in zip(seq_lens, firsts, strict=True)]
    blocks = torch.zeros(len(seq_lens), max(counts), dtype=torch.int64)
    for i, (first, count) in enumerate(zip(firsts, counts, strict=True)):
        blocks[i, :count] = tables[i, first:first + count]
    num_positions = max(n - f * block_size for n, f in zip(seq_lens, firsts, strict=True))
    first_positions = torch.tensor([f * block_size for f in firsts], dtype=torch.int64)
    return blocks.to(device), num_positions, first_positions.to(device)


def padded_blocks(tables: torch.Tensor, seq_lens: list[int], first_block: int, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Blocks [first_block, last) of each row, padded with block 0, and the additive mask that hides
    positions past each row's length: ([N, W] int64, positions to use, [N, 1, 1, that] or None)."""
    # positions per row after the first block
    lens = [n - first_block * block_size for n in seq_lens]
    width = -(-max(lens) // block_size)
    blocks = tables[:, first_block:first_block + width]
    if blocks.shape[1] < width:  # rows are padded to the widest table; widen with block 0 if needed
        blocks = torch.nn.functional.pad(blocks, (0, width - blocks.shape[1]))
    num_positions = max(lens)
    if all(n == num_positions for n in lens):
        return blocks.to(device), num_positions, None
    valid = torch.arange(num_positions)[None, :] < torch.tensor(lens)[:, None]  # [N, L]
    mask = torch.zeros(len(lens), 1, 1, num_positions).masked_fill_(
        ~valid.view(len(lens), 1, 1, -1), float("-inf"))
    return blocks.to(device), num_positions, mask.to(device)


def num_shared_blocks(tables: list[list[int]], seq_lens: list[int], block_size: int) -> int:
    """Leading block ids every table has in common, excluding each sequence's last (current)
    block."""
    limit = min((n - 1) // block_size for n in seq_lens)
    first = tables[0]
    shared = 0
    while shared < limit and all(t[shared] == first[shared] for t in tables):
        shared += 1
    return shared
