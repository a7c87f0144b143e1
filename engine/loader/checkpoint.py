"""A loaded checkpoint: architecture config, float weights under Hugging Face names, and raw
quantized blocks for the weights a GGUF file stores quantized.

    load_checkpoint(path)      GGUF file      -> gguf_checkpoint.py
                               HF directory   -> hf_checkpoint.py (config.json + *.safetensors)

Weight names are always Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, ...) and
every 2-D weight is `[out_features, in_features]`; q/k rows are in Hugging Face's rotate_half
RoPE layout whatever the source.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig


class UnsupportedCheckpointError(NotImplementedError, ValueError):
    """A checkpoint of an architecture or a setting the engine does not serve (one line naming it).

    A ValueError too, so that the CLI reports it as one line before serving, as it does a bad flag.
    """


@dataclass(frozen=True)
class RawQuantized:
    """One quantized weight as stored in a GGUF file, rows in Hugging Face order.

    `data[r]` holds the GGML blocks (e.g. Q4_1: 20 bytes per 32 inputs) of output row `r`, so
    `data.shape == (shape[0], bytes_per_row)`; `gguf.quants.dequantize(data, type)` gives the
    float weight of `Checkpoint.weights` (before any dtype cast).
    """

    ggml_type: str  # gguf.GGMLQuantizationType name: "Q4_1", "Q8_0", ...
    shape: tuple[int, int]  # [out_features, in_features]
    data: np.ndarray  # uint8 [out_features, bytes_per_row]


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    # HF weight name -> quantized blocks: GGUF's (RawQuantized), or a block-scaled FP8 file's
    # weights as stored (fp8_blocks.RawFP8Blocks); empty for other safetensors
    raw: dict[str, RawQuantized]


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32,
                    progress: bool = True) -> Checkpoint:
    """Read a GGUF file or a Hugging Face directory; weights are cast to `dtype` on CPU."""
    from chat.gguf_metadata import is_gguf_file

    path = Path(path)
    if is_gguf_file(path):
        from engine.loader.gguf_checkpoint import load_gguf_checkpoint
        return load_gguf_checkpoint(path, dtype=dtype, progress=progress)
    if path.is_dir() and (path / "config.json").is_file():
        from engine.loader.hf_checkpoint import load_hf_checkpoint
        return load_hf_checkpoint(path, dtype=dtype, progress=progress)
    raise FileNotFoundError(f"{path} is neither a GGUF file nor a directory with config.json")
