"""A rank's tensors of a checkpoint, read as slices where the format allows.

    full_config, weights = load_rank_weights(path, rank, world_size)

Hugging Face safetensors: each tensor is read through `safe_open(...).get_slice`, only the rank's
rows / columns (engine/parallel/shard.py::tensor_slices), so a rank's memory holds its shard only.
GGUF (llama, qwen3, qwen3moe): the rank's rows and block-aligned columns of the memory-mapped file,
dequantized alone (engine/parallel/gguf_slices.py); other GGUF architectures are not split (the
plan refuses them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.parallel.plan import plan_shard
from engine.parallel.shard import Slices, pad_vocab, shard_weights, tensor_slices


def load_rank_weights(path: str | Path, rank: int, world_size: int, dtype: torch.dtype = torch.float32,
                      progress: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from chat.gguf_metadata import is_gguf_file
    from engine.loader import load_checkpoint

    path = Path(path)
    if not is_gguf_file(path) and path.is_dir() and (path / "config.json").is_file():
        return _load_safetensors_slices(path, rank, world_size, dtype, progress)
    if is_gguf_file(path):
        from engine.parallel.gguf_slices import (
            SLICED_ARCHITECTURES,
            gguf_architecture,
            load_gguf_slices,
        )

        if gguf_architecture(path) in SLICED_ARCHITECTURES:
            return load_gguf_slices(path, rank, world_size, dtype)
    checkpoint = load_checkpoint(path, dtype=dtype, progress=progress)
    plan = plan_shard(checkpoint.config, rank, world_size)
    return checkpoint.config, shard_weights(dict(checkpoint.weights), checkpoint.config, plan)


def _load_safetensors_slices(directory: Path, rank: int, world_size: int, dtype: torch.dtype,
                             progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    from engine.loader.hf_checkpoint import model_config_from_hf

    config = model_config_from_hf(directory)
    plan = plan_shard(config, rank, world_size)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                part = f.get_slice(name)
                shape = tuple(part.get_shape())
                tensor = _read_slices(part, shape, tensor_slices(name, shape, config, plan))
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                weights[name] = pad_vocab(name, tensor, plan).contiguous()
    return config, weights


def _read_slices(part, shape: tuple[int, ...], slices: Slices) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Read the kept ranges of a safetensors slice: one read per range of the one cut dim (the
    rules cut at most one dim of a tensor)."""
    cut = [d for d, ranges in enumerate(slices) if ranges is not None]
    if not cut:
        return part[tuple(slice(None) for _ in shape)] if shape else part[()]
    dim = cut[0]
    pieces = []
    for r in slices[dim] or []:
        index = [slice(None)] * len(shape)
        index[dim] = slice(r.start, r.stop)
        pieces.append(part[tuple(index)])
    return torch.cat(pieces, dim=dim)
