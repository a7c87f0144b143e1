"""The native step of a tensor-parallel rank: engine/models/llama_decode.py's layer loop on the
rank's shard, with the rank's collectives as its world.

    step = parallel_native_step(model, decode_weights, group)   # None: the general forward

In the q4 mode (`ParallelNativeStep`: every linear a `NativeQuantLinear` on the rank's slice of the
GGUF's blocks, engine/parallel/gguf_slices.py), per layer:

    qkv = q_linear(hidden, W_qkv[rank's heads], rms_norm=input_norm)          (column parallel)
    attn = decode_attention(qkv, ..., the rank's H / G heads)                 (its kv heads' cache)
    hidden += all_reduce(q_linear(attn, W_o[:, rank's columns]))              (row parallel)
    gate_up = q_linear(hidden, W_gate_up[rank's rows], rms_norm=post_norm)
    hidden += all_reduce(q_linear(silu(gate) * up, W_down[:, rank's columns]))

after the vocab-parallel embedding's all-reduce; then the lm head on the rank's vocab rows and one
gather of the sampled rows' logits to rank 0. The same 2L + 1 all-reduces and one gather as the
general forward (engine/parallel/layers.py), in the same order on every rank, so ranks whose
weights are of one kind (gguf_slices.py makes sure) run the same step in lockstep. Float32 weights
(`ParallelFloatStep`): the float kernels' decode rows with the same collectives; prefill chunks take
the general forward. MoE layers keep the general forward on a rank.

Numerics against TP=1 in the same mode: the column-parallel projections and the attention compute
each output row / head exactly as one process does (the 8-bit activation blocks of the input are
the same 32 values); a row-parallel projection's rank sums its own blocks and the all-reduce adds
the ranks' partial sums, so the result differs from one process's sum in the last bits.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from engine.models.llama import DecoderLayer
from engine.models.llama_decode import NativeStep, native_step
from engine.parallel.group import TPGroup
from engine.parallel.layers import RowParallel, VocabParallelEmbedding, VocabParallelHead


def parallel_native_step(model, decode_weights: str, group: TPGroup  # type: ignore[no-untyped-def]
                         ) -> NativeStep | None:
    """The rank's native step for `model` (a LlamaModel after engine/parallel/layers.parallelize),
    or None when its layers are not the plain Llama shape of that step."""
    view = _unwrapped(model)
    if view is None:
        return None
    return native_step(view, decode_weights, RankWorld(group, view.vocab_size))


class RankWorld:
    """The collectives of a rank's step (engine/models/llama_decode.py's world)."""

    parallel = True

    def __init__(self, group: TPGroup, vocab_size: int) -> None:
        self.group = group
        self.vocab_size = vocab_size
        self.reduce = group.all_reduce  # in place

    def embed(self, view: SimpleNamespace, input_ids: torch.Tensor) -> torch.Tensor:
        return view.embed(input_ids)  # [M, hidden], all-reduced

    def logits_width(self, view: SimpleNamespace) -> int:
        return self.vocab_size if self.group.is_first else int(view.embed.weight.shape[0])

    def gathered(self, local_logits: torch.Tensor) -> torch.Tensor:
        """The rank's [S, V / N] logits -> [S, V] on rank 0 (the padding rows cut), its own
        elsewhere."""
        logits = self.group.gather_last_dim(local_logits)
        return logits[:, :self.vocab_size] if self.group.is_first else logits


def _unwrapped(model) -> SimpleNamespace | None:  # type: ignore[no-untyped-def]
    """The rank's model with the cross-rank wrappers taken off (the step calls the collectives
    itself), or None when a part is not wrapped the way parallelize wraps a Llama model."""
    if not (isinstance(getattr(model, "embed", None), VocabParallelEmbedding)
            and isinstance(getattr(model, "lm_head", None), VocabParallelHead)):
        return None
    layers = []
    for layer in getattr(model, "layers", ()):
        if not (isinstance(layer, DecoderLayer)  # (other families' layers: the general forward)
                and isinstance(layer.o_proj, RowParallel)  # (Gemma 3's layers have no `mlp`)
                and isinstance(getattr(layer, "mlp", None), RowParallel)):
            return None
        layers.append(dataclasses.replace(layer, o_proj=layer.o_proj.inner, mlp=layer.mlp.inner))
    return SimpleNamespace(config=model.config, embed=model.embed, embed_tokens=model.embed_tokens,
                           layers=layers, lm_head=model.lm_head.inner, rotary=model.rotary,
                           norm=model.norm, scale=model.scale, vocab_size=model.lm_head.vocab_size)
