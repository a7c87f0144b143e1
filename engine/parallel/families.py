"""Tensor-parallel rules of the families whose layers are not Llama's: Gemma 3, Llama 4, gpt-oss and
DeepSeek-V3, and OLMoE's q/k norm (the Llama family's rules, which these fall back to:
engine/parallel/shard.py). As vLLM splits them (its gemma3.py, llama4.py, gpt_oss.py,
deepseek_v2.py, olmoe.py):

    gemma3_text   as Llama: q/k/v and gate/up column parallel, o_proj and down row parallel; the
                  per-head q/k norms and all four layer norms replicated. Its norms after o_proj and
                  after down act on the summed output, so the all-reduces wrap o_proj and down (not
                  the whole MLP); the final soft-cap runs on rank 0's gathered logits.
    llama4_text   attention as Llama (the q/k rope-row permutation and the L2 q/k norm are per
                  head); MoE layers: router [E, Hd] replicated, experts gate_up_proj [E, Hd, 2I] ->
                  the rank's columns of both halves, down_proj [E, I, Hd] -> its rows, the shared
                  expert split as an MLP of I; dense layers: an MLP of intermediate_size_mlp, split
                  the same way. Routed and shared outputs are partial sums added before the layer's
                  one all-reduce.
    gpt_oss       the rank's heads' q/k/v rows and biases, and their sinks [H]; o_proj's bias
                  replicated and added after the all-reduce (the model adds it outside o_proj);
                  router replicated; experts split on I in whole 32-value MXFP4 blocks where I
                  allows (gate_up interleaved along 2I: the rank's rows [2 i0, 2 i1)); the
                  down-projection bias is added by rank 0 only (zeros elsewhere), so the
                  all-reduce adds it once.
    deepseek_v3   MLA: q_proj / q_b_proj rows and kv_b_proj rows of the rank's heads, o_proj its
                  columns; q_a_proj, kv_a_proj_with_mqa and their norms replicated, so every rank
                  computes, and caches, the whole latent (kv_lora_rank + rope dims) for its heads
                  (vLLM's MLA does the same); the router and e_score_correction_bias replicated,
                  routed experts and the shared experts split on their intermediate dims, the
                  first_k_dense_replace dense layers as an MLP. MTP-layer tensors are not read.
    olmoe         Llama's rules, with its q/k norm weights [Q], [K] cut to the rank's heads; the
                  norm's sums of squares are all-reduced ([T, 2] a layer:
                  engine/parallel/layers.py), so it still spans every head (refused where kv heads
                  would be replicated).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from engine.config import ModelConfig
from engine.parallel.plan import ShardPlan, TensorParallelConfigError, split_range

Ranges = list[range]
Slices = tuple[Ranges | None, ...]

MXFP4_BLOCK = 32  # values per MXFP4 scale (engine/layers/mxfp4.py)
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def check_splits(config: ModelConfig, world_size: int) -> None:
    """Refuse, in one line, a family model that does not split `world_size` ways."""
    if config.architecture == "deepseek_v3" and config.num_heads % world_size:
        raise TensorParallelConfigError(
            f"deepseek_v3: {config.num_heads} attention heads do not split across {world_size} "
            "ranks (the latent is replicated; the heads are split evenly)")


def expert_intermediate(config: ModelConfig, rank: int, world_size: int) -> range:
    """The rank's part of moe_intermediate_size: gpt-oss in whole MXFP4 blocks where there are at
    least as many blocks as ranks (gpt-oss-20b's 2880 = 90 blocks: 22 + 23 + 22 + 23 on 4 ranks)."""
    size = config.moe_intermediate_size
    if (config.architecture == "gpt_oss" and size % MXFP4_BLOCK == 0
        and size // MXFP4_BLOCK >= world_size):
        blocks = split_range(size // MXFP4_BLOCK, rank, world_size)
        return range(blocks.start * MXFP4_BLOCK, blocks.stop * MXFP4_BLOCK)
    return split_range(size, rank, world_size)


def llama4_mlp_intermediate(config: ModelConfig, plan: ShardPlan) -> range:
    """Llama 4's dense layers: the rank's part of intermediate_size_mlp."""
    assert config.llama4 is not None
    return split_range(config.llama4.intermediate_size_mlp, plan.rank, plan.world_size)


def local_changes(config: ModelConfig, plan: ShardPlan) -> dict[str, object]:
    """Family fields of the rank's ModelConfig (beyond the head, intermediate and vocab sizes)."""
    if config.architecture == "llama4_text" and config.llama4 is not None:
        size = len(llama4_mlp_intermediate(config, plan))
        return {"llama4": dataclasses.replace(config.llama4, intermediate_size_mlp=size)}
    return {}


def is_skipped(name: str, config: ModelConfig) -> bool:
    """A checkpoint tensor a rank does not read: DeepSeek's MTP layers (index >= num_layers)."""
    match = _LAYER_INDEX.match(name)
    return (config.architecture == "deepseek_v3" and match is not None
            and int(match[1]) >= config.num_layers)


def _rows(r: range, per: int) -> Ranges:
    return [range(r.start * per, r.stop * per)]


def layer_slices(leaf: str, shape: tuple[int, ...], config: ModelConfig, plan: ShardPlan
                 ) -> Slices | None:
    """What the rank keeps of layer tensor `leaf` (the name after "model.layers.{i}."); None: the
    Llama rules apply (engine/parallel/shard.py)."""
    arch = config.architecture
    whole: Slices = (None,) * len(shape)
    # [Q], [K]
    if arch == "olmoe" and leaf in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        heads = plan.q_heads if leaf.startswith("self_attn.q") else plan.kv_heads
        return (_rows(heads, config.head_dim),)
    if arch == "gemma3_text":
        if leaf in ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"):
            return whole
        return None
    if arch == "llama4_text":
        return _llama4(leaf, whole, config, plan)
    if arch == "gpt_oss":
        return _gpt_oss(leaf, whole, config, plan)
    if arch == "deepseek_v3":
        return _deepseek_v3(leaf, whole, config, plan)
    return None


def _llama4(leaf: str, whole: Slices, config: ModelConfig, plan: ShardPlan) -> Slices | None:
    if not leaf.startswith("feed_forward."):
        return None  # attention and norms: the Llama rules
    f = leaf.removeprefix("feed_forward.")
    r, inter = plan.expert_intermediate, config.moe_intermediate_size
    if f == "router.weight":
        return whole
    if f == "experts.gate_up_proj":  # [E, Hd, 2I]: gate columns, then up columns
        return (None, None, [r, range(inter + r.start, inter + r.stop)])
    if f == "experts.down_proj":  # [E, I, Hd]
        return (None, [r], None)
    rows = (plan.shared_intermediate if f.startswith("shared_expert.")
            else llama4_mlp_intermediate(config, plan))
    f = f.removeprefix("shared_expert.")
    if f in ("gate_proj.weight", "up_proj.weight"):
        return ([rows], None)
    if f == "down_proj.weight":
        return (None, [rows])
    return None


def _gpt_oss(leaf: str, whole: Slices, config: ModelConfig, plan: ShardPlan) -> Slices | None:
    r = plan.expert_intermediate
    pairs = [range(2 * r.start, 2 * r.stop)]  # gate and up interleaved along 2I: rows 2i, 2i + 1
    if leaf == "self_attn.sinks":
        return ([plan.q_heads],)
    if leaf in ("self_attn.o_proj.bias", "mlp.router.weight", "mlp.router.bias",
                "mlp.experts.down_proj_bias"):  # (down bias: zeros but on rank 0, see parallelize)
        return whole
    if leaf == "mlp.experts.gate_up_proj":  # [E, Hd, 2I]
        return (None, None, pairs)
    if leaf in ("mlp.experts.gate_up_proj_bias", "mlp.experts.gate_up_proj_blocks",
                # [E, 2I], [E, 2I, Hd / 32, 16], [E, 2I, Hd / 32]
                "mlp.experts.gate_up_proj_scales"):
        return (None, pairs, *whole[2:])
    if leaf == "mlp.experts.down_proj":  # [E, I, Hd]
        return (None, [r], None)
    # [E, Hd, I / 32, ...]
    if leaf in ("mlp.experts.down_proj_blocks", "mlp.experts.down_proj_scales"):
        if r.start % MXFP4_BLOCK or r.stop % MXFP4_BLOCK:
            raise TensorParallelConfigError(
                f"gpt_oss: MXFP4 experts split in whole blocks of {MXFP4_BLOCK}: intermediate_size "
                f"{config.moe_intermediate_size} across {plan.world_size} ranks gives rank "
                f"{plan.rank} [{r.start}, {r.stop})")
        return (None, None, [range(r.start // MXFP4_BLOCK, r.stop // MXFP4_BLOCK)], *whole[3:])
    return None


def _deepseek_v3(leaf: str, whole: Slices, config: ModelConfig, plan: ShardPlan) -> Slices | None:
    mla = config.mla
    assert mla is not None
    heads = plan.q_heads
    if leaf in ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
                "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
                "mlp.gate.e_score_correction_bias"):
        return whole
    if leaf in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):  # [H * (N + P), Lq or Hd]
        return (_rows(heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim), None)
    if leaf == "self_attn.kv_b_proj.weight":  # [H * (N + V), R]
        return (_rows(heads, mla.qk_nope_head_dim + mla.v_head_dim), None)
    if leaf == "self_attn.o_proj.weight":  # [Hd, H * V]
        return (None, _rows(heads, mla.v_head_dim))
    if leaf.startswith("mlp.shared_experts."):
        rows = [plan.shared_intermediate]
        return (None, rows) if leaf.endswith("down_proj.weight") else (rows, None)
    return None


def parallelize(model, plan: ShardPlan) -> None:  # type: ignore[no-untyped-def]
    """Family changes to a shard-built model before its layers are wrapped
    (engine/parallel/layers.py): gpt-oss's expert down-projection bias stays on rank 0 only."""
    if model.config.architecture == "gpt_oss" and plan.rank:
        for layer in model.layers:  # (GptOssExperts, or NativeExperts on the CPU q4 path)
            bias = layer.mlp.experts.w2_bias  # [E, Hd], added per routed expert
            if bias is not None:
                layer.mlp.experts.w2_bias = torch.zeros_like(bias)
