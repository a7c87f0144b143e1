"""Tensor parallelism on the CPU (gloo, 2 ranks) against the single-process engine, on the default
model (SmolLM2-135M: 9 query heads, 3 kv heads, so the ranks hold 1 and 2 kv groups).

One TP=2 engine for the module (two processes: this one is rank 0); the last test kills its worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.outputs import FinishReason
from engine.parallel.plan import TensorParallelConfigError, local_config, plan_shard
from tests.engine.fakes import drive

MiB = 1 << 20
KV_BYTES = 32 * MiB  # the replica's budget: the same block count for TP=1 and TP=2
CHUNK = 64  # max_num_batched_tokens: a 150-token prompt prefills in 3 chunks


@pytest.fixture(scope="module")
def tp_engine(model_path: str) -> Iterator[LLMEngine]:
    config = EngineConfig(model_path=model_path, num_threads=2, dtype="float32", tensor_parallel_size=2,
                          cache=CacheConfig(kv_cache_memory_bytes=KV_BYTES),
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK, max_num_seqs=8))
    engine = LLMEngine.from_config(config, progress=False)
    yield engine
    engine.runner.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def tp1_engine(make_engine: Any) -> LLMEngine:
    return make_engine(kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=CHUNK, max_num_seqs=8,
                       fresh=True)


def _run_workload(engine: LLMEngine, prompts: dict[str, list[int]]) -> tuple[dict, list[torch.Tensor], list]:
    """Chunked prefill of a long prompt beside a short one, the long one again (a prefix-cache hit)
    and one aborted after its first step; -> completions, every step's logits, the KV events."""
    captured: list[torch.Tensor] = []
    execute = engine.runner.execute

    def capture(batch):  # type: ignore[no-untyped-def]
        step = execute(batch)
        captured.append(step.logits.clone())
        return step

    engine.runner.execute = capture  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    first_seq = engine.kv_events.last_seq
    try:
        engine.add_request("long", prompts["long"], greedy)
        engine.add_request("short", prompts["short"], greedy)
        engine.add_request("doomed", prompts["short"][::-1], greedy)

        aborted = []

        def on_step(i: int) -> None:
            if i == 1:
                aborted.append(engine.abort_request("doomed"))
            if i == 8:
                engine.add_request("again", prompts["long"], greedy)

        results = drive(engine, on_step=on_step)
        results.pop("doomed", None)  # (its one output came from abort_request)
        assert aborted[0] is not None and aborted[0].finish_reason == FinishReason.ABORT
    finally:
        del engine.runner.execute
    page = engine.kv_events.since(first_seq)
    assert page is not None
    events = [[dict(e, **({"ts": None} if "ts" in e else {})) for e in b.to_json()["events"]]
              for b in page.batches]
    return results, captured, events


def test_tp2_matches_tp1_tokens_logits_cache_hits_and_kv_events(tp_engine: LLMEngine, tp1_engine: LLMEngine,
                                                                tokenizer: Any) -> None:
    assert tp_engine.runner.num_blocks == tp1_engine.runner.num_blocks  # one block table per replica
    text = "The quick brown fox jumps over the lazy dog. " * 15
    prompts = {"long": tokenizer.encode(text)[:150], "short": tokenizer.encode("The capital of France is")}
    ours, ours_logits, ours_events = _run_workload(tp_engine, prompts)
    base, base_logits, base_events = _run_workload(tp1_engine, prompts)

    assert {k: v.token_ids for k, v in ours.items()} == {k: v.token_ids for k, v in base.items()}
    assert ours["again"].num_cached_tokens == base["again"].num_cached_tokens >= 144
    assert ours_events == base_events and ours_events  # the same blocks stored and removed
    assert len(ours_logits) == len(base_logits)
    pairs = [(a, b) for a, b in zip(ours_logits, base_logits, strict=True) if b.numel()]
    assert all(a.shape == b.shape for a, b in pairs) and pairs
    worst = max((a - b).abs().max().item() for a, b in pairs)
    scale = max(b.abs().max().item() for _, b in pairs)
    # the all-reduce adds the ranks' partial sums in another order than one GEMM: not bit-equal
    assert worst <= 1e-5 * scale, (worst, scale)
    assert tp_engine.runner.group.num_collectives > 0  # type: ignore[attr-defined]


def test_a_model_that_does_not_split_is_one_line() -> None:
    from engine.config import ModelConfig

    config = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                         num_layers=1, num_heads=6, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    with pytest.raises(TensorParallelConfigError, match="do not split across 4 ranks"):
        plan_shard(config, 0, 4)
    with pytest.raises(TensorParallelConfigError, match="do not split across 3 ranks"):
        plan_shard(config, 0, 3)
    config = dataclasses.replace(config, num_heads=8)
    shards = [plan_shard(config, r, 4) for r in range(4)]  # fewer kv heads than ranks: replicated
    assert [list(p.kv_heads) for p in shards] == [[0], [0], [1], [1]] and shards[0].total_kv_heads == 4
    assert [list(p.q_heads) for p in shards] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert local_config(config, shards[2]).num_kv_heads == 1
    uneven = [plan_shard(dataclasses.replace(config, num_heads=9, num_kv_heads=3), r, 2) for r in range(2)]
    assert [len(p.kv_heads) for p in uneven] == [1, 2] and [len(p.q_heads) for p in uneven] == [3, 6]


def test_killing_a_rank_mid_stream_fails_the_replica_cleanly(tp_engine: LLMEngine, tokenizer: Any) -> None:
    from engine.async_engine import AsyncEngine, EngineDeadError

    async_engine = AsyncEngine(tp_engine)
    worker = tp_engine.runner._workers[0]  # type: ignore[attr-defined]
    received: list[int] = []

    async def stream() -> None:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        async for output in async_engine.generate("victim", tokenizer.encode("Count: 1, 2, 3,"), params):
            received.extend(output.new_token_ids)
            if len(received) == 2:
                worker.kill()

    with pytest.raises(EngineDeadError, match="tensor-parallel rank 1 exited"):
        asyncio.run(asyncio.wait_for(stream(), timeout=60))
    assert 2 <= len(received) < 200
    assert not async_engine.is_alive  # /health answers 503
    deadline = time.monotonic() + 10
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.poll() is not None  # no orphan
    async_engine.shutdown()


def test_an_embedded_model_gives_its_replicas_the_tensor_parallel_flag() -> None:
    from gateway.settings import ModelSettings

    model = ModelSettings(name="m", backend="replica", embedded=True, tensor_parallel_size=2)
    assert model.replica_args()[-2:] == ["--tensor-parallel-size", "2"]
    assert "--tensor-parallel-size" not in ModelSettings(name="m", backend="replica",
                                                         embedded=True).replica_args()


def test_a_moe_checkpoint_splits_its_experts_and_matches_tp1(tmp_path: Any) -> None:
    """Qwen3-MoE (tiny, random): experts split on their intermediate dim, router replicated, a dense
    layer between sparse ones, per-head q/k norm; weights read as per-rank safetensors slices."""
    from tests.models._qwen3 import write_checkpoints

    directory = write_checkpoints(tmp_path, ("qwen3_moe",))["qwen3_moe"].directory
    engines = {}
    for tp in (1, 2):
        config = EngineConfig(model_path=str(directory), num_threads=2, dtype="float32",
                              tensor_parallel_size=tp, cache=CacheConfig(kv_cache_memory_bytes=4 * MiB),
                              scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4))
        engines[tp] = LLMEngine.from_config(config, progress=False)
    try:
        prompts = {"long": list(range(3, 43)), "short": [7, 8, 9, 10, 11]}
        ours, ours_logits, _ = _run_workload(engines[2], prompts)
        base, base_logits, _ = _run_workload(engines[1], prompts)
    finally:
        engines[2].runner.close()  # type: ignore[attr-defined]
    assert {k: v.token_ids for k, v in ours.items()} == {k: v.token_ids for k, v in base.items()}
    assert ours["again"].num_cached_tokens == base["again"].num_cached_tokens > 0
    pairs = [(a, b) for a, b in zip(ours_logits, base_logits, strict=True) if b.numel()]
    worst = max((a - b).abs().max().item() for a, b in pairs)
    assert worst <= 1e-5 * max(b.abs().max().item() for _, b in pairs), worst


def test_a_rank_reads_its_gguf_slices_equal_to_the_cut_of_the_whole(checkpoint: Any, model_path: str) -> None:
    """Only the rank's rows (through llama's q/k row order) and block-aligned columns are read and
    dequantized; the result is the same tensors as dequantizing everything and cutting."""
    from pathlib import Path

    from engine.parallel.gguf_slices import load_gguf_slices
    from engine.parallel.shard import shard_weights

    plan = plan_shard(checkpoint.config, 1, 2)
    want = shard_weights(dict(checkpoint.weights), checkpoint.config, plan)
    _, got = load_gguf_slices(Path(model_path), 1, 2, torch.float32)
    assert set(got) == set(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert got["model.layers.0.self_attn.q_proj.weight"].shape == (6 * 64, 576)  # rank 1: 2 kv groups
