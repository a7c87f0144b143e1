"""Fused mixture-of-experts MLP (SwiGLU experts) with top-k routing.

Dimension legend:
    T  tokens      E  experts     K  top_k (experts per token)     P = T * K  token-expert pairs
    H  hidden      I  intermediate (per expert)     M  BLOCK_M, rows of one GEMM tile

    hidden        [T, H]
    w13           [E, 2I, H]   gate rows 0..I-1, then up rows I..2I-1
    w2            [E, H, I]
    topk_ids      [T, K] int   topk_weights [T, K] float
    out           [T, H] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])
    expert_e(x)   = w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x))
    gpt-oss:        w2[e] @ act(w13[e] @ x + b13[e]) + b2[e], act = ClampedSwiGLU (activation.py),
                    b13 [E, 2I] and b2 [E, H] optional biases (the routing weight scales b2 too)

Triton path:
    1. moe_align_block_size: pair ids (t * K + k) sorted by expert, each expert's group padded to a
       multiple of M (padding slots hold P, one past the last pair); one expert id per M-row block;
       experts without pairs get no block. No pair is dropped.
    2. grouped GEMM 1 over the blocks, SiLU-and-mul fused:      inter [P, I]
    3. grouped GEMM 2 over the same blocks, routing weight fused: partial [P, H]
    4. partial.view(T, K, H).sum(1)
Padding rows are masked out of every load and store. Triton is imported only when first built.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import NamedTuple

import torch

from engine.kernels.activation import (
    ClampedSwiGLU,
    clamped_swiglu_reference,
    silu_and_mul_reference,
)
from engine.kernels.launch import check_same_device, interpreting, next_pow2
from engine.kernels.tuning import pick_config, split_launch_options


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] int32).

    scoring "softmax" (Mixtral, Qwen-MoE) or "sigmoid"; with `renormalize` the K weights of each
    token are rescaled to sum to 1 (Mixtral does, Qwen2-MoE does not).
    """
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"unknown scoring {scoring!r}")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


class AlignedRouting(NamedTuple):
    """Token-expert pairs grouped by expert in blocks of `block_m` rows (see module docstring)."""

    sorted_pair_ids: torch.Tensor  # [max_padded] int32; pair id, or P in a padding slot
    expert_ids: torch.Tensor  # [max_padded // block_m] int32; expert of each block
    num_pairs_post_padded: torch.Tensor  # [1] int32; blocks at or past this row are unused
    block_m: int


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> AlignedRouting:
    """Sort pairs by expert and pad each expert's group to a multiple of `block_m` (no host
    sync)."""
    flat = topk_ids.flatten().to(torch.int64)  # [P]
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    count_starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # [P] pair ids, grouped by expert
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - count_starts[sorted_experts]
    dest = padded_starts[sorted_experts] + rank
    # at most min(E, P) non-empty experts, each padded by < block_m rows
    max_padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return AlignedRouting(sorted_ids, expert_ids, padded_ends[-1:].to(torch.int32), block_m)


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """Torch reference (the CPU engine's MoE): one batched matmul pair per expert with tokens.

    activation None: SiLU-and-mul; biases w13_bias [E, 2I], w2_bias [E, H] are optional."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten().to(torch.int64)  # [P]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    flat_weights = topk_weights.flatten().float()
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // top_k
        gate_up = hidden[tokens] @ w13[expert].T  # [n, 2I]
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert]
        inter = (silu_and_mul_reference(gate_up) if activation is None
                 else clamped_swiglu_reference(gate_up, activation))  # [n, I]
        y = inter @ w2[expert].T  # [n, H]
        if w2_bias is not None:
            y = y + w2_bias[expert]
        y = y.float()
        out.index_add_(0, tokens, y * flat_weights[pairs, None])
    return out.to(hidden.dtype)


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def moe_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                        num_post_padded_ptr, bias_ptr, N, K, num_pairs, max_padded,
                        stride_am, stride_be, stride_bn, stride_cm, stride_bias_e,
                        swiglu_alpha, swiglu_limit,
                        PAIRS_PER_A_ROW: tl.constexpr, FUSE_SILU: tl.constexpr,
                        CLAMPED_SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                        MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """C[pair, n] = sum_k A[pair // PAIRS_PER_A_ROW, k] * B[expert(pair), n, k] over sorted
        blocks. HAS_BIAS: + bias[expert, n] (and bias[expert, N + n] for the up rows). FUSE_SILU:
        B rows n (gate) and N + n (up) -> silu(gate) * up, or with CLAMPED_SWIGLU gpt-oss's
        (min(up, l) clamped to -l + 1) * g * sigmoid(alpha * g), g = min(gate, l). MUL_WEIGHT: times
        the pair's routing weight. A, B, C have unit-stride last dims."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(max_padded, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group_size = GROUP_M * num_pid_n  # swizzle: GROUP_M row blocks share B tiles in L2
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
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_valid = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            if FUSE_SILU:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_valid[:, None] & n_valid[None, :],
                               other=0.0)
                acc_up = tl.dot(a, b_up, acc_up)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
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

    return SimpleNamespace(triton=triton, gemm=moe_gemm_kernel)


_CONFIGS_SMALL_T = (
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
)
_CONFIGS_LARGE_T = (
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
)
_INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}


def _run_gemm(kern, a, b, c, weights, routing, n, k, pairs_per_a_row, fuse_silu, mul_weight, cfg,
              bias=None, activation=None):
    meta, opts = split_launch_options(cfg)
    max_padded = routing.sorted_pair_ids.numel()
    grid = (kern.triton.cdiv(max_padded, meta["BLOCK_M"]) * kern.triton.cdiv(n, meta["BLOCK_N"]),)
    kern.gemm[grid](
        a, b, c, weights, routing.sorted_pair_ids, routing.expert_ids,
        routing.num_pairs_post_padded, bias if bias is not None else weights, n, k, weights.numel(),
        max_padded, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        bias.stride(0) if bias is not None else 0,
        activation.alpha if activation is not None else 0.0,
        activation.limit if activation is not None else 0.0,
        PAIRS_PER_A_ROW=pairs_per_a_row, FUSE_SILU=fuse_silu, CLAMPED_SWIGLU=activation is not None,
        HAS_BIAS=bias is not None, MUL_WEIGHT=mul_weight, **meta, **opts,
    )


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: ClampedSwiGLU | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Same contract as `fused_moe_reference`. `config` overrides the tuned launch config."""
    assert hidden.dim() == 2 and w13.dim() == 3 and w2.dim() == 3
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    assert w13.shape == (num_experts, 2 * inter, hidden_size), f"w13 {tuple(w13.shape)}"
    assert w2.shape == (num_experts, hidden_size, inter), f"w2 {tuple(w2.shape)}"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    assert not topk_ids.is_floating_point() and topk_weights.is_floating_point()
    assert hidden.dtype == w13.dtype == w2.dtype, "hidden and expert weights must share a dtype"
    assert hidden.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()
    for bias, shape in ((w13_bias, (num_experts, 2 * inter)),
                        (w2_bias, (num_experts, hidden_size))):
        if bias is not None:
            assert tuple(bias.shape) == shape and bias.stride(-1) == 1, ("bias "
                                                                         f"{tuple(bias.shape)}, "
                                                                         f"want {shape}")
            check_same_device(hidden, bias)
    check_same_device(hidden, w13, w2, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    weights = topk_weights.contiguous().view(-1)  # [P]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    kern = _kernels()

    def run(cfg: dict) -> torch.Tensor:
        routing = moe_align_block_size(topk_ids, cfg["BLOCK_M"], num_experts)
        inter_out = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
        _run_gemm(kern, hidden, w13, inter_out, weights, routing, inter, hidden_size, top_k,
                  True, False, cfg, w13_bias, activation)
        partial = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
        _run_gemm(kern, inter_out, w2, partial, weights, routing, hidden_size, inter, 1,
                  False, True, cfg, w2_bias)
        return partial

    if config is None:
        if interpreting():
            config = _INTERPRETER_CONFIG
        else:
            candidates = _CONFIGS_SMALL_T if num_pairs <= 128 else _CONFIGS_LARGE_T
            bucket = (num_experts, inter, hidden_size, top_k, str(hidden.dtype),
                      next_pow2(min(num_tokens, 8192)), w13_bias is not None,
                      activation is not None)
            config = pick_config("fused_moe", bucket, candidates, run, hidden.device)
    partial = run(config)
    return partial.view(num_tokens, top_k, hidden_size).sum(dim=1,
                                                            dtype=torch.float32).to(hidden.dtype)
