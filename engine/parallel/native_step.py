"""The native steps of a tensor-parallel rank: engine/models/llama_decode.py's two steps on the
rank's shard, with the collectives between them.

    step = parallel_native_step(model, decode_weights, group)   # None: the rank keeps the general forward

`ParallelNativeStep` (the q4 mode: every linear a `NativeQuantLinear` on the rank's slice of the
GGUF's blocks, engine/parallel/gguf_slices.py), per layer:

    qkv = q_linear(hidden, W_qkv[rank's heads], rms_norm=input_norm)          (column parallel)
    attn = decode_attention(qkv, ..., the rank's H / G heads)                 (its kv heads' cache)
    hidden += all_reduce(q_linear(attn, W_o[:, rank's columns]))              (row parallel)
    gate_up = q_linear(hidden, W_gate_up[rank's rows], rms_norm=post_norm)
    hidden += all_reduce(q_linear(silu(gate) * up, W_down[:, rank's columns]))

after the vocab-parallel embedding's all-reduce; then the lm head on the rank's vocab rows and one
gather of the sampled rows' logits to rank 0. The same 2L + 1 all-reduces and one gather as the
general forward (engine/parallel/layers.py), in the same order on every rank, so ranks whose
weights are of one kind (gguf_slices.py makes sure) run the same step in lockstep.

Numerics against TP=1 in the same mode: the column-parallel projections and the attention compute
each output row / head exactly as one process does (the 8-bit activation blocks of the input are
the same 32 values); a row-parallel projection's rank sums its own blocks and the all-reduce adds
the ranks' partial sums, so the result differs from one process's sum in the last bits.

`ParallelFloatStep` (float32 weights): FloatDecodeStep's decode rows (the native attention reading
the cache blocks, oneDNN GEMMs) with the same collectives; prefill chunks take the general forward.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from engine.layers.linear import DenseLinear, OneDNNLinear
from engine.layers.native_linear import NativeQuantLinear
from engine.layers.norm import rms_norm_fast
from engine.models.llama import DecoderLayer
from engine.models.llama_decode import DecodeInputs, _norm_qk_heads, _plain_layers_of
from engine.parallel.group import TPGroup
from engine.parallel.layers import RowParallel, VocabParallelEmbedding, VocabParallelHead

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def parallel_native_step(model, decode_weights: str, group: TPGroup):  # type: ignore[no-untyped-def]
    """The rank's native step for `model` (a LlamaModel after engine/parallel/layers.parallelize),
    or None when its layers are not the plain Llama shape of that step."""
    view = _unwrapped(model)
    if view is None:
        return None
    if decode_weights == "q4":
        return ParallelNativeStep.build(view, group) or ParallelFloatStep.build(view, group)
    return ParallelFloatStep.build(view, group)


def _unwrapped(model) -> SimpleNamespace | None:  # type: ignore[no-untyped-def]
    """The rank's model with the cross-rank wrappers taken off (the steps call the collectives
    themselves), or None when a part is not wrapped the way parallelize wraps a Llama model."""
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


class _ParallelStep:
    def __init__(self, view: SimpleNamespace, group: TPGroup) -> None:
        self.model = view
        self.group = group

    def _gathered(self, local_logits: torch.Tensor) -> torch.Tensor:
        """The rank's [S, V / N] logits -> [S, V] on rank 0 (the padding rows cut), its own elsewhere."""
        logits = self.group.gather_last_dim(local_logits)
        return logits[:, :self.model.vocab_size] if self.group.is_first else logits


class ParallelNativeStep(_ParallelStep):
    kv_dtype = torch.float16  # as NativeDecodeStep
    runs_prefill = True

    @classmethod
    def build(cls, view: SimpleNamespace, group: TPGroup) -> ParallelNativeStep | None:
        if not isinstance(view.lm_head, NativeQuantLinear) or not _plain_layers_of(view, NativeQuantLinear):
            return None
        return cls(view, group)

    def __call__(self, step: DecodeInputs, kv_caches: KVCaches) -> torch.Tensor:
        """-> logits of `step.logit_rows` (every row when None): [S, V] on rank 0, [S, V / N] elsewhere."""
        model, cfg, group = self.model, self.model.config, self.group
        eps = cfg.rms_norm_eps
        cos, sin = model.rotary.cos, model.rotary.sin  # [P, Dh]
        hidden = model.embed(step.input_ids)  # [M, Hd], all-reduced
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            qkv = layer.qkv.native(hidden, layer.input_norm, eps)  # [M, (H_r + 2 G_r) * Dh]
            if cfg.qk_norm == "per_head":
                _norm_qk_heads(qkv, layer, cfg)
            attn = torch.ops.aigw_cpu.decode_attention(
                qkv, cos, sin, step.positions, k_cache, v_cache, step.slots, step.block_tables,
                step.context_lens, cfg.num_heads, cfg.num_kv_heads, model.scale)  # [M, H_r * Dh]
            hidden += group.all_reduce(layer.o_proj.native(attn))
            gate_up = layer.mlp.gate_up.native(hidden, layer.post_attention_norm, eps)  # [M, 2 I_r]
            hidden += group.all_reduce(layer.mlp.down.silu_mul_native(gate_up))
        if step.logit_rows is not None:
            if not len(step.logit_rows):  # no row samples (a prompt chunk): no gather on any rank
                width = model.vocab_size if group.is_first else model.embed.weight.shape[0]
                return hidden.new_empty((0, width))
            hidden = hidden.index_select(0, step.logit_rows)  # [S, Hd]
        return self._gathered(model.lm_head.native(hidden, model.norm, eps))


class ParallelFloatStep(_ParallelStep):
    kv_dtype = torch.float32  # as FloatDecodeStep
    runs_prefill = False

    @classmethod
    def build(cls, view: SimpleNamespace, group: TPGroup) -> ParallelFloatStep | None:
        return cls(view, group) if _plain_layers_of(view, (OneDNNLinear, DenseLinear)) else None

    def __call__(self, step: DecodeInputs, kv_caches: KVCaches) -> torch.Tensor:
        """-> logits [M, V] on rank 0, [M, V / N] elsewhere."""
        model, cfg, group = self.model, self.model.config, self.group
        eps = cfg.rms_norm_eps
        cos, sin = model.rotary.cos, model.rotary.sin  # [P, Dh]
        hidden = model.embed(step.input_ids)  # [M, Hd], all-reduced
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            qkv = layer.qkv(rms_norm_fast(hidden, layer.input_norm, eps))  # [M, (H_r + 2 G_r) * Dh]
            if cfg.qk_norm == "per_head":
                _norm_qk_heads(qkv, layer, cfg)
            attn = torch.ops.aigw_cpu.decode_attention(
                qkv, cos, sin, step.positions, k_cache, v_cache, step.slots, step.block_tables,
                step.context_lens, cfg.num_heads, cfg.num_kv_heads, model.scale)  # [M, H_r * Dh]
            hidden = hidden + group.all_reduce(layer.o_proj(attn))
            gate, up = layer.mlp.gate_up(rms_norm_fast(hidden, layer.post_attention_norm, eps)).chunk(2, dim=-1)
            hidden = hidden + group.all_reduce(layer.mlp.down(F.silu(gate) * up))
        return self._gathered(model.lm_head(rms_norm_fast(hidden, model.norm, eps)).float())
