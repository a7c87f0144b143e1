"""Block-scaled FP8 test checkpoints (quantization_config quant_method "fp8" + weight_block_size,
as DeepSeek-V3 and Qwen3-FP8 ship them) made from a tiny dense one, each beside its dequantized
twin: the blocks and their `weight_scale_inv` come from the test's own arithmetic, not the
engine's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BLOCK = (16, 16)  # the released files use [128, 128]; 16 gives the tiny models partial blocks too
FP8 = torch.float8_e4m3fn


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (fp8 [N, K], scale_inv float32 [ceil(N/Bn), ceil(K/Bk)]) by block amax."""
    n, k = weight.shape
    rows, cols = -(-n // BLOCK[0]), -(-k // BLOCK[1])
    padded = torch.zeros(rows * BLOCK[0], cols * BLOCK[1])
    padded[:n, :k] = weight
    blocks = padded.view(rows, BLOCK[0], cols, BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(FP8).max  # [rows, cols]
    quantized = (blocks / scale[:, None, :, None]).view(rows * BLOCK[0], cols * BLOCK[1])
    return quantized[:n, :k].to(FP8), scale.float()


def dequantize_by_hand(quantized: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(quantized.shape[0]) // BLOCK[0]
    cols = torch.arange(quantized.shape[1]) // BLOCK[1]
    return quantized.float() * scale_inv[rows[:, None], cols[None, :]]


def write_fp8_checkpoint(source: Path, root: Path,
                         quantizes: Callable[[str, torch.Tensor], bool]) -> tuple[Path, Path]:
    """(root/"fp8", root/"twin"): copies of the checkpoint in `source` in which every tensor that
    `quantizes(name, tensor)` picks is stored as FP8 blocks + `<name>_scale_inv` (and the config
    says so), and, in the twin, as those blocks dequantized to float32; the rest as they were."""
    fp8_dir, twin_dir = root / "fp8", root / "twin"
    shutil.copytree(source, fp8_dir)
    shutil.copytree(source, twin_dir)
    tensors = load_file(str(source / "model.safetensors"))
    stored, twin = dict(tensors), dict(tensors)
    for name in [n for n, t in tensors.items() if quantizes(n, t)]:
        quantized, scale_inv = quantize_blocks(tensors[name])
        stored[name], stored[name + "_scale_inv"] = quantized, scale_inv
        twin[name] = dequantize_by_hand(quantized, scale_inv)
    save_file(stored, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, twin_dir
