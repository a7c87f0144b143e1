"""A rank's tensors of a Llama / Qwen3 GGUF file, read as slices of the memory-mapped file.

Quantized blocks run along a row (the input dim), so a rank's rows are whole rows of blocks and its
columns a run of whole blocks when the cut falls on a block boundary (SmolLM2's 576 / 1536 columns
cut at 192 / 384 / 768: all multiples of 32). Only those bytes are read and dequantized; a cut
inside a block dequantizes the rank's rows whole, then cuts. llama's q/k rows are stored in GGML's
RoPE order (engine/loader/gguf_checkpoint.py): the rank's Hugging Face rows are picked through the
same permutation. Stacked experts (qwen3moe's ffn_*_exps) are dequantized whole and then cut.

`raw` (the q4 mode): the rank's quantized blocks of each 2-D weight as well, `RawQuantized` of the
slice (the embedding's padded rows are zero bytes: zero weights in Q4_0 / Q4_1 / Q8_0), so the rank
runs the native kernels on them (engine/layers/native_linear.py). A weight gets blocks on no rank
unless every rank's cut of it is whole blocks and a multiple of 8 rows (the kernels' row groups):
the ranks then build the same kinds of layers and agree on the step they run
(engine/parallel/native_step.py); such a weight is served as a float checkpoint's is (said once in
the log), and start-up checks that the ranks still agree (engine/parallel/rank.py::step_kind).
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import torch

from chat.gguf_metadata import GGUFTensorInfo, read_gguf_header
from engine.config import ModelConfig
from engine.loader.checkpoint import RawQuantized
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
ROW_GROUP = 8  # the native kernels interleave 8 output rows (engine/layers/native_linear.py)

logger = logging.getLogger(__name__)


def gguf_architecture(path: Path) -> object:
    return read_gguf_header(path)[0].get("general.architecture")


def load_gguf_slices(path: Path, rank: int, world_size: int, dtype: torch.dtype,
                     raw: dict[str, RawQuantized] | None = None
                     ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The rank's float tensors; with `raw` given, also fills it with the rank's quantized blocks
    of every 2-D weight whose cut is block-aligned on every rank (module doc)."""
    metadata, infos = read_gguf_header(path)
    config = model_config_from_gguf(metadata, {t.name for t in infos}, path.stem)
    plan = plan_shard(config, rank, world_size)
    plans = [plan_shard(config, r, world_size) for r in range(world_size)]
    unaligned: list[str] = []
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
        values, blocks = _read(view, tuple(info.shape), ggml_type, name, config, plan, order)
        weights[name] = pad_vocab(name, values.to(dtype), plan).contiguous()
        if raw is None or ggml_type in _FLOAT_TYPES or len(info.shape) != 2:
            continue
        if blocks is None or not _cut_in_blocks(name, tuple(info.shape), ggml_type, config, plans):
            unaligned.append(info.name)
            continue
        rows = weights[name].shape[0]  # the vocab shard's padding rows: zero bytes, zero weights
        blocks = np.concatenate([blocks,
                                 np.zeros((rows - blocks.shape[0], blocks.shape[1]), np.uint8)])
        raw[name] = RawQuantized(ggml_type=ggml_type.name, shape=tuple(weights[name].shape),
                                 data=blocks)
    if unaligned:
        logger.warning("tensor-parallel rank %d/%d: %d quantized weights (%s) do not split into "
                       "whole quantization blocks and groups of %d rows on every rank: the file's "
                       "blocks are not used for them (served as a float checkpoint's weights)",
                       rank, world_size, len(unaligned),
                       ", ".join(unaligned[:4]) + (", ..." if len(unaligned) > 4 else ""),
                       ROW_GROUP)
    if stacked:
        _fuse_stacked_experts(stacked)
        for name, tensor in stacked.items():
            weights[name] = take_slices(tensor, tensor_slices(name, tuple(tensor.shape), config,
                                                              plan)).to(dtype).contiguous()
    return config, weights


def _tensor_view(file_bytes: np.ndarray, info: GGUFTensorInfo, ggml_type: gguf.GGMLQuantizationType
                 ) -> np.ndarray:
    """The tensor in the mapped file (no read yet): elements for float types, [rows, row bytes]
    else."""
    element_type = _NUMPY_ELEMENT_TYPES.get(ggml_type)
    if element_type is not None:
        count = int(np.prod(info.shape)) * np.dtype(element_type).itemsize
        return (file_bytes[info.data_offset:info.data_offset + count].view(element_type)
                .reshape(info.shape))
    byte_shape = gguf.quant_shape_to_byte_shape(info.shape, ggml_type)
    return (file_bytes[info.data_offset:info.data_offset + int(np.prod(byte_shape))]
            .reshape(byte_shape))


def _rows(ranges: Ranges | None, num_rows: int, order: np.ndarray | None) -> np.ndarray:
    rows = (np.arange(num_rows) if ranges is None
            else np.concatenate([np.arange(r.start, r.stop) for r in ranges]))
    return order[rows] if order is not None else rows


_WHOLE_ARRAY_TYPES = {gguf.GGMLQuantizationType.Q4_0: gguf.quants.Q4_0,
                      gguf.GGMLQuantizationType.Q4_1:
                      gguf.quants.Q4_1, gguf.GGMLQuantizationType.Q8_0: gguf.quants.Q8_0}


def _dequantize(rows: np.ndarray, ggml_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """gguf's dequantization of [rows, row bytes]; Q4_0 / Q4_1 / Q8_0 as one array (the same
    element-wise arithmetic, ~3x faster than gguf's loop over groups of rows)."""
    kind = _WHOLE_ARRAY_TYPES.get(ggml_type)
    if kind is None or rows.ndim != 2:
        return gguf.quants.dequantize(rows, ggml_type)
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    values = kind.dequantize_blocks(rows.reshape(-1, block_bytes))
    return values.reshape(rows.shape[0], rows.shape[1] // block_bytes * block_elements)


def _cut_in_blocks(name: str, shape: tuple[int, ...], ggml_type: gguf.GGMLQuantizationType,
                   config: ModelConfig, plans: list[ShardPlan]) -> bool:
    """Every rank's slice of `name` is whole quantization blocks of columns and whole row groups."""
    block_elements = gguf.GGML_QUANT_SIZES[ggml_type][0]
    for plan in plans:
        rows, cols = tensor_slices(name, shape, config, plan)
        num_rows = shape[0] if rows is None else sum(len(r) for r in rows)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            num_rows = plan.num_local_vocab
        if num_rows % ROW_GROUP or any(r.start % block_elements or r.stop % block_elements
                                       for r in cols or []):
            return False
    return True


def _read(view: np.ndarray, shape: tuple[int, ...], ggml_type: gguf.GGMLQuantizationType, name: str,
          config: ModelConfig, plan: ShardPlan, order: np.ndarray | None
          ) -> tuple[torch.Tensor, np.ndarray | None]:
    """The rank's part of one 1-D / 2-D tensor, reading only its rows (and block-aligned columns);
    -> (float values, the slice's quantized blocks [rows, bytes] when it is whole blocks, else
    None)."""
    slices = tensor_slices(name, shape, config, plan)
    if len(shape) == 1:
        values = gguf.quants.dequantize(np.array(view), ggml_type)
        return take_slices(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)),
                           slices), None
    rows = view[_rows(slices[0], shape[0], order)]  # fancy index: reads those rows only
    cols = slices[1]
    if cols is not None and ggml_type in _FLOAT_TYPES:
        rows, cols = np.concatenate([rows[:, r.start:r.stop] for r in cols], axis=1), None
    elif cols is not None:
        block_elements, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        if all(r.start % block_elements == 0 and r.stop % block_elements == 0 for r in cols):
            rows = np.concatenate([rows[:, r.start // block_elements * block_bytes:
                                        r.stop // block_elements * block_bytes] for r in cols],
                                  axis=1)
            cols = None
    rows = np.ascontiguousarray(rows)
    values = torch.from_numpy(np.ascontiguousarray(_dequantize(rows, ggml_type), dtype=np.float32))
    blocks = rows if ggml_type not in _FLOAT_TYPES and cols is None else None
    return take_slices(values, (None, cols)), blocks
