"""silu_and_mul, rms_norm and rotary: Triton (interpreter on CPU) vs reference vs naive math."""

import math

import pytest
import torch

from engine.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from engine.kernels.rmsnorm import rms_norm_reference, rms_norm_triton
from engine.kernels.rotary import apply_rotary_reference, apply_rotary_triton
from tests.engine.kernels._util import DEVICE, DTYPES, assert_close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,inter", [(1, 8), (5, 72), (3, 1100)])
def test_silu_and_mul_matches_reference(dtype, num_tokens, inter):
    x = torch.randn(num_tokens, 2 * inter, device=DEVICE, dtype=dtype)
    assert_close(silu_and_mul_triton(x), silu_and_mul_reference(x), dtype)


def test_silu_and_mul_reference_is_gate_times_up():
    x = torch.randn(4, 6)
    gate, up = x[:, :3], x[:, 3:]
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_reference(x), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [8, 72])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, hidden, with_residual):
    x = torch.randn(5, hidden, device=DEVICE, dtype=dtype)
    w = torch.randn(hidden, device=DEVICE, dtype=dtype)
    res = torch.randn(5, hidden, device=DEVICE, dtype=dtype) if with_residual else None
    out, new_res = rms_norm_triton(x, w, 1e-6, res)
    ref_out, ref_res = rms_norm_reference(x, w, 1e-6, res)
    assert_close(out, ref_out, dtype)
    if with_residual:
        assert_close(new_res, ref_res, dtype)
    else:
        assert new_res is None and ref_res is None


def test_rms_norm_reference_matches_formula_and_returns_summed_residual():
    x, res, w = (torch.randn(3, 10, dtype=torch.float64), torch.randn(3, 10, dtype=torch.float64),
                 torch.randn(10, dtype=torch.float64))
    out, new_res = rms_norm_reference(x, w, 1e-5, res)
    s = x + res
    expected = s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(new_res, s)


def _cos_sin(max_pos: int, rotary_dim: int, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # [max_pos, rot/2]
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (32, 16)])
def test_rotary_matches_reference_in_place(dtype, head_dim, rotary_dim):
    cos, sin = _cos_sin(50, rotary_dim)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    q = torch.randn(7, 6, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(7, 2, head_dim, device=DEVICE, dtype=dtype)
    pos = torch.tensor([0, 1, 2, 17, 33, 48, 49], device=DEVICE)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary_reference(q_ref, k_ref, pos, cos, sin)
    apply_rotary_triton(q, k, pos, cos, sin)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    if rotary_dim < head_dim:
        assert torch.equal(q[..., rotary_dim:], q_ref[..., rotary_dim:])


def test_rotary_reference_matches_hf_llama_rotate_half():
    head_dim = 8
    cos_half, sin_half = _cos_sin(10, head_dim)
    q = torch.randn(3, 2, head_dim, dtype=torch.float64)
    k = torch.randn(3, 1, head_dim, dtype=torch.float64)
    pos = torch.tensor([0, 4, 9])
    # HF llama: emb = cat(freqs, freqs); q * cos + rotate_half(q) * sin
    cos = torch.cat([cos_half, cos_half], -1)[pos].unsqueeze(1).double()
    sin = torch.cat([sin_half, sin_half], -1)[pos].unsqueeze(1).double()

    def rotate_half(x):
        return torch.cat([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], -1)

    q_hf, k_hf = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    apply_rotary_reference(q, k, pos, cos_half, sin_half)
    torch.testing.assert_close(q, q_hf, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, k_hf, atol=1e-6, rtol=1e-6)
    assert math.isfinite(q.sum().item())
