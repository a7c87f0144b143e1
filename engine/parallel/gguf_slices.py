"""A rank's tensors of a Llama / Qwen3 GGUF file, read as slices of the memory-mapped file.

Quantized blocks run along a row (the input dim), so a rank's rows are whole rows of blocks and its
columns a run of whole blocks when the cut falls on a block boundary (SmolLM2's 576 / 1536 columns
cut at 192 / 384 / 768: all multiples of 32). Only those bytes are read and dequantized; a cut
inside a block dequantizes the rank's rows whole, then cuts. llama's q/k rows are stored in GGML's
RoPE order (engine/loader/gguf_checkpoint.py): the rank's Hugging Face rows are picked through the
same permutation. Stacked experts (qwen3moe's ffn_*_exps) are dequantized whole and then cut.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from chat.gguf_metadata import GGUFTensorInfo, read_gguf_header
from engine.config import ModelConfig
from engine.loader.gguf_checkpoint import (
    _FLOAT_TYPES,
    _NUMPY_ELEMENT_TYPES,
    _SKIPPED_TENSORS,
    _fuse_stacked_experts,
    hf_tensor_name,
    model_config_from_gguf,
    unpermute_rope_rows,
)
from engine.parallel.plan import ShardPlan, plan_shard
from engine.parallel.shard import Ranges, pad_vocab, take_slices, tensor_slices

SLICED_ARCHITECTURES = ("llama", "qwen3", "qwen3moe")  # general.architecture values read here


def gguf_architecture(path: Path) -> object:
    return read_gguf_header(path)[0].get("general.architecture")


def load_gguf_slices(path: Path, rank: int, world_size: int, dtype: torch.dtype
                     ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    metadata, infos = read_gguf_header(path)
    config = model_config_from_gguf(metadata, {t.name for t in infos}, path.stem)
    plan = plan_shard(config, rank, world_size)
    rope_heads = ({"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
                  if config.architecture == "llama" else {})
    file_bytes = np.memmap(path, dtype=np.uint8, mode="r")
    weights: dict[str, torch.Tensor] = {}
    stacked: dict[str, torch.Tensor] = {}
    for info in infos:
        if info.name in _SKIPPED_TENSORS:
            continue
        name = hf_tensor_name(info.name)
        ggml_type = gguf.GGMLQuantizationType(info.ggml_type)
        view = _tensor_view(file_bytes, info, ggml_type)
        if len(info.shape) == 3:  # stacked experts: fused and cut after the loop
            stacked[name] = torch.from_numpy(np.ascontiguousarray(
                gguf.quants.dequantize(np.array(view), ggml_type), dtype=np.float32))
            continue
        module = info.name.split(".")[2] if info.name.startswith("blk.") else ""
        order = None
        if module in rope_heads:  # Hugging Face row j is stored at row order[j]
            order = unpermute_rope_rows(np.arange(info.shape[0]), rope_heads[module])
        values = _read(view, tuple(info.shape), ggml_type, name, config, plan, order)
        weights[name] = pad_vocab(name, values.to(dtype), plan).contiguous()
    if stacked:
        _fuse_stacked_experts(stacked)
        for name, tensor in stacked.items():
            weights[name] = take_slices(tensor, tensor_slices(name, tuple(tensor.shape), config,
                                                              plan)).to(dtype).contiguous()
    return config, weights


def _tensor_view(file_bytes: np.ndarray, info: GGUFTensorInfo, ggml_type: gguf.GGMLQuantizationType
                 ) -> np.ndarray:
    """The tensor in the mapped file (no read yet): elements for float types, [rows, row bytes] else."""
    element_type = _NUMPY_ELEMENT_TYPES.get(ggml_type)
    if element_type is not None:
        count = int(np.prod(info.shape)) * np.dtype(element_type).itemsize
        return file_bytes[info.data_offset:info.data_offset + count].view(element_type).reshape(info.shape)
    byte_shape = gguf.quant_shape_to_byte_shape(info.shape, ggml_type)
    return file_bytes[info.data_offset:info.data_offset + int(np.prod(byte_shape))].reshape(byte_shape)


def _rows(ranges: Ranges | None, num_rows: int, order: np.ndarray | None) -> np.ndarray:
    rows = (np.arange(num_rows) if ranges is None
            else np.concatenate([np.arange(r.start, r.stop) for r in ranges]))
    return order[rows] if order is not None else rows


def _read(view: np.ndarray, shape: tuple[int, ...], ggml_type: gguf.GGMLQuantizationType, name: str,
          config: ModelConfig, plan: ShardPlan, order: np.ndarray | None) -> torch.Tensor:
    """The rank's part of one 1-D / 2-D tensor, reading only its rows (and block-aligned columns)."""
    slices = tensor_slices(name, shape, config, plan)
    if len(shape) == 1:
        values = gguf.quants.dequantize(np.array(view), ggml_type)
        return take_slices(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)), slices)
    rows = view[_rows(slices[0], shape[0], order)]  # fancy index: reads those rows only
    cols = slices[1]
    if cols is not None and ggml_type in _FLOAT_TYPES:
        rows, cols = np.concatenate([rows[:, r.start:r.stop] for r in cols], axis=1), None
    elif cols is not None:
        block_elements, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        if all(r.start % block_elements == 0 and r.stop % block_elements == 0 for r in cols):
            rows = np.concatenate([rows[:, r.start // block_elements * block_bytes:
                                        r.stop // block_elements * block_bytes] for r in cols], axis=1)
            cols = None
    values = torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(np.ascontiguousarray(rows), ggml_type), dtype=np.float32))
    return take_slices(values, (None, cols))
