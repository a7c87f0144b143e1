"""FP8 block-scaled Hugging Face checkpoints (DeepSeek-V3 / R1, Qwen3-*-FP8, Kimi-K2), read as
stored.

config.json:  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                      "weight_block_size": [Bn, Bk]}          (released: [128, 128])
tensors:      X.weight            float8_e4m3fn [..., N, K]
              X.weight_scale_inv  float32       [..., ceil(N / Bn), ceil(K / Bk)]
              W[n, k] = X.weight[n, k] * X.weight_scale_inv[n // Bn, k // Bk]

(`weight_scale_inv` is the factor that multiplies the stored values, as DeepSeek's `weight_dequant`
applies it.) The FP8 values are read from the file as they are, never re-quantized, and
dequantized here at load, on the CPU, into the engine's load dtype: the dense weights are what the
models build from (fusing, permuting) and what the CPU computes with. Each 2-D FP8 weight is also
kept as stored (`RawFP8Blocks`, in `Checkpoint.raw`): on a GPU with FP8 tensor cores the linear
factory (engine/layers/__init__.py) serves a linear from its blocks with the block-scaled kernel
(engine/layers/fp8_block_linear.py) when the blocks dequantize to exactly the weight the model asks
for (a fused projection: its parts joined; rows the model reordered within their N blocks, as
Llama 4's q/k, reordered alike); a weight the model transformed otherwise stays dense. The load
therefore needs the dense model's memory plus the FP8 bytes (DeepSeek-V3-671B: ~1.3 TB in bf16);
`--quantization fp8` re-quantizes per row the dense weights no block serves. Stacked expert tensors
(3-D) are served dense (or per row under `--quantization fp8`). Tensors without a scale (embeddings,
norms, routers, lm head: the released `modules_to_not_convert`) are stored dense and pass through.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.loader.checkpoint import UnsupportedCheckpointError
from engine.models.weights import CheckpointMismatchError

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class RawFP8Blocks:
    """One 2-D weight as the file stores it: wq [N, K] float8_e4m3fn, scale [ceil(N/Bn),
    ceil(K/Bk)] float32 (w = wq * scale per block), block (Bn, Bk)."""

    wq: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    ggml_type: ClassVar[None] = None  # no GGML block type: the GGUF q4 paths pass it by


def fp8_block_size(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """(Bn, Bk) of a block-scaled FP8 config.json, None when it has no FP8 quantization_config."""
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != "fp8":
        return None
    block = quantization.get("weight_block_size")
    if not block or len(block) != 2:
        raise UnsupportedCheckpointError(
            f"{config.get('model_type')}: quantization_config fp8 without weight_block_size "
            "(per-tensor scales) is not supported (only block-scaled FP8, as DeepSeek-V3 and "
            "Qwen3-FP8 ship)")
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedCheckpointError(
            f"{config.get('model_type')}: quantization_config fmt {quantization['fmt']!r} is not "
            "supported (only 'e4m3')")
    return int(block[0]), int(block[1])


def dequantize_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     name: str = "weight") -> torch.Tensor:
    """weight fp8 [..., N, K], scale_inv [..., ceil(N/Bn), ceil(K/Bk)] -> float32 [..., N, K]."""
    n, k = weight.shape[-2:]
    expected = (*weight.shape[:-2], -(-n // block[0]), -(-k // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointMismatchError(f"checkpoint tensor {name + SCALE_SUFFIX!r} has shape "
                                      f"{tuple(scale_inv.shape)}, expected {expected}")
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :n, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :k]  # [..., N, K]
    return weight.float() * scale


def dequantize_checkpoint(weights: dict[str, torch.Tensor], block: tuple[int, int],
                          dtype: torch.dtype) -> dict[str, RawFP8Blocks]:
    """Replace every `X.weight` + `X.weight_scale_inv` pair of `weights` by the dense X.weight in
    `dtype` (in place); -> the 2-D ones as stored, by name. A scale without its weight, or an FP8
    tensor without a scale, is one line."""
    raw: dict[str, RawFP8Blocks] = {}
    for scale_name in [n for n in weights if n.endswith(SCALE_SUFFIX)]:
        name = scale_name.removesuffix(SCALE_SUFFIX)
        scale_inv = weights.pop(scale_name)
        weight = weights.get(name)
        if weight is None:
            raise CheckpointMismatchError(f"checkpoint has {scale_name!r} but no tensor {name!r}")
        if weight.dtype not in FP8_DTYPES:
            raise CheckpointMismatchError(f"checkpoint tensor {name!r} is {weight.dtype}, but has "
                                          "a "
                                          f"block scale: expected {FP8_DTYPES[0]}")
        weights[name] = dequantize_block(weight, scale_inv, block, name).to(dtype)
        if weight.dim() == 2:
            raw[name] = RawFP8Blocks(weight, scale_inv.float(), block)
    unscaled = sorted(n for n, t in weights.items() if t.dtype in FP8_DTYPES)
    if unscaled:
        raise CheckpointMismatchError(f"checkpoint tensor {unscaled[0]!r} is FP8 but has no "
                                      f"{SCALE_SUFFIX.lstrip('_')} tensor")
    return raw
