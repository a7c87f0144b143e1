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
from engine.parallel.shard import Slices, pad_vocab, shard_weights, take_slices, tensor_slices


def load_rank_weights(path: str | Path, rank: int, world_size: int,
                      dtype: torch.dtype = torch.float32,
                      progress: bool = False, raw: dict | None = None  # type: ignore[type-arg]
                      ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`raw` (the q4 mode): filled with the rank's quantized blocks where the format has them
    (a sliced GGUF: engine/parallel/gguf_slices.py); elsewhere it stays empty (float weights)."""
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
            return load_gguf_slices(path, rank, world_size, dtype, raw)
    checkpoint = load_checkpoint(path, dtype=dtype, progress=progress)
    plan = plan_shard(checkpoint.config, rank, world_size)
    return checkpoint.config, shard_weights(dict(checkpoint.weights), checkpoint.config, plan)


def _load_safetensors_slices(directory: Path, rank: int, world_size: int, dtype: torch.dtype,
                             progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    from engine.loader.fp8_blocks import SCALE_SUFFIX, fp8_block_size
    from engine.loader.hf_checkpoint import _read_json, _tensor_renamer, model_config_from_hf
    from engine.parallel.families import is_skipped

    config = model_config_from_hf(directory)
    plan = plan_shard(config, rank, world_size)
    raw_config = _read_json(directory / "config.json")
    # llama4's multimodal files: language_model.* -> the text model's
    rename = _tensor_renamer(raw_config)
    fp8_block = fp8_block_size(raw_config)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors files")
    scale_files = {}  # block scale name -> its file (a sharded checkpoint may put it elsewhere)
    if fp8_block is not None:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                scale_files.update((n, file) for n in f.keys() if n.endswith(SCALE_SUFFIX))  # noqa: SIM118
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for stored_name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                name = rename(stored_name)
                if name is None or is_skipped(name, config) or (
                        fp8_block is not None and name.endswith(SCALE_SUFFIX)):
                    continue  # (a block scale is read with its weight)
                part = f.get_slice(stored_name)
                shape = tuple(part.get_shape())
                slices = tensor_slices(name, shape, config, plan)
                if stored_name + SCALE_SUFFIX in scale_files:
                    tensor = _fp8_slices(f.get_tensor(stored_name),
                                         scale_files[stored_name + SCALE_SUFFIX],
                                         stored_name, fp8_block, slices)  # type: ignore[arg-type]
                else:
                    tensor = _read_slices(part, shape, slices)
                if fp8_block is not None and tensor.dtype == torch.float8_e4m3fn:
                    raise ValueError(f"checkpoint tensor {stored_name!r} is FP8 but has no "
                                     f"{SCALE_SUFFIX.lstrip('_')} tensor")
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                weights[name] = pad_vocab(name, tensor, plan).contiguous()
    return config, weights


def _fp8_slices(weight: torch.Tensor, scale_file: Path, name: str, block: tuple[int, int],
                slices: Slices) -> torch.Tensor:
    """A block-scaled FP8 weight (DeepSeek-V3's files), read whole: dequantized to float32 with its
    scale (engine/loader/fp8_blocks.py), then cut (one dense tensor at a time in memory)."""
    from safetensors import safe_open

    from engine.loader.fp8_blocks import SCALE_SUFFIX, dequantize_block

    with safe_open(str(scale_file), framework="pt") as f:
        scale_inv = f.get_tensor(name + SCALE_SUFFIX)
    return take_slices(dequantize_block(weight, scale_inv, block, name), slices)


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
