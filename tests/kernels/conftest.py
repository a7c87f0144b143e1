"""Kernel tests run the Triton kernels in Triton's CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before triton is first imported; the kernel modules import triton
lazily, so setting it here (at collection, before any test builds a kernel) is enough.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
