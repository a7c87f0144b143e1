"""Kernel dispatch: Triton kernels on CUDA, the PyTorch references on CPU.

Each kernel module holds one Triton kernel, its launcher and its torch reference; the references are
what the CPU engine runs. Triton itself is imported only when a Triton kernel is first built, so the
CPU path never imports it. `AIGW_KERNELS=triton|torch` overrides the choice (triton on CPU needs
`TRITON_INTERPRET=1`, for tests); it is read once, when this package is first imported (the
engine's construction), into `FORCED_BACKEND`, never per kernel call. Tuned Triton launch configs
are cached per GPU model in ~/.cache/aigw/kernels/<gpu name>.json (see tuning.py); tuning times
launches, so warm the engine up (one step per batch shape) before capturing CUDA graphs.

Note: the functions below shadow the submodules of the same name (`store_kv`, `fused_moe`,
`paged_attention`) as attributes of this package; import a module's contents by its full path,
e.g. `from engine.kernels.fused_moe import moe_align_block_size`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from engine.kernels import activation, fp8, rmsnorm, rotary
from engine.kernels import fused_moe as _moe
from engine.kernels import paged_attention as _attn
from engine.kernels import store_kv as _store
from engine.kernels.activation import ClampedSwiGLU
from engine.kernels.fused_moe import select_experts

__all__ = [
    "apply_rotary",
    "fp8_linear",
    "fused_moe",
    "kernel_backend",
    "paged_attention",
    "rms_norm",
    "select_experts",
    "silu_and_mul",
    "store_kv",
]

_BACKENDS = ("triton", "torch")


def backend_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """`AIGW_KERNELS` ("triton" | "torch"), or None (choose by device); ValueError otherwise."""
    forced = environ.get("AIGW_KERNELS") or None
    if forced is not None and forced not in _BACKENDS:
        raise ValueError(f"AIGW_KERNELS must be one of {_BACKENDS}, got {forced!r}")
    return forced


# The process's choice, made once (tests set it with monkeypatch.setattr).
FORCED_BACKEND: str | None = backend_from_env()


def kernel_backend(device: torch.device | str | None = None) -> str:
    """"triton" or "torch" for tensors on `device` (None: the default CUDA device if any)."""
    if FORCED_BACKEND is not None:
        return FORCED_BACKEND
    if device is None:
        return "triton" if torch.cuda.is_available() else "torch"
    return "triton" if torch.device(device).type == "cuda" else "torch"


def _triton(t: torch.Tensor) -> bool:
    return kernel_backend(t.device) == "triton"


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_decode_seqs: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Mixed prefill+decode attention over the paged cache -> [T, H, D] (paged_attention.py).

    The keyword hints are host ints the scheduler knows (they save device syncs on CUDA);
    `num_decode_seqs` says the first that many requests are one-token decodes. `sliding_window`:
    each query sees its W latest positions; `sinks` [H] float32: per-head logits in the denominator;
    `attention_chunk` C: a query at p sees floor(p / C) * C .. p (Llama 4's chunked local
    attention).
    """
    if _triton(q):
        return _attn.paged_attention_triton(
            q, k_cache, v_cache, cu_query_lens, seq_lens, block_tables, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len, num_decode_seqs=num_decode_seqs,
            sliding_window=sliding_window, sinks=sinks, attention_chunk=attention_chunk,
        )
    return _attn.paged_attention_reference(
        q, k_cache, v_cache, cu_query_lens, seq_lens, block_tables, scale,
        sliding_window=sliding_window, sinks=sinks, attention_chunk=attention_chunk,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, KVH, D] into the caches at slot_mapping [T] int64 (store_kv.py)."""
    if _triton(k):
        _store.store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        _store.store_kv_reference(k, v, k_cache, v_cache, slot_mapping)


def fused_moe(
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
    """SwiGLU experts (or gpt-oss's clamped SwiGLU, optional biases), routed top-k:
    hidden [T, H] -> [T, H] (fused_moe.py)."""
    extra = {"w13_bias": w13_bias, "w2_bias": w2_bias, "activation": activation}
    if _triton(hidden):
        return _moe.fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, **extra)
    return _moe.fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids, **extra)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., H] -> (normed, x + residual or None when no residual given) (rmsnorm.py)."""
    if not _triton(x):
        return rmsnorm.rms_norm_reference(x, weight, eps, residual)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # [T, H]
    r2 = residual.reshape(-1, shape[-1]) if residual is not None else None
    normed, new_res = rmsnorm.rms_norm_triton(x2, weight, eps, r2)
    return normed.view(shape), (new_res.view(shape) if new_res is not None else None)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place, rotate-half style (rotary.py)."""
    if _triton(q):
        rotary.apply_rotary_triton(q, k, positions, cos_cache, sin_cache)
    else:
        rotary.apply_rotary_reference(q, k, positions, cos_cache, sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:]  [..., I] (activation.py)."""
    if not _triton(x):
        return activation.silu_and_mul_reference(x)
    out = activation.silu_and_mul_triton(x.reshape(-1, x.shape[-1]))  # [T, I]
    return out.view(*x.shape[:-1], out.shape[-1])


def fp8_linear(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] with FP8 weight wq [N, K] and per-channel scales [N] -> [..., N] (fp8.py).

    On GPUs with FP8 tensor cores (compute capability >= 8.9) activations are quantized per token
    and the w8a8 kernel runs; elsewhere the weight is dequantized (weight-only).
    """
    if _triton(x) and (not x.is_cuda or torch.cuda.get_device_capability(x.device) >= (8, 9)):
        return fp8.fp8_linear_w8a8(x, wq, w_scale, bias)
    return fp8.fp8_linear_weight_only(x, wq, w_scale, bias)
