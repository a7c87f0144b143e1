"""Which slice of every weight a tensor-parallel rank holds, and the rank's own model config.

Dimension legend: V vocab, Hd hidden, H query heads, G kv heads, Dh head_dim, I intermediate size,
E experts, I_e an expert's intermediate size; N ranks, r this rank.

    attention   rank r holds whole kv groups: kv heads [g0, g1) and their query heads (H / G each);
                G >= N: the G heads split as evenly as they go (3 heads on 2 ranks: 1 + 2);
                G < N (N a multiple of G): every kv head is replicated on N / G ranks, each holding
                H / N of its query heads (vLLM's rule)
    q/k/v_proj  rows of the rank's heads (column parallel: no collective)
    o_proj      the same heads' input columns (row parallel: one all-reduce of [T, Hd])
    gate/up     rows [i0, i1) of I (column parallel)
    down_proj   columns [i0, i1) (row parallel: one all-reduce)
    experts     w13 [E, 2 I_e, Hd] -> the rows of [i0, i1) in both halves, w2 [E, Hd, I_e] -> its
                columns; the router [E, Hd] replicated (every rank routes the same way)
    embedding   rows [v0, v0 + V / N) padded to ceil(V / N) (vocab parallel: masked lookup, one
                all-reduce); the lm head the same rows (logits gathered to rank 0)
    norms       replicated

The rank's ModelConfig states its local sizes (num_heads, num_kv_heads, intermediate_size,
moe_intermediate_size, vocab_size), so the ordinary model code builds the shard unchanged and the
KV cache of the rank holds only its kv heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import ModelConfig

_TP_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm",
                               "mixtral", "qwen2_moe", "qwen3_moe",
                               # (families.py)
                               "olmoe", "gemma3_text", "llama4_text", "gpt_oss", "deepseek_v3"})


class TensorParallelConfigError(ValueError):
    """The model cannot be split this many ways (one line naming why)."""


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world_size`: the ranges of the full model's dimensions it holds."""

    rank: int
    world_size: int
    q_heads: range
    kv_heads: range
    intermediate: range  # of config.intermediate_size (dense MLPs)
    expert_intermediate: range  # of config.moe_intermediate_size
    shared_intermediate: range  # of config.shared_expert_intermediate_size
    vocab_start: int
    num_local_vocab: int  # rows of the padded shard: ceil(V / N)
    vocab_size: int  # V, the full vocabulary
    total_kv_heads: int  # kv heads over all ranks (> G when they are replicated)

    @property
    def num_real_vocab(self) -> int:
        """Rows of the shard that are real tokens (the last rank's shard may be padded)."""
        return max(0, min(self.vocab_size - self.vocab_start, self.num_local_vocab))


def _split(size: int, rank: int, world_size: int) -> range:
    return range(rank * size // world_size, (rank + 1) * size // world_size)


split_range = _split  # rank's part of a dim of `size` (engine/parallel/families.py)


def plan_shard(config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
    """The plan for `rank`; TensorParallelConfigError when `config` does not split `world_size`
    ways."""
    from engine.parallel import families

    arch = config.architecture
    if arch not in _TP_ARCHITECTURES:
        raise TensorParallelConfigError(
            f"tensor parallelism serves {sorted(_TP_ARCHITECTURES)}, not {arch!r}")
    if config.qk_norm == "projection" and config.num_kv_heads < world_size:
        raise TensorParallelConfigError(
            f"{arch}: q/k norm over all heads is not split with kv heads replicated "
            f"({config.num_kv_heads} kv heads, {world_size} ranks)")
    families.check_splits(config, world_size)
    heads, kv, n = config.num_heads, config.num_kv_heads, world_size
    group = heads // kv  # query heads per kv head
    if kv >= n:
        kv_heads = _split(kv, rank, n)
        q_heads = range(kv_heads.start * group, kv_heads.stop * group)
        total_kv = kv
    elif n % kv == 0 and heads % n == 0:
        per_rank = heads // n
        q_heads = range(rank * per_rank, (rank + 1) * per_rank)
        first_kv = q_heads.start // group
        kv_heads = range(first_kv, first_kv + 1)
        total_kv = n
    else:
        raise TensorParallelConfigError(
            f"{heads} query heads and {kv} kv heads do not split across {n} ranks (with fewer kv "
            "heads than ranks, the ranks must be a multiple of the kv heads and divide the query "
            "heads)")
    if config.intermediate_size and config.intermediate_size < n:
        raise TensorParallelConfigError(f"intermediate_size {config.intermediate_size} < {n} ranks")
    local_vocab = -(-config.vocab_size // n)
    return ShardPlan(rank=rank, world_size=n, q_heads=q_heads, kv_heads=kv_heads,
                     intermediate=_split(config.intermediate_size, rank, n),
                     expert_intermediate=families.expert_intermediate(config, rank, n),
                     shared_intermediate=_split(config.shared_expert_intermediate_size, rank, n),
                     vocab_start=rank * local_vocab, num_local_vocab=local_vocab,
                     vocab_size=config.vocab_size, total_kv_heads=total_kv)


def local_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The rank's ModelConfig: its own head counts, intermediate sizes and (padded) vocab rows."""
    from engine.parallel.families import local_changes

    return dataclasses.replace(
        config, num_heads=len(plan.q_heads), num_kv_heads=len(plan.kv_heads),
        intermediate_size=len(plan.intermediate) or config.intermediate_size,
        moe_intermediate_size=len(plan.expert_intermediate),
        shared_expert_intermediate_size=len(plan.shared_intermediate),
        vocab_size=plan.num_local_vocab, **local_changes(config, plan))  # type: ignore[arg-type]
