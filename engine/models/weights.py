"""Taking a model's tensors out of a checkpoint (HF name -> tensor), with one-line errors.

Models pop every tensor they use with `take` (or `take_optional`), stating the shape the config
implies; `check_all_used` then refuses a checkpoint that still holds tensors no layer read. So a
checkpoint that does not fit its config.json fails at load, before serving, with one line naming
the tensor, instead of a KeyError or a matmul shape error in the first request:

    checkpoint tensor 'model.layers.3.self_attn.q_norm.weight' has shape (64,), expected (16,)
    checkpoint has no tensor 'model.layers.1.mlp.experts.7.up_proj.weight' (qwen3_moe layer 1)
    checkpoint tensors no qwen3 layer uses: 'model.layers.0.self_attn.o_proj.bias' (and 1 more)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Weights = dict[str, torch.Tensor]

# Buffers some older checkpoints carry that the engine recomputes from the config.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not fit the architecture its config describes."""


def take(weights: Weights, name: str, shape: Sequence[int] | None, what: str = "") -> torch.Tensor:
    """Pop `name`; raise CheckpointMismatchError when it is missing or not of `shape` (None:
    any)."""
    tensor = weights.pop(name, None)
    if tensor is None:
        where = f" ({what})" if what else ""
        raise CheckpointMismatchError(f"checkpoint has no tensor {name!r}{where}")
    _check_shape(name, tensor, shape)
    return tensor


def take_optional(weights: Weights, name: str, shape: Sequence[int] | None) -> torch.Tensor | None:
    """Pop `name` if present (shape-checked like `take`), else None."""
    tensor = weights.pop(name, None)
    if tensor is not None:
        _check_shape(name, tensor, shape)
    return tensor


def check_all_used(weights: Weights, architecture: str) -> None:
    """Raise when `weights` (what the model left after taking its own) holds anything but buffers
    the engine derives itself."""
    unused = sorted(n for n in weights if not n.endswith(_DERIVED_SUFFIXES))
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise CheckpointMismatchError(
            f"checkpoint tensors no {architecture} layer uses: {unused[0]!r}{more}")


def _check_shape(name: str, tensor: torch.Tensor, shape: Sequence[int] | None) -> None:
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise CheckpointMismatchError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
