"""Model building blocks, and the factories that pick their implementation per device.

CPU: PyTorch implementations (the references). CUDA: Triton kernels from engine/kernels.
`AIGW_KERNELS=triton|torch` forces one (read once: engine.kernels.FORCED_BACKEND).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.layers.linear import LinearWeight


def attention_backend_name(device: torch.device) -> str:
    from engine import kernels

    return kernels.kernel_backend(device)


def make_linear_factory(config: EngineConfig, device: torch.device, raw_weights: dict):  # type: ignore[no-untyped-def]
    """(hf_name, dense weight) -> LinearWeight, in the engine's dtype and quantization."""
    from engine.layers.linear import DenseLinear, OneDNNLinear

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[config.resolved_dtype]

    from engine.layers.q4_linear import SUPPORTED_TYPES

    # q4 (the CPU default) with the native kernels: every linear on them, in the file's Q4_0 / Q4_1
    # / Q8_0 blocks where it has them, else quantized at load (config.quantize_at_load; lm head
    # Q8_0). Without the native kernels, a file with Q4 blocks takes PyTorch's int4 kernel for
    # decode rows and a float checkpoint keeps float32 whole.
    native_blocks = native_quantization(config, device, dtype)
    load_block_type = config.quantize_at_load.upper()  # "Q8_0" or "Q4_1"
    q4 = config.decode_weights == "q4" and not native_blocks and any(
        getattr(raw, "ggml_type", None) in SUPPORTED_TYPES for raw in raw_weights.values())

    from engine.layers.fp8_block_linear import can_run_w8a8
    from engine.loader.fp8_blocks import RawFP8Blocks

    # a block-scaled FP8 checkpoint's weights as stored run the block-scaled kernel where it is
    # native
    fp8_blocks = (can_run_w8a8(device)
                  and any(isinstance(r, RawFP8Blocks) for r in raw_weights.values()))

    def make(name: str, weight: torch.Tensor) -> LinearWeight:
        if fp8_blocks and name != "lm_head.weight":
            blocked = _make_fp8_blocks(name, weight, raw_weights, device, dtype)
            if blocked is not None:
                return blocked
        if native_blocks:
            quantized = _make_native(name, weight, raw_weights, load_block_type)
            if quantized is not None:
                return quantized
        if q4:
            quantized = _make_q4(name, weight.to(device=device, dtype=dtype), raw_weights)
            if quantized is not None:
                return quantized
        if config.quantization == "fp8" and name != "lm_head.weight":
            from engine.layers.fp8_linear import FP8Linear

            return FP8Linear.from_dense(weight.to(device), dtype)
        placed = weight.to(device=device, dtype=dtype)
        if OneDNNLinear.is_available(placed):
            return OneDNNLinear(placed)
        return DenseLinear(placed)

    make.native_blocks = native_blocks  # type: ignore[attr-defined] # read by uses_native_blocks
    return make


def native_quantization(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linears (and MoE experts) run on the native CPU kernels' blocks: the q4 mode, on the
    CPU, in float32, with the kernels built (engine/kernels/cpu)."""
    if config.decode_weights != "q4" or device.type != "cpu" or dtype != torch.float32:
        return False
    from engine.kernels import cpu as native

    return native.load()


def uses_native_blocks(make_linear: object) -> bool:
    """Whether a factory from `make_linear_factory` puts weights on the native kernels' blocks, so
    a model builds its MoE experts as native per-expert linears
    (engine/layers/native_experts.py)."""
    return bool(getattr(make_linear, "native_blocks", False))


def _make_native(name: str, weight: torch.Tensor, raw_weights: dict,  # type: ignore[type-arg]
                 load_block_type: str) -> LinearWeight | None:
    """The native form of linear `name` ([out, in] float `weight`): the file's blocks for it (a
    fused projection: its parts', all of one native type), else `weight` quantized now (the lm head
    to Q8_0, the others to `load_block_type`: Q8_0 by default, bench/results/q4-every-family-cpu.md
    says why), or None when its shape does not fit the kernels."""
    from engine.layers.block_quant import can_quantize
    from engine.layers.native_linear import NativeQuantLinear

    out_features, in_features = weight.shape
    if name == "lm_head.weight":
        raw = raw_weights.get(name) or raw_weights.get("model.embed_tokens.weight")
        found = [raw]
    else:
        prefix, _, leaf = name.rpartition(".")  # "...self_attn.qkv_proj", "weight"
        parent, _, module = prefix.rpartition(".")
        found = [raw_weights.get(f"{parent}.{p}.{leaf}")
                 for p in _FUSED_PARTS.get(module, (module,))]
    types = {getattr(p, "ggml_type", None) for p in found}  # None: no GGUF blocks for a part
    if (len(types) == 1 and None not in types
            and all(NativeQuantLinear.supports(p.ggml_type, p.shape[0]) for p in found)
            and sum(p.shape[0] for p in found) == out_features
            and all(p.shape[1] == in_features for p in found)):
        return NativeQuantLinear.from_raw([(p.ggml_type, p.data) for p in found])
    if not can_quantize(weight):
        return None
    return NativeQuantLinear.from_float(weight,
                                        "Q8_0" if name == "lm_head.weight" else load_block_type)


_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                "gate_up_proj": ("gate_proj", "up_proj")}


def _make_fp8_blocks(name: str, weight: torch.Tensor, raw_weights: dict,  # type: ignore[type-arg]
                     device: torch.device, dtype: torch.dtype) -> LinearWeight | None:
    """The linear `name` from its FP8 blocks as stored (a fused projection: its parts' blocks
    joined), or None: no blocks for it or one of its parts, parts that split an N block, or
    blocks that do not dequantize to exactly `weight`, up to rows the model reordered within
    their N blocks (Llama 4's q/k rope permutation, which keeps each row's block scale): a
    weight transformed otherwise (a tensor-parallel shard) is served dense."""
    from engine.layers.fp8_block_linear import FP8BlockLinear
    from engine.loader.fp8_blocks import RawFP8Blocks

    prefix, _, leaf = name.rpartition(".")
    parent, _, module = prefix.rpartition(".")
    found = [raw_weights.get(f"{parent}.{p}.{leaf}") for p in _FUSED_PARTS.get(module, (module,))]
    if not all(isinstance(p, RawFP8Blocks) for p in found) or len({p.block for p in found}) != 1:
        return None
    block = found[0].block
    layer = FP8BlockLinear.concat([(p.wq.to(device), p.scale.to(device)) for p in found], block,
                                  dtype)
    if layer is None:
        return None
    dense, target = layer.dequantize(), weight.to(device=device, dtype=dtype)
    if torch.equal(dense, target):
        return layer
    order = _rows_within_blocks(dense, target, block[0])
    if order is None:
        return None
    return FP8BlockLinear(layer.wq[order], layer.w_scale, block, dtype)  # [N, K] rows reordered


def _rows_within_blocks(dense: torch.Tensor, target: torch.Tensor,
                        block_n: int) -> torch.Tensor | None:
    """The row order with dense[order] == target (exactly) that moves rows only within their
    block of `block_n` rows, or None when there is none."""
    if dense.shape != target.shape:
        return None
    as_bytes = lambda rows: rows.contiguous().view(torch.uint8).cpu().numpy()  # noqa: E731
    order = []
    for start in range(0, dense.shape[0], block_n):
        stored = {row.tobytes(): start + i
                  for i, row in enumerate(as_bytes(dense[start:start + block_n]))}
        for row in as_bytes(target[start:start + block_n]):
            found = stored.get(row.tobytes())
            if found is None:
                return None
            order.append(found)
    return torch.tensor(order, device=dense.device)


def _make_q4(name: str, weight: torch.Tensor, raw_weights: dict) -> LinearWeight | None:  # type: ignore[type-arg]
    """The q4 decode form of a weight, or None when the file has no Q4 blocks for it.

    With the native CPU kernels (engine/kernels/cpu) every row runs on the file's blocks (the lm
    head too, from the tied embedding's Q8_0 blocks); without them, decode rows take PyTorch's int4
    kernel.
    """
    from engine.kernels import cpu as native
    from engine.layers.native_linear import NativeQuantLinear
    from engine.layers.q4_linear import SUPPORTED_TYPES, BF16Linear, Q4DecodeLinear

    use_native = weight.dtype == torch.float32 and native.load()
    if name == "lm_head.weight":
        raw = raw_weights.get(name) or raw_weights.get("model.embed_tokens.weight")
        if (use_native and raw is not None and raw.shape == tuple(weight.shape)
                and NativeQuantLinear.supports(raw.ggml_type, raw.shape[0])):
            return NativeQuantLinear.from_raw([(raw.ggml_type, raw.data)])
        return BF16Linear(weight)
    prefix, _, leaf = name.rpartition(".")  # "...self_attn.qkv_proj", "weight"
    parent, _, module = prefix.rpartition(".")
    part_names = [f"{parent}.{p}.{leaf}" for p in _FUSED_PARTS.get(module, (module,))]
    found = [raw_weights.get(p) for p in part_names]
    parts = [p for p in found if p is not None and p.ggml_type in SUPPORTED_TYPES]
    if len(parts) != len(found):
        return None
    if use_native and all(NativeQuantLinear.supports(p.ggml_type, p.shape[0]) for p in parts):
        return NativeQuantLinear.from_raw([(p.ggml_type, p.data) for p in parts])
    return Q4DecodeLinear.from_raw(weight, [(p.ggml_type, p.data, p.shape) for p in parts])
