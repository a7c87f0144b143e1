"""Block-scaled FP8 (E4M3) GEMM: weights as DeepSeek-V3 / Qwen3-FP8 checkpoints store them,
activations quantized per token in groups of the weight's K block (DeepSeek's `act_quant`).

    wq [N, K] float8_e4m3fn, w_scale [ceil(N/Bn), ceil(K/Bk)] fp32:  w[n, k] ~= wq[n, k] * w_scale[n
                                                                     // Bn, k // Bk]
    xq [T, K] float8_e4m3fn, x_scale [T, ceil(K/Bk)] fp32:          x[t, k] ~= xq[t, k] * x_scale[t,
                                                                    k // Bk]
    out[t, n] = sum over K blocks b of (xq[t, b] . wq[n, b]) * x_scale[t, b] * w_scale[n // Bn, b]

(fp32 accumulation; one K block per dot, scaled into the float32 sum, as DeepSeek's kernel does).
`fp8_block_gemm_triton` runs it on FP8 tensor cores (Hopper / Ada; Triton's interpreter runs it on
the CPU, which is how the tests check its math); `fp8_block_gemm_reference` is the same math in
torch; `fp8_block_linear_weight_only` dequantizes the weight (GPUs without FP8, the CPU).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from engine.kernels.fp8 import FP8_DTYPE, FP8_MAX
from engine.kernels.launch import check_same_device, interpreting

_MIN_SCALE = 1e-12


def quantize_activation_per_group(x: torch.Tensor,
                                  group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] fp8, x_scale [T, ceil(K / group_k)] fp32), dynamic per token and
    group."""
    t, k = x.shape
    num_groups = -(-k // group_k)
    padded = F.pad(x.float(), (0, num_groups * group_k - k))  # [T, G * group_k]
    groups = padded.view(t, num_groups, group_k)  # [T, G, group_k]
    scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)  # [T, G]
    xq = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq.view(t, -1)[:, :k].contiguous(), scale


def quantize_weight_blocks(w: torch.Tensor,
                           block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (wq [N, K] fp8, w_scale [ceil(N/Bn), ceil(K/Bk)] fp32) by block amax, as a
    block-scaled checkpoint's converter writes it (partial edge blocks included)."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))  # [Nb * Bn, Kb * Bk]
    tiles = padded.view(nb, bn, kb, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_MIN_SCALE)  # [Nb, Kb]
    wq = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return wq.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale


def dequantize_blocks(wq: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """wq [N, K] fp8 and its block scales -> [N, K] in `dtype`."""
    n, k = wq.shape
    scale = w_scale.float().repeat_interleave(block[0], dim=0)[:n]  # [N, Kb]
    scale = scale.repeat_interleave(block[1], dim=1)[:, :k]  # [N, K]
    return (wq.float() * scale).to(dtype)


def fp8_block_gemm_reference(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                             w_scale: torch.Tensor, block: tuple[int, int],
                             out_dtype: torch.dtype) -> torch.Tensor:
    """The kernel's math in fp32 torch: [T, K] x [N, K] -> [T, N] in out_dtype."""
    bn, bk = block
    n, k = wq.shape
    out = torch.zeros(xq.shape[0], n, dtype=torch.float32, device=xq.device)
    w_rows = w_scale.float().repeat_interleave(bn, dim=0)[:n]  # [N, Kb]
    for b, k0 in enumerate(range(0, k, bk)):
        part = xq[:, k0:k0 + bk].float() @ wq[:, k0:k0 + bk].float().T  # [T, N]
        out += part * x_scale[:, b:b + 1].float() * w_rows[None, :, b]
    return out.to(out_dtype)


def fp8_block_linear_weight_only(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                                 block: tuple[int, int]) -> torch.Tensor:
    """x [..., K] @ dequant(wq)^T -> [..., N] in x's dtype; runs anywhere."""
    return F.linear(x, dequantize_blocks(wq, w_scale, block, x.dtype))


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_block_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
                              stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                              GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """C[M, N] = sum over K blocks of (A_b @ B_b^T) * As[:, b] * Bs[n // GROUP_N, b]; one
        program per [BLOCK_M, BLOCK_N] tile; BLOCK_K is the weight's K block."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_valid = offs_m < M
        n_valid = offs_n < N
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
        b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BK, BN]
        as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm  # [BM], one K block apart
        bs_ptrs = bs_ptr + (offs_n // GROUP_N).to(tl.int64) * stride_bsn  # [BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_valid = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=m_valid[:, None] & k_valid[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
            a_s = tl.load(as_ptrs + kb, mask=m_valid, other=0.0)
            b_s = tl.load(bs_ptrs + kb, mask=n_valid, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])

    return SimpleNamespace(triton=triton, gemm=fp8_block_gemm_kernel)


def _launch_config(m: int, block_n: int) -> dict[str, int]:
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": min(32, block_n), "num_warps": 4}
    block_m = 16 if m <= 16 else 64 if m <= 256 else 128
    return {"BLOCK_M": block_m, "BLOCK_N": min(128, block_n),
            "num_warps": 4 if block_m < 128 else 8, "num_stages": 3}


def fp8_block_gemm_triton(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                          w_scale: torch.Tensor, block: tuple[int, int],
                          out_dtype: torch.dtype) -> torch.Tensor:
    """Same contract as `fp8_block_gemm_reference`. The blocks must be powers of two >= 16 (a
    tile spans one K block, and a whole number of tiles spans an N block)."""
    bn, bk = block
    assert xq.dim() == 2 and wq.dim() == 2 and xq.shape[1] == wq.shape[1], "need [M, K] x [N, K]"
    assert xq.dtype == FP8_DTYPE and wq.dtype == FP8_DTYPE, "operands must be float8_e4m3fn"
    m, k = xq.shape
    n = wq.shape[0]
    num_kb = -(-k // bk)
    assert x_scale.shape == (m, num_kb) and w_scale.shape == (-(-n // bn), num_kb), \
        f"scales must be [M, Kb] and [Nb, Kb], got {tuple(x_scale.shape)} / {tuple(w_scale.shape)}"
    assert x_scale.dtype == torch.float32 and w_scale.dtype == torch.float32
    for size in block:
        assert size >= 16 and size & (size
                                      - 1) == 0, f"block sizes must be powers of two >= 16: {block}"
    assert xq.stride(1) == 1 and wq.stride(1) == 1, "operands need unit-stride K"
    assert x_scale.stride(1) == 1 and w_scale.stride(1) == 1, "scales need unit-stride K blocks"
    check_same_device(xq, wq, x_scale, w_scale)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    kern = _kernels()
    config = _launch_config(m, bn)
    meta = {key: config[key] for key in ("BLOCK_M", "BLOCK_N")}
    opts = {key: value for key, value in config.items() if key not in meta}
    grid = (kern.triton.cdiv(m, meta["BLOCK_M"]), kern.triton.cdiv(n, meta["BLOCK_N"]))
    kern.gemm[grid](xq, wq, out, x_scale, w_scale, m, n, k,
                    xq.stride(0), wq.stride(0), out.stride(0), x_scale.stride(0), w_scale.stride(0),
                    GROUP_N=bn, BLOCK_K=bk, **meta, **opts)
    return out


def fp8_block_linear_w8a8(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                          block: tuple[int, int]) -> torch.Tensor:
    """x [..., K] -> [..., N]: quantize x per token and K block, run the kernel, x's dtype out."""
    lead = x.shape[:-1]
    xq, x_scale = quantize_activation_per_group(x.reshape(-1, x.shape[-1]), block[1])  # [T, K]
    out = fp8_block_gemm_triton(xq, wq, x_scale, w_scale.float().contiguous(), block, x.dtype)
    return out.view(*lead, wq.shape[0])  # [..., N]
