"""engine/kernels/cpu/huge_pages.py: the KV cache's allocation."""

from __future__ import annotations

import torch

from engine.kernels.cpu import huge_pages


def test_huge_page_tensor_is_zeroed_contiguous_and_starts_on_a_huge_page() -> None:
    shape = (70, 16, 3, 64)  # 430 KiB x 2 bytes: over one huge page
    tensor = huge_pages.zeros((shape[0] * 10, *shape[1:]), torch.float16)
    assert tensor.shape == (700, 16, 3, 64) and tensor.dtype == torch.float16
    assert tensor.is_contiguous() and not tensor.any()
    assert tensor.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    tensor[-1, -1, -1, -1] = 1.0  # the last element is inside the allocation
    assert tensor.sum().item() == 1.0


def test_small_tensors_are_plain_zeros() -> None:
    tensor = huge_pages.zeros((4, 16, 2, 8), torch.float32)
    assert tensor.shape == (4, 16, 2, 8) and tensor.is_contiguous() and not tensor.any()
