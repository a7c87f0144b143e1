"""A oneDNN linear keeps its native memory bounded however many row counts it sees.

oneDNN JIT-builds a primitive per input shape and caches it (~0.55 MiB each, up to 1,024 in each of
two caches): a replica whose token count changed every step grew by hundreds of MiB over a soak.
Row counts are bucketed now (engine/layers/linear.py::row_bucket)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

from engine.layers.linear import OneDNNLinear, row_bucket


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _malloc_in_use_bytes() -> int:
    """Bytes the C heap has handed out and not had back (glibc's mallinfo2: every arena plus
    mmapped chunks): where oneDNN's primitives live, which tracemalloc does not see."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def test_row_buckets_pad_under_an_eighth_and_are_few() -> None:
    for num_rows in range(1, 4097):
        bucket = row_bucket(num_rows)
        assert num_rows <= bucket < num_rows * 1.125 + 1
    assert len({row_bucket(n) for n in range(1, 8193)}) <= 90
    assert [row_bucket(n) for n in (1, 7, 16, 17, 33, 1000)] == [1, 7, 16, 18, 36, 1024]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN (mkldnn) build only")
def test_six_hundred_row_counts_keep_the_onednn_caches_small() -> None:
    """600 distinct row counts: ~330 MiB of primitives unbucketed; bucketed, about 60 of them."""
    torch.manual_seed(0)
    weight = torch.randn(96, 32)
    linear = OneDNNLinear(weight)
    x = torch.randn(600, 32)
    residual = torch.randn(600, 96)
    linear(x[:5])  # oneDNN's own one-time set-up is not what is measured
    before = _malloc_in_use_bytes()
    for num_rows in range(1, 601):
        out = linear(x[:num_rows])
        assert out.shape == (num_rows, 96)
    grown_bytes = _malloc_in_use_bytes() - before
    assert grown_bytes < 64 << 20, f"{grown_bytes / 2**20:.0f} MiB for 600 row counts"
    # the padded rows do not reach the answer: bit for bit what oneDNN gives unpadded
    unpadded = torch.ops.mkldnn._linear_pointwise(x[:37], linear.packed, None, "none", [], "")
    assert row_bucket(37) == 40 and torch.equal(linear(x[:37]), unpadded)
    torch.testing.assert_close(linear(x[:37]), x[:37] @ weight.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(linear.add_to(residual[:37], x[:37]),
                               residual[:37] + x[:37] @ weight.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(linear(x[:40].reshape(2, 20, 32)),
                               (x[:40] @ weight.T).reshape(2, 20, 96), rtol=1e-4, atol=1e-4)
