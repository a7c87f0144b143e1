"""A rank's slice of each checkpoint tensor, by Hugging Face name (the rules:
engine/parallel/plan.py).

    slices = tensor_slices(name, shape, config, plan)   # per dim: a list of index ranges, or None
    weights = shard_weights(full_weights, config, plan)  # the rank's tensors, same names

`tensor_slices` is the one table of what a rank reads; `shard_weights` applies it to tensors in
memory and the safetensors loader to the file (engine/parallel/loading.py), so a rank reads only
its rows and columns.
"""

from __future__ import annotations

import re

import torch

from engine.config import ModelConfig
from engine.parallel.families import is_skipped, layer_slices
from engine.parallel.plan import ShardPlan, TensorParallelConfigError

Ranges = list[range]  # the indices of one dim the rank keeps (concatenated in order)
Slices = tuple[Ranges | None, ...]  # per dim; None: the whole dim

_LAYER = re.compile(r"model\.layers\.\d+\.(.+)")
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.\d+\.(\w+)\.weight")
_REPLICATED = ("input_layernorm.weight", "post_attention_layernorm.weight",
               "self_attn.q_norm.weight",
               "self_attn.k_norm.weight", "mlp.gate.weight", "block_sparse_moe.gate.weight",
               "mlp.shared_expert_gate.weight")


def _scaled(heads: range, head_dim: int) -> Ranges:
    return [range(heads.start * head_dim, heads.stop * head_dim)]


def tensor_slices(name: str, shape: tuple[int, ...], config: ModelConfig,
                  plan: ShardPlan) -> Slices:
    """What rank `plan.rank` keeps of tensor `name` of `shape` (all dims None: replicated)."""
    dh = config.head_dim
    whole: Slices = (None,) * len(shape)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return ([range(plan.vocab_start, plan.vocab_start + plan.num_real_vocab)], None)
    if name == "model.norm.weight" or name.endswith("rotary_emb.inv_freq"):
        return whole
    match = _LAYER.fullmatch(name)
    if match is None:
        raise TensorParallelConfigError(f"no tensor-parallel rule for checkpoint tensor {name!r}")
    leaf = match.group(1)
    family = layer_slices(leaf, shape, config, plan)  # Gemma 3, Llama 4, gpt-oss, DeepSeek-V3
    if family is not None:
        return family
    if leaf in _REPLICATED:
        return whole
    if leaf in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
        return (_scaled(plan.q_heads, dh), *whole[1:])
    if leaf in ("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                "self_attn.v_proj.weight", "self_attn.v_proj.bias"):
        return (_scaled(plan.kv_heads, dh), *whole[1:])
    if leaf == "self_attn.o_proj.weight":
        return (None, _scaled(plan.q_heads, dh))
    if leaf == "self_attn.o_proj.bias":
        raise TensorParallelConfigError("an o_proj bias is not split across ranks")
    inter = plan.intermediate
    expert = _EXPERT.fullmatch(leaf)
    if expert is not None:  # one expert's gate / up / down (w1 / w3 / w2)
        rows = [plan.expert_intermediate]
        return (None, rows) if expert.group(1) in ("down_proj", "w2") else (rows, None)
    if leaf == "mlp.experts.gate_up_proj":  # [E, 2 I_e, Hd]: the rank's rows of both halves
        full, r = config.moe_intermediate_size, plan.expert_intermediate
        return (None, [r, range(full + r.start, full + r.stop)], None)
    if leaf == "mlp.experts.down_proj":  # [E, Hd, I_e]
        return (None, None, [plan.expert_intermediate])
    if leaf.startswith("mlp.shared_expert."):
        inter = plan.shared_intermediate
        leaf = "mlp." + leaf.removeprefix("mlp.shared_expert.")
    if leaf in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return ([inter], None)
    if leaf == "mlp.down_proj.weight":
        return (None, [inter])
    raise TensorParallelConfigError(f"no tensor-parallel rule for checkpoint tensor {name!r}")


def take_slices(tensor: torch.Tensor, slices: Slices) -> torch.Tensor:
    """The kept part of an in-memory tensor (a copy when anything is cut)."""
    for dim, ranges in enumerate(slices):
        if ranges is not None:
            tensor = torch.cat([tensor.narrow(dim, r.start, len(r)) for r in ranges], dim=dim)
    return tensor


def pad_vocab(name: str, tensor: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """Embedding / lm-head rows padded with zeros to the shard's ceil(V / N) rows."""
    if name not in ("model.embed_tokens.weight", "lm_head.weight"):
        return tensor
    missing = plan.num_local_vocab - tensor.shape[0]
    if missing <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((missing, *tensor.shape[1:]))])


def shard_weights(weights: dict[str, torch.Tensor], config: ModelConfig, plan: ShardPlan
                  ) -> dict[str, torch.Tensor]:
    """The rank's tensors of a fully loaded checkpoint (every name kept, each cut to its slice)."""
    out = {}
    for name, tensor in weights.items():
        if is_skipped(name, config):
            continue
        out[name] = pad_vocab(name, take_slices(tensor, tensor_slices(name, tuple(tensor.shape),
                                                                      config, plan)),
                              plan).contiguous()
    return out
