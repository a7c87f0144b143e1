"""Fused MoE over MXFP4 expert weights (gpt-oss): the grouped GEMMs of fused_moe.py with B read as
packed e2m1 nibbles + e8m0 group scales and dequantized in registers, tile by tile.

Dimension legend: T tokens, K experts per token (top-k), P = T * K pairs, E experts, H hidden,
I expert intermediate, N a GEMM's output rows, Kd its inputs (H, then I), G = Kd / 32 groups.

    w13 blocks [E, 2I, H/32, 16] uint8, scales [E, 2I, H/32] uint8   gate rows, then up rows
    w2  blocks [E, H, I/32, 16] uint8,  scales [E, H, I/32] uint8
    b13 [E, 2I], b2 [E, H]                                           optional biases (activation
                                                                     dtype)
    out [T, H] = sum_k w[t, k] * (w2[e] @ act(w13[e] @ x + b13[e]) + b2[e])
                 (engine/layers/mxfp4.py defines the dequantized w13, w2; act: SiLU-and-mul or
                 ClampedSwiGLU)

A byte j of a row holds inputs 2j (low nibble) and 2j + 1 (high nibble), so each K step of BLOCK_K
inputs is two dots: A's even columns times the low nibbles, A's odd columns times the high ones,
each [BLOCK_K/2] deep. The scale of input k is row n's byte k // 32; 2 ** (s - 127) is built from
its bits (s = 0, 2 ** -127, reads as 0: no real checkpoint uses it). Routing, block alignment and
the weighting of the second GEMM are fused_moe.py's. Reference: dequantize, then
`fused_moe_reference`.

Status: checked against the reference in Triton's interpreter (tests/engine/kernels); not yet
timed on a GPU, so the engine takes it only when bfloat16 experts would not fit
(engine/models/gpt_oss_moe.py).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from engine.kernels.activation import ClampedSwiGLU
from engine.kernels.fused_moe import fused_moe_reference, moe_align_block_size
from engine.kernels.launch import check_same_device, interpreting
from engine.kernels.tuning import split_launch_options
from engine.layers.mxfp4 import GROUP_SIZE, dequantize_mxfp4


def fused_moe_mxfp4_reference(hidden: torch.Tensor, w13_blocks: torch.Tensor,
                              w13_scales: torch.Tensor,
                              w2_blocks: torch.Tensor, w2_scales: torch.Tensor,
                              topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor, **extra) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Dequantize every expert to hidden's dtype, then the dense reference."""
    w13 = dequantize_mxfp4(w13_blocks, w13_scales, hidden.dtype)
    w2 = dequantize_mxfp4(w2_blocks, w2_scales, hidden.dtype)
    return fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids, **extra)


# The kernel's @triton.jit helpers, module globals once `_kernels()` built them: the interpreter
# (tests) resolves a kernel's callees in its module's globals, not in an enclosing function.
_e2m1_times = None
_load_b = None


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    global _e2m1_times, _load_b

    @triton.jit
    def e2m1_times(code, scale):
        """4-bit e2m1 codes (int32) -> code's value * scale (float32)."""
        exponent = (code >> 1) & 3
        mantissa = (code & 1).to(tl.float32)
        magnitude = tl.where(exponent == 0, 0.5 * mantissa,
                             (1.0 + 0.5 * mantissa) * tl.where(exponent == 3, 4.0,
                                                               tl.where(exponent == 2, 2.0, 1.0)))
        value = magnitude * scale
        return tl.where((code & 8) != 0, -value, value)

    _e2m1_times = e2m1_times

    @triton.jit
    def load_b(blocks_ptrs, scales_ptrs, mask):
        """(low-nibble values, high-nibble values) [BLOCK_K/2, BLOCK_N] float32 of a B tile."""
        packed = tl.load(blocks_ptrs, mask=mask, other=0).to(tl.int32)
        exponent = tl.load(scales_ptrs, mask=mask, other=0).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)  # 2 ** (s - 127)
        return _e2m1_times(packed & 15, scale), _e2m1_times(packed >> 4, scale)

    _load_b = load_b

    @triton.jit
    def moe_mxfp4_gemm_kernel(
            a_ptr, blocks_ptr, scales_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
            num_post_padded_ptr, bias_ptr, N, K, num_pairs, max_padded,
            stride_am, stride_blocks_e, stride_blocks_n, stride_scales_e, stride_scales_n,
            stride_cm, stride_bias_e, swiglu_alpha, swiglu_limit,
            PAIRS_PER_A_ROW: tl.constexpr, FUSE_SILU: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr,
            HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """fused_moe.py's moe_gemm_kernel with B = MXFP4 (module docstring); BLOCK_K % 32 == 0."""
        HALF_K: tl.constexpr = BLOCK_K // 2
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(max_padded, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group_size = GROUP_M * num_pid_n
        first_m = (pid // group_size) * GROUP_M
        rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group_size) % rows_in_group
        pid_n = (pid % group_size) // rows_in_group
        if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + offs_m)
        row_valid = pair < num_pairs
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        a_rows = (pair // PAIRS_PER_A_ROW).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = offs_n < N
        offs_j = tl.arange(0, HALF_K)  # byte j of the step: inputs 2j and 2j + 1
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + 2 * offs_j[None, :]  # [BLOCK_M, HALF_K] even
        blocks_ptrs = (blocks_ptr + expert * stride_blocks_e + offs_n[None, :] * stride_blocks_n
                       + offs_j[:, None])  # [HALF_K, BLOCK_N]
        scales_ptrs = (scales_ptr + expert * stride_scales_e + offs_n[None, :] * stride_scales_n
                       + offs_j[:, None] // (32 // 2))
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_valid = 2 * offs_j < K - k0
            a_mask = row_valid[:, None] & k_valid[None, :]
            a_even = tl.load(a_ptrs, mask=a_mask, other=0.0)
            a_odd = tl.load(a_ptrs + 1, mask=a_mask, other=0.0)
            b_mask = k_valid[:, None] & n_valid[None, :]
            b_lo, b_hi = _load_b(blocks_ptrs, scales_ptrs, b_mask)
            acc = tl.dot(a_even, b_lo.to(a_even.dtype), acc)
            acc = tl.dot(a_odd, b_hi.to(a_odd.dtype), acc)
            if FUSE_SILU:
                up_lo, up_hi = _load_b(blocks_ptrs + N * stride_blocks_n,
                                       scales_ptrs + N * stride_scales_n,
                                      b_mask)
                acc_up = tl.dot(a_even, up_lo.to(a_even.dtype), acc_up)
                acc_up = tl.dot(a_odd, up_hi.to(a_odd.dtype), acc_up)
            a_ptrs += BLOCK_K
            blocks_ptrs += HALF_K
            scales_ptrs += BLOCK_K // 32
        if HAS_BIAS:
            bias_row = bias_ptr + expert * stride_bias_e
            acc += tl.load(bias_row + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
            if FUSE_SILU:
                acc_up += tl.load(bias_row + N + offs_n, mask=n_valid,
                                  other=0.0).to(tl.float32)[None, :]
        if FUSE_SILU:
            if CLAMPED_SWIGLU:
                gate = tl.minimum(acc, swiglu_limit)
                up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
                acc = (up + 1.0) * gate * tl.sigmoid(gate * swiglu_alpha)
            else:
                acc = acc * tl.sigmoid(acc) * acc_up
        if MUL_WEIGHT:
            w = tl.load(weights_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])

    return SimpleNamespace(triton=triton, gemm=moe_mxfp4_gemm_kernel)


# BLOCK_K counts inputs (a multiple of 32: whole scale groups); untimed on GPUs, hence one config.
_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
           "num_stages": 2}
_INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}


def _run_gemm(kern, a, blocks, scales, c, weights, routing, n, k, pairs_per_a_row, fuse_silu,
              mul_weight, cfg, bias, activation):
    meta, opts = split_launch_options(cfg)
    max_padded = routing.sorted_pair_ids.numel()
    grid = (kern.triton.cdiv(max_padded, meta["BLOCK_M"]) * kern.triton.cdiv(n, meta["BLOCK_N"]),)
    kern.gemm[grid](
        a, blocks, scales, c, weights, routing.sorted_pair_ids, routing.expert_ids,
        routing.num_pairs_post_padded, bias if bias is not None else weights, n, k, weights.numel(),
        max_padded, a.stride(0), blocks.stride(0), blocks.stride(1), scales.stride(0),
        scales.stride(1), c.stride(0), bias.stride(0) if bias is not None else 0,
        activation.alpha if activation is not None else 0.0,
        activation.limit if activation is not None else 0.0,
        PAIRS_PER_A_ROW=pairs_per_a_row, FUSE_SILU=fuse_silu, CLAMPED_SWIGLU=activation is not None,
        HAS_BIAS=bias is not None, MUL_WEIGHT=mul_weight, **meta, **opts,
    )


def fused_moe_mxfp4_triton(
    hidden: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor,
    w2_blocks: torch.Tensor, w2_scales: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, *,
    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
    activation: ClampedSwiGLU | None = None, config: dict | None = None,
) -> torch.Tensor:
    """Same contract as `fused_moe_mxfp4_reference`."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, num_groups, group_bytes = w13_blocks.shape
    inter = two_inter // 2
    assert group_bytes == GROUP_SIZE // 2 and num_groups * GROUP_SIZE == hidden_size, (
        f"w13 blocks {tuple(w13_blocks.shape)} for hidden {hidden_size}")
    assert w13_scales.shape == w13_blocks.shape[:3], f"w13 scales {tuple(w13_scales.shape)}"
    assert w2_blocks.shape == (num_experts, hidden_size, inter // GROUP_SIZE, GROUP_SIZE // 2), (
        f"w2 blocks {tuple(w2_blocks.shape)}")
    assert w2_scales.shape == w2_blocks.shape[:3], f"w2 scales {tuple(w2_scales.shape)}"
    assert w13_blocks.dtype == w13_scales.dtype == w2_blocks.dtype == w2_scales.dtype == torch.uint8
    for t in (hidden, w13_blocks, w13_scales, w2_blocks, w2_scales):
        assert t.is_contiguous()
    for bias, shape in ((w13_bias, (num_experts, 2 * inter)),
                        (w2_bias, (num_experts, hidden_size))):
        if bias is not None:
            assert tuple(bias.shape) == shape and bias.stride(-1) == 1, f"bias {tuple(bias.shape)}"
    check_same_device(hidden, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    if num_tokens == 0:
        return torch.empty_like(hidden)
    cfg = config or (_INTERPRETER_CONFIG if interpreting() else _CONFIG)
    assert cfg["BLOCK_K"] % GROUP_SIZE == 0
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    weights = topk_weights.contiguous().view(-1)  # [P]
    kern = _kernels()
    routing = moe_align_block_size(topk_ids, cfg["BLOCK_M"], num_experts)
    w13_b = w13_blocks.view(num_experts, two_inter, -1)  # [E, 2I, H/2] bytes
    w13_s = w13_scales.view(num_experts, two_inter, -1)  # [E, 2I, H/32]
    w2_b = w2_blocks.view(num_experts, hidden_size, -1)  # [E, H, I/2]
    w2_s = w2_scales.view(num_experts, hidden_size, -1)  # [E, H, I/32]
    inter_out = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _run_gemm(kern, hidden, w13_b, w13_s, inter_out, weights, routing, inter, hidden_size, top_k,
              True, False, cfg, w13_bias, activation)
    partial = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _run_gemm(kern, inter_out, w2_b, w2_s, partial, weights, routing, hidden_size, inter, 1,
              False, True, cfg, w2_bias, None)
    return partial.view(num_tokens, top_k, hidden_size).sum(dim=1,
                                                            dtype=torch.float32).to(hidden.dtype)
