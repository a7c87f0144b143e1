"""The layers that talk across ranks, wrapped around a rank's ordinary model parts.

    RowParallel(o_proj | mlp)   x -> all_reduce(inner(x))   the partial sums of the rank's columns
    VocabParallelEmbedding      ids -> all_reduce(rows of the rank's vocab slice, zeros elsewhere)
    VocabParallelHead           hidden -> the rank's logits [S, V / N], gathered to rank 0 [S, V]

`parallelize(model, plan, group)` puts them into a LlamaModel built from a rank's shard: per
decoder layer one all-reduce after o_proj and one after the MLP (dense or MoE: the routed and
shared experts' partial outputs are summed once), one after the embedding lookup, and one gather
of the sampled rows' logits per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.layers.linear import LinearWeight
from engine.parallel.group import TPGroup
from engine.parallel.plan import ShardPlan


class RowParallel(LinearWeight):
    """A callable over the rank's slice of the input features whose output is a partial sum."""

    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor], group: TPGroup) -> None:
        self.inner = inner
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x).contiguous())  # [T, Hd]

    @property
    def nbytes(self) -> int:
        return int(getattr(self.inner, "nbytes", 0))


class VocabParallelEmbedding:
    """ids [T] -> [T, Hd]: each rank looks up the ids in its vocab slice, zeros for the others."""

    def __init__(self, weight: torch.Tensor, plan: ShardPlan, group: TPGroup) -> None:
        self.weight = weight  # [ceil(V / N), Hd]
        self.start, self.num_real = plan.vocab_start, plan.num_real_vocab
        self.group = group

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [T]
        outside = (local < 0) | (local >= self.num_real)  # [T]
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, Hd]
        return self.group.all_reduce(rows.masked_fill(outside[:, None], 0.0))


class VocabParallelHead(LinearWeight):
    """hidden [S, Hd] -> logits: [S, V] on rank 0 (the padding rows cut), the rank's [S, V / N]
    elsewhere."""

    def __init__(self, inner: LinearWeight, plan: ShardPlan, group: TPGroup) -> None:
        self.inner = inner
        self.vocab_size = plan.vocab_size
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.group.gather_last_dim(self.inner(x).float())  # [S, N * ceil(V / N)] on rank 0
        return logits[:, :self.vocab_size] if self.group.is_first else logits

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


class ProjectionQKNorm:
    """OLMoE's q/k RMSNorm over all heads on a rank holding some of them: the rank's sums of squares
    of q [T, Q / N] and k [T, K / N] all-reduced ([T, 2]), divided by the full Q and K."""

    def __init__(self, q_size: int, kv_size: int, eps: float, group: TPGroup) -> None:
        self.q_size, self.kv_size = q_size, kv_size  # Q, K of the whole model
        self.eps = eps
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor,  # type: ignore[no-untyped-def]
                 layer) -> tuple[torch.Tensor, torch.Tensor]:
        q32, k32 = q.float(), k.float()
        # [T, 2]
        sums = self.group.all_reduce(torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)], dim=-1))
        q_scale = torch.rsqrt(sums[:, :1] / self.q_size + self.eps)  # [T, 1]
        k_scale = torch.rsqrt(sums[:, 1:] / self.kv_size + self.eps)
        return (layer.q_norm * (q32 * q_scale).to(q.dtype),
                layer.k_norm * (k32 * k_scale).to(k.dtype))


def parallelize(model, plan: ShardPlan, group: TPGroup) -> None:  # type: ignore[no-untyped-def]
    """Wrap a shard-built LlamaModel's cross-rank layers in place (module doc); the other families'
    models (engine/parallel/families.py) have the same parts."""
    from engine.parallel.families import parallelize as family_changes

    family_changes(model, plan)
    for layer in model.layers:
        layer.o_proj = RowParallel(layer.o_proj, group)
        if hasattr(layer, "mlp"):
            layer.mlp = RowParallel(layer.mlp, group)
        else:  # Gemma 3: its post-feedforward norm acts on the summed down projection
            layer.down = RowParallel(layer.down, group)
    if model.config.qk_norm == "projection":  # OLMoE (plan_shard refuses replicated kv heads here)
        dh, group_size = model.config.head_dim, len(plan.q_heads) // len(plan.kv_heads)
        model.projection_qk_norm = ProjectionQKNorm(plan.total_kv_heads * group_size * dh,
                                                    plan.total_kv_heads * dh,
                                                    model.config.rms_norm_eps, group)
    model.embed = VocabParallelEmbedding(model.embed_tokens, plan, group)
    model.lm_head = VocabParallelHead(model.lm_head, plan, group)
