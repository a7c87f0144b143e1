"""One rank's part of a tensor-parallel replica: its config, its shard of the weights, its runner.

    runner, full_config = build_rank_runner(config, group)   # every rank, rank 0 included

The rank's ModelRunner is the ordinary one, built from the rank's ModelConfig (its own head and
intermediate sizes) and weights, with `RankShard` wrapping the layers that talk across ranks
(engine/parallel/layers.py) and counting the KV budget for the whole replica.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel.group import TPGroup
from engine.parallel.layers import parallelize
from engine.parallel.plan import ShardPlan, local_config, plan_shard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankShard:
    plan: ShardPlan
    group: TPGroup

    def parallelize(self, model) -> None:  # type: ignore[no-untyped-def]
        parallelize(model, self.plan, self.group)

    def native_step(self, model, decode_weights: str):  # type: ignore[no-untyped-def]
        """The rank's native step (engine/parallel/native_step.py) for a parallelized model, or
        None."""
        from engine.parallel.native_step import parallel_native_step

        return parallel_native_step(model, decode_weights, self.group)

    def replica_bytes_per_block(self, rank_bytes_per_block: int) -> int:
        """A block's bytes over every rank (KV bytes grow with the kv heads a rank holds)."""
        return rank_bytes_per_block * self.plan.total_kv_heads // len(self.plan.kv_heads)


def step_kind(runner: ModelRunner) -> str:
    """What a rank's steps run; every rank's must be the same (the same collectives in the same
    order, the same KV blocks), which start-up checks."""
    return (f"step {runner.compute_info['native_step']}, KV {runner.kv_dtype} x "
            f"{runner.num_blocks} "
            "blocks")


def rank_engine_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The rank's EngineConfig: its share of the CPU cores (or its own CUDA device)."""
    n = config.tensor_parallel_size
    changes: dict[str, object] = {}
    if config.device.startswith("cuda"):
        changes["device"] = f"cuda:{rank}"
    else:
        changes["num_threads"] = max(1, (config.num_threads or os.cpu_count() or 1) // n)
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def build_rank_runner(config: EngineConfig, group: TPGroup, progress: bool = False
                      ) -> tuple[ModelRunner, ModelConfig]:
    """Load this rank's slices of the checkpoint and build its runner (not warmed up)."""
    from engine.parallel.loading import load_rank_weights

    rank_config = rank_engine_config(config, group.rank)
    if rank_config.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(rank_config.device))
    raw: dict = {}  # type: ignore[type-arg]  # the q4 mode: the rank's quantized blocks
    full_config, weights = load_rank_weights(config.model_path, group.rank, group.world_size,
                                             progress=progress,
                                             raw=(raw if rank_config.decode_weights == "q4"
                                                  else None))
    plan = plan_shard(full_config, group.rank, group.world_size)
    runner = ModelRunner(rank_config, local_config(full_config, plan), weights, raw,
                         RankShard(plan, group))
    logger.info("tensor-parallel rank %d/%d: query heads %d-%d, kv heads %d-%d, %d threads, "
                "weights %s, step %s", group.rank, group.world_size, plan.q_heads.start,
                plan.q_heads.stop - 1, plan.kv_heads.start, plan.kv_heads.stop - 1,
                torch.get_num_threads(), runner.compute_info["weights"],
                runner.compute_info["native_step"])
    return runner, full_config
