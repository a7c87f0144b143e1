"""Tensor parallelism on the CPU (gloo, 2 ranks) against the single-process engine, on the default
model (SmolLM2-135M: 9 query heads, 3 kv heads, so the ranks hold 1 and 2 kv groups).

One float32 TP=2 engine for the module (two processes: this one is rank 0), shared by the tests up
to the one that kills its worker; a process holds one TP world at a time, so the q4 and MoE tests
after it start and close their own.

Logits are compared against a measured floor instead of a fixed absolute 1e-5: the same TP=1 engine
with its input embeddings scaled by (1 + 2**-23), one float32 rounding of the model's input, moves
the logits by ~5e-5 in float32 (and by ~0.8 in the q4 mode, whose 8-bit activation quantization
turns any last-bit change into a different rounding); TP=2's own differences are roundings of the
same size (the all-reduce adds the ranks' partial sums in another order than one GEMM), so an
absolute 1e-5 is below what the model resolves in float32. TP=2 must stay within 2x that floor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.outputs import FinishReason
from engine.parallel.plan import TensorParallelConfigError, local_config, plan_shard
from tests.engine.fakes import assert_idle_and_clean, drive, generate

MiB = 1 << 20
# the replica's budget: the same block count for TP=1 and TP=2 (22 float32 blocks)
KV_BYTES = 16 * MiB
CHUNK = 64  # max_num_batched_tokens: a 150-token prompt prefills in 3 chunks


_SHARED: dict[str, LLMEngine] = {}  # the tp_engine world, kept across the tests that take it


def _one_world() -> None:
    """Close the shared tp_engine world before another one starts: a process holds one default
    process group, so two live TP worlds fail ("initialize the default process group twice")."""
    engine = _SHARED.pop("tp", None)
    if engine is not None:
        engine.runner.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="module", autouse=True)
def _close_the_shared_world() -> Iterator[None]:
    yield
    _one_world()


@pytest.fixture
def tp_engine(model_path: str) -> LLMEngine:
    """One TP=2 float engine on the default model, rebuilt when a test failed a rank or another
    world closed it, so any -k selection of this file runs in any order."""
    engine = _SHARED.get("tp")
    runner = getattr(engine, "runner", None)
    if engine is None or runner._closing or runner._failure is not None:  # type: ignore[union-attr]
        _one_world()
        engine = _SHARED["tp"] = _tp2(model_path)
    return engine


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> dict[str, list[int]]:
    text = "The quick brown fox jumps over the lazy dog. " * 15
    return {"long": tokenizer.encode(text)[:150],
            "short": tokenizer.encode("The capital of France is")}


@pytest.fixture(scope="module")
def tp1_engine(make_engine: Any) -> LLMEngine:
    return make_engine(kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=CHUNK, max_num_seqs=8,
                       fresh=True)


def _tp2(model_path: str, **changes: Any) -> LLMEngine:
    _one_world()
    config = EngineConfig(model_path=model_path, num_threads=2, dtype="float32",
                          tensor_parallel_size=2, cache=CacheConfig(kv_cache_memory_bytes=KV_BYTES),
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK, max_num_seqs=8))
    return LLMEngine.from_config(dataclasses.replace(config, **changes), progress=False)


def _worst(ours: list[torch.Tensor], base: list[torch.Tensor]) -> float:
    """The largest absolute difference of two runs' logits, step by step."""
    assert len(ours) == len(base)
    pairs = [(a, b) for a, b in zip(ours, base, strict=True) if b.numel()]
    assert all(a.shape == b.shape for a, b in pairs) and pairs
    return max((a - b).abs().max().item() for a, b in pairs)


def _one_rounding_floor(engine: LLMEngine, prompts: dict[str, list[int]],
                        logits: list[torch.Tensor]) -> float:
    """How far the logits of `engine` (TP=1, `logits` from its run of the workload) move when its
    input embeddings are scaled by (1 + 2**-23): the model's sensitivity to one float32 rounding."""
    model = engine.runner.model
    embed = model.embed_tokens
    engine.reset_prefix_cache()  # (the rerun computes what the first run did, no cache hits)
    # the lookup's table only (the tied head keeps its own)
    model.embed_tokens = embed * (1 + 2.0 ** -23)
    try:
        _, moved, _ = _run_workload(engine, prompts)
    finally:
        model.embed_tokens = embed
    return _worst(moved, logits)


def _run_workload(engine: LLMEngine,
                  prompts: dict[str, list[int]]) -> tuple[dict, list[torch.Tensor], list]:
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


def test_tp2_matches_tp1_tokens_logits_cache_hits_and_kv_events(
        tp_engine: LLMEngine, tp1_engine: LLMEngine, prompts: dict[str, list[int]]) -> None:
    # one block table per replica
    assert tp_engine.runner.num_blocks == tp1_engine.runner.num_blocks
    assert tp_engine.runner.runner.compute_info["native_step"] == "ParallelFloatStep"  # type: ignore[attr-defined]
    # (an earlier test may have cached blocks on one of them)
    for engine in (tp_engine, tp1_engine):
        engine.reset_prefix_cache()
    ours, ours_logits, ours_events = _run_workload(tp_engine, prompts)
    base, base_logits, base_events = _run_workload(tp1_engine, prompts)

    assert {k: v.token_ids for k, v in ours.items()} == {k: v.token_ids for k, v in base.items()}
    assert ours["again"].num_cached_tokens == base["again"].num_cached_tokens >= 144
    assert ours_events == base_events and ours_events  # the same blocks stored and removed
    worst = _worst(ours_logits, base_logits)
    scale = max(b.abs().max().item() for b in base_logits if b.numel())
    assert worst <= 1e-5 * scale, (worst, scale)
    floor = _one_rounding_floor(tp1_engine, prompts, base_logits)  # (module doc: ~5e-5)
    assert 0 < floor and worst <= 2 * floor, (worst, floor)
    assert tp_engine.runner.group.num_collectives > 0  # type: ignore[attr-defined]


def test_tp2_under_recompute_preemption_gives_tp1_tokens(tp_engine: LLMEngine,
                                                         tp1_engine: LLMEngine,
                                                         tokenizer: Any) -> None:
    """6 sequences of 68 tokens need 30 blocks; the pool holds 22 (5 sequences of 4 blocks admitted,
    each needs a 5th at token 64): the youngest are preempted and recomputed, on both engines at the
    same steps (one scheduler, the same block count)."""
    assert tp_engine.runner.num_blocks == 22
    words = "red green blue gold grey pink".split()
    prompts = {w: tokenizer.encode(f"{w} " * 100)[:60] for w in words}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = {e: e.stats().num_preemptions_total for e in (tp_engine, tp1_engine)}
    ours, base = generate(tp_engine, prompts, params), generate(tp1_engine, prompts, params)
    preempted = {e: e.stats().num_preemptions_total - before[e] for e in (tp_engine, tp1_engine)}
    assert preempted[tp_engine] == preempted[tp1_engine] > 0
    assert {k: v.token_ids for k, v in ours.items()} == {k: v.token_ids for k, v in base.items()}
    assert all(len(v.token_ids) == 8 for v in ours.values())
    assert_idle_and_clean(tp_engine)


def test_a_model_that_does_not_split_is_one_line() -> None:
    from engine.config import ModelConfig

    config = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64,
                         intermediate_size=128, num_layers=1, num_heads=6, num_kv_heads=2,
                         head_dim=8, max_position_embeddings=64)
    with pytest.raises(TensorParallelConfigError, match="do not split across 4 ranks"):
        plan_shard(config, 0, 4)
    with pytest.raises(TensorParallelConfigError, match="do not split across 3 ranks"):
        plan_shard(config, 0, 3)
    config = dataclasses.replace(config, num_heads=8)
    shards = [plan_shard(config, r, 4) for r in range(4)]  # fewer kv heads than ranks: replicated
    assert ([list(p.kv_heads) for p in shards] == [[0], [0], [1], [1]]
            and shards[0].total_kv_heads == 4)
    assert [list(p.q_heads) for p in shards] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert local_config(config, shards[2]).num_kv_heads == 1
    uneven = [plan_shard(dataclasses.replace(config, num_heads=9, num_kv_heads=3), r, 2)
              for r in range(2)]
    assert ([len(p.kv_heads) for p in uneven] == [1, 2]
            and [len(p.q_heads) for p in uneven] == [3, 6])


def test_killing_a_rank_mid_stream_fails_the_replica_cleanly(tp_engine: LLMEngine,
                                                             tokenizer: Any) -> None:
    from engine.async_engine import AsyncEngine, EngineDeadError

    async_engine = AsyncEngine(tp_engine)
    worker = tp_engine.runner._workers[0]  # type: ignore[attr-defined]
    received: list[int] = []

    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def stream() -> None:
        async for output in async_engine.generate("victim", tokenizer.encode("Count: 1, 2, 3,"),
                                                  params):
            received.extend(output.new_token_ids)
            if len(received) == 2:
                worker.kill()

    async def bystander() -> None:  # in flight beside it: ends with the same error
        async for _ in async_engine.generate("bystander", tokenizer.encode("Letters: a, b, c,"),
                                             params):
            pass

    async def both() -> list[BaseException | None]:
        return await asyncio.wait_for(asyncio.gather(stream(), bystander(), return_exceptions=True),
                                      60)

    errors = asyncio.run(both())
    assert all(isinstance(e, EngineDeadError) and "tensor-parallel rank 1 exited" in str(e)
               for e in errors), errors
    assert 2 <= len(received) < 200
    assert not async_engine.is_alive  # /health answers 503

    async def late() -> None:  # a request after the failure is refused at once
        async for _ in async_engine.generate("late", [1, 2, 3], params):
            pass

    with pytest.raises(EngineDeadError, match="tensor-parallel rank 1 exited"):
        asyncio.run(asyncio.wait_for(late(), timeout=5))
    deadline = time.monotonic() + 10
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.poll() is not None  # no orphan
    async_engine.shutdown()


def test_tp2_q4_runs_the_native_kernels_on_its_block_slices_and_matches_tp1_q4(
        model_path: str, checkpoint: Any, tokenizer: Any, prompts: dict[str, list[int]]) -> None:
    """The CPU default mode: each rank holds its slice of the GGUF's Q4_1 / Q8_0 blocks and runs the
    native kernels (ParallelNativeStep) with a float16 KV cache; greedy tokens, cached_tokens and KV
    events equal TP=1's in the same mode, logits within 2x the q4 mode's one-rounding floor."""
    from engine.model_runner import ModelRunner

    config = EngineConfig(model_path=model_path, num_threads=1, dtype="float32",
                          decode_weights="q4", cache=CacheConfig(kv_cache_memory_bytes=KV_BYTES),
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK, max_num_seqs=8))
    runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))
    tp1 = LLMEngine(config, checkpoint.config, runner, tokenizer)
    tp2 = _tp2(model_path, decode_weights="q4")
    try:
        rank0 = tp2.runner.runner  # type: ignore[attr-defined]
        assert rank0.compute_info["weights"] == "q4-native"
        assert rank0.compute_info["native_step"] == "ParallelNativeStep"
        assert (tp2.compute_info["weights"] == "q4-native"
                and tp2.compute_info["tensor_parallel_size"] == 2)
        assert (rank0.kv_caches[0][0].dtype == torch.float16
                and tp2.runner.num_blocks == runner.num_blocks)
        qkv_rows = rank0.model.layers[0].qkv.blocks.shape[0] * 8  # rank 0: 3 query heads, 1 kv head
        assert qkv_rows == (3 + 2 * 1) * 64
        ours, ours_logits, ours_events = _run_workload(tp2, prompts)
    finally:
        tp2.runner.close()  # type: ignore[attr-defined]
    base, base_logits, base_events = _run_workload(tp1, prompts)
    assert {k: v.token_ids for k, v in ours.items()} == {k: v.token_ids for k, v in base.items()}
    assert ours["again"].num_cached_tokens == base["again"].num_cached_tokens >= 144
    assert ours_events == base_events
    worst = _worst(ours_logits, base_logits)
    floor = _one_rounding_floor(tp1, prompts, base_logits)  # (module doc: ~0.8)
    assert 0 < floor and worst <= 2 * floor, (worst, floor)


def test_an_embedded_model_gives_its_replicas_the_tensor_parallel_flag() -> None:
    from gateway.settings import ModelSettings

    model = ModelSettings(name="m", backend="replica", embedded=True, tensor_parallel_size=2)
    assert model.replica_args()[-2:] == ["--tensor-parallel-size", "2"]
    assert "--tensor-parallel-size" not in ModelSettings(name="m", backend="replica",
                                                         embedded=True).replica_args()


def test_a_moe_checkpoint_splits_its_experts_and_matches_tp1(tmp_path: Any) -> None:
    """Qwen3-MoE (tiny, random): experts split on their intermediate dim, router replicated, a dense
    layer between sparse ones, per-head q/k norm; weights read as per-rank safetensors slices."""
    from tests.engine.models._qwen3 import write_checkpoints

    directory = write_checkpoints(tmp_path, ("qwen3_moe",))["qwen3_moe"].directory
    engines = {}
    for tp in (1, 2):
        _one_world()
        config = EngineConfig(model_path=str(directory), num_threads=2, dtype="float32",
                              tensor_parallel_size=tp,
                              cache=CacheConfig(kv_cache_memory_bytes=4 * MiB),
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


def test_a_rank_reads_its_gguf_slices_equal_to_the_cut_of_the_whole(checkpoint: Any,
                                                                    model_path: str) -> None:
    """Only the rank's rows (through llama's q/k row order) and block-aligned columns are read and
    dequantized; the result is the same tensors as dequantizing everything and cutting."""
    from pathlib import Path

    import gguf
    import numpy as np

    from engine.parallel.gguf_slices import load_gguf_slices
    from engine.parallel.shard import shard_weights, tensor_slices

    plan = plan_shard(checkpoint.config, 1, 2)
    want = shard_weights(dict(checkpoint.weights), checkpoint.config, plan)
    raw: dict[str, Any] = {}
    _, got = load_gguf_slices(Path(model_path), 1, 2, torch.float32, raw)
    assert set(got) == set(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
    # rank 1: 2 kv groups
    assert got["model.layers.0.self_attn.q_proj.weight"].shape == (6 * 64, 576)
    # the q4 mode's blocks: the rank's rows and whole blocks of columns of the file's, vocab rows
    # padded
    assert set(raw) == set(checkpoint.raw)
    for name, whole in checkpoint.raw.items():
        rows, cols = tensor_slices(name, whole.shape, checkpoint.config, plan)
        block_elements, block_bytes = gguf.GGML_QUANT_SIZES[
            gguf.GGMLQuantizationType[whole.ggml_type]]
        data = np.concatenate([whole.data[r.start:r.stop] for r in rows]) if rows else whole.data
        if cols:
            data = np.concatenate([data[:, r.start // block_elements * block_bytes:
                                        r.stop // block_elements * block_bytes] for r in cols],
                                  axis=1)
        assert raw[name].ggml_type == whole.ggml_type and raw[name].shape == tuple(got[name].shape)
        assert (np.array_equal(raw[name].data[:len(data)], data)
                and not raw[name].data[len(data):].any())
    assert raw["model.layers.0.self_attn.o_proj.weight"].shape == (576, 6 * 64)


def test_a_quantized_weight_keeps_its_blocks_only_where_every_rank_cuts_whole_blocks() -> None:
    """The q4 blocks of a weight go to the ranks only when every rank's cut is whole 32-value blocks
    and groups of 8 rows; else no rank gets them (the ranks must build the same layers)."""
    import gguf

    from engine.config import ModelConfig
    from engine.parallel.gguf_slices import _cut_in_blocks

    config = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=128,
                         intermediate_size=320, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=32, max_position_embeddings=64)
    q4 = gguf.GGMLQuantizationType.Q4_1
    plans = [plan_shard(config, r, 2) for r in range(2)]

    def cut(name: str, shape: tuple[int, int], n: int = 2) -> bool:
        return _cut_in_blocks(name, shape, q4, config, [plan_shard(config, r, n) for r in range(n)])

    assert cut("model.layers.0.mlp.down_proj.weight", (128, 320))  # columns cut at 160: 5 blocks
    assert not cut("model.layers.0.mlp.down_proj.weight", (128, 320), 4)  # at 80: inside a block
    assert cut("model.layers.0.mlp.gate_proj.weight", (320, 128))  # 160 rows a rank
    assert cut("model.layers.0.mlp.gate_proj.weight", (320, 128), 4)  # 80 rows: 10 groups of 8
    assert cut("model.layers.0.self_attn.o_proj.weight", (128, 128))  # 2 heads of 32 a rank
    # 500 % 8
    assert plans[1].num_local_vocab == 500 and not cut("model.embed_tokens.weight", (1000, 128))


# ---- the other families (engine/parallel/families.py): a TP=2 world each, tiny checkpoints -------
def _write_family(family: str, root: Path) -> Path:
    """A tiny random checkpoint of `family` in `root`, written by transformers' save_pretrained (the
    writers of tests/engine/models/)."""
    import transformers

    # chunked RoPE + NoPE layers, L2 q/k norm, MoE (shared expert) + dense
    if family == "llama4_text":
        from tests.engine.models._llama4 import write_checkpoints

        return write_checkpoints(root)["moe"].directory
    directory = root / family
    directory.mkdir()
    if family == "gemma3_text":  # sliding and global layers, per-head q/k norm, soft-capped logits
        from tests.engine.models._gemma3 import write_checkpoint

        write_checkpoint(directory)
    # sinks, sliding windows, biased experts in MXFP4 (I = 64: one block a rank)
    elif family == "gpt_oss":
        from tests.engine.models._gpt_oss import make_config, quantize_experts, write_tokenizer

        config = make_config(write_tokenizer(directory))
        config.intermediate_size, config.initializer_range = 64, 0.15
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for layer in model.model.layers:  # sinks that take a visible share of each softmax
                layer.self_attn.sinks.normal_(0.0, 2.0)
        model.eval().save_pretrained(directory)
        quantize_experts(directory)
    # MLA (q_lora), grouped top-k, shared expert, a dense first layer,
    elif family == "deepseek_v3":
        _write_deepseek_fp8(directory)  # block-scaled FP8 projections, an MTP layer to skip
    elif family == "olmoe":  # q/k norm over all heads (its sums of squares all-reduced), 8 experts
        from tests.engine.models._checkpoints import FAMILIES
        from tests.engine.models._qwen3 import write_tokenizer

        config = FAMILIES["olmoe"]()
        config.vocab_size, config.eos_token_id, config.initializer_range = (
            320, write_tokenizer(directory), 0.1)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32).eval().save_pretrained(directory)
    return directory


def _write_deepseek_fp8(directory: Path) -> None:
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    from tests.engine.models._deepseek_v3 import VARIANTS, make_config
    from tests.engine.models._gpt_oss import write_tokenizer
    from tests.engine.models.test_fp8_block_checkpoints import BLOCK, quantize_blocks

    config = make_config(write_tokenizer(directory), **VARIANTS["lora"])
    config.initializer_range = 0.15
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a correction bias that changes which experts are chosen
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    model.eval().save_pretrained(directory)
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    tensors.update({n.replace("model.layers.2.", "model.layers.3."): t.clone()  # an MTP layer
                    for n, t in tensors.items() if n.startswith("model.layers.2.")})
    for name in [n for n in tensors if n.endswith(("_proj.weight", "_proj_with_mqa.weight"))]:
        tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(tensors[name])
    save_file(tensors, str(file), metadata={"format": "pt"})
    raw = json.loads((directory / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "weight_block_size": list(BLOCK)}
    (directory / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """family -> its checkpoint directory, written on first use (once per module)."""
    written: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in written:
            written[family] = _write_family(family, tmp_path_factory.mktemp(family))
        return written[family]

    return get


@pytest.mark.parametrize("family",
                         ["gemma3_text", "llama4_text", "gpt_oss", "deepseek_v3", "olmoe"])
def test_each_family_splits_and_matches_tp1(family: str, family_checkpoint: Any) -> None:
    """TP=2 against TP=1 on the workload above (chunked prefill, a prefix hit, an abort): the same
    greedy tokens and cached tokens, every step's logits within 1e-5 ABSOLUTE (not relative to the
    largest logit as above; the checkpoints' logits reach 1.4 to 5)."""
    directory = family_checkpoint(family)
    engines = {}
    try:
        for tp in (1, 2):
            _one_world()
            config = EngineConfig(model_path=str(directory), num_threads=2, dtype="float32",
                                  tensor_parallel_size=tp,
                                  cache=CacheConfig(kv_cache_memory_bytes=4 * MiB),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=16,
                                                            max_num_seqs=4))
            engines[tp] = LLMEngine.from_config(config, progress=False)
        rank0 = engines[2].runner.runner  # type: ignore[attr-defined]
        assert rank0.model_config.num_heads == engines[1].model_config.num_heads // 2
        prompts = {"long": list(range(3, 43)), "short": [7, 8, 9, 10, 11]}
        ours, ours_logits, ours_events = _run_workload(engines[2], prompts)
        base, base_logits, base_events = _run_workload(engines[1], prompts)
    finally:
        if 2 in engines:
            engines[2].runner.close()  # type: ignore[attr-defined]
    assert {k: v.token_ids for k, v in ours.items()} == {k: v.token_ids for k, v in base.items()}
    assert ours["again"].num_cached_tokens == base["again"].num_cached_tokens > 0
    pairs = [(a, b) for a, b in zip(ours_logits, base_logits, strict=True) if b.numel()]
    assert pairs and all(a.shape == b.shape for a, b in pairs)
    worst = max((a - b).abs().max().item() for a, b in pairs)
    assert worst <= 1e-5, worst
    if family == "deepseek_v3":  # every rank caches the whole latent: half the blocks per budget
        mla = engines[1].model_config.mla
        assert (mla is not None
                and rank0.kv_caches[0][0].shape[2:] == (1, mla.kv_lora_rank + mla.qk_rope_head_dim))
        assert engines[2].runner.num_blocks == engines[1].runner.num_blocks // 2
    else:
        assert (ours_events == base_events
                and engines[2].runner.num_blocks == engines[1].runner.num_blocks)


@pytest.mark.parametrize("family", ["llama4_text", "gemma3_text"])
def test_q4_with_a_rank_weight_off_the_block_grid_stays_as_close_to_tp1_q4_as_q4_is_to_float(
        family: str, family_checkpoint: Any) -> None:
    """The q4 mode on a float checkpoint whose rank slices are not all whole 32-value blocks (Llama
    4's dense MLP of 96: 48 a rank): such a rank weight stays float32 (OneDNNLinear) beside native
    Q8_0 blocks, where TP=1 quantizes the whole weight to Q8_0. So TP=2 rounds it differently from
    TP=1: every step's logits up to the first step whose greedy tokens differ are no farther from
    TP=1 q4 than TP=1 q4 is from float32, and where a token differs TP=1's top-2 logits at that row
    are a near tie (inside that distance), not a wrong sum (a 5% error in that down projection's
    output fails the first check)."""
    from engine.layers.linear import OneDNNLinear
    from engine.layers.native_linear import NativeQuantLinear

    directory = family_checkpoint(family)
    prompts = {"long": list(range(3, 43)), "short": [7, 8, 9, 10, 11]}
    runs: dict[str, list[torch.Tensor]] = {}
    for name, tp, weights in (("float", 1, "float"), ("q4", 1, "q4"), ("tp2_q4", 2, "q4")):
        _one_world()
        config = EngineConfig(model_path=str(directory), num_threads=2, dtype="float32",
                              tensor_parallel_size=tp, decode_weights=weights,
                              cache=CacheConfig(kv_cache_memory_bytes=4 * MiB),
                              scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4))
        engine = LLMEngine.from_config(config, progress=False)
        try:
            if tp == 2 and family == "llama4_text":
                mlp = engine.runner.runner.model.layers[0].mlp.inner  # type: ignore[attr-defined]
                assert (isinstance(mlp.gate_up, NativeQuantLinear)
                        and isinstance(mlp.down, OneDNNLinear))
            runs[name] = _run_workload(engine, prompts)[1]
        finally:
            if tp == 2:
                engine.runner.close()  # type: ignore[attr-defined]
    steps = [i for i, b in enumerate(runs["q4"]) if b.numel()]
    assert all(runs["tp2_q4"][i].shape == runs["q4"][i].shape for i in steps)
    first_split = next((i for i in steps if not torch.equal(runs["tp2_q4"][i].argmax(-1),
                                                            runs["q4"][i].argmax(-1))), steps[-1])
    compared = [i for i in steps if i <= first_split]
    q4_error = max((runs["q4"][i] - runs["float"][i]).abs().max().item() for i in compared)
    tp2_error = max((runs["tp2_q4"][i] - runs["q4"][i]).abs().max().item() for i in compared)
    assert 0 < tp2_error <= q4_error, (tp2_error, q4_error)
    base, ours = runs["q4"][first_split], runs["tp2_q4"][first_split]
    for row in torch.nonzero(base.argmax(-1) != ours.argmax(-1)).flatten().tolist():
        top2 = base[row].topk(2).values
        assert (top2[0] - top2[1]).item() <= q4_error, (row, top2)


def test_a_multimodal_llama4_checkpoint_is_read_as_its_text_model_slices(family_checkpoint: Any,
                                                                         tmp_path: Path) -> None:
    """Llama4ForConditionalGeneration's files: language_model.* tensors lose the prefix, the vision
    tower is not read; a rank's slices are those of the text checkpoint."""
    import json

    from safetensors.torch import load_file, save_file

    from engine.parallel.loading import load_rank_weights

    text = family_checkpoint("llama4_text")
    config = json.loads((text / "config.json").read_text())
    (tmp_path
     / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": config}))
    tensors = {"language_model." + n: t
               for n, t in load_file(str(text / "model.safetensors")).items()}
    save_file({**tensors, "vision_model.patch_embedding.weight": torch.zeros(4, 4)},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _, want = load_rank_weights(text, 1, 2)
    full_config, got = load_rank_weights(tmp_path, 1, 2)
    assert full_config.architecture == "llama4_text" and set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    experts, inter = config["num_local_experts"], config["intermediate_size"]
    # [E, Hd, 2I / 2]
    assert got["model.layers.1.feed_forward.experts.gate_up_proj"].shape == (experts, 64, inter)


def test_what_the_families_cannot_split_is_one_line() -> None:
    from engine.config import GroupedTopK, MLAConfig, ModelConfig
    from engine.parallel.shard import tensor_slices

    mla = MLAConfig(kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16)
    deepseek = ModelConfig(architecture="deepseek_v3", vocab_size=100, hidden_size=64,
                           intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=1,
                           head_dim=40, max_position_embeddings=64,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mla=mla,
                           grouped_topk=GroupedTopK(1, 1, 1.0))
    with pytest.raises(TensorParallelConfigError,
                       match="deepseek_v3: 4 attention heads do not split across 3"):
        plan_shard(deepseek, 0, 3)
    plan = plan_shard(deepseek, 1, 2)  # heads 2, 3: their q rows and kv_b rows, o_proj columns
    assert tensor_slices("model.layers.0.self_attn.kv_b_proj.weight", (128, 32), deepseek,
                         plan) == ([range(64, 128)], None)
    assert tensor_slices("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (40, 64), deepseek,
                         plan) == (None, None)  # the latent: replicated
    gpt_oss = ModelConfig(architecture="gpt_oss", vocab_size=100, hidden_size=64,
                          intermediate_size=2880, num_layers=2, num_heads=8, num_kv_heads=4,
                          head_dim=16, max_position_embeddings=64,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=2880,
                          layer_types=("sliding_attention", "full_attention"), sliding_window=8)
    # 90 blocks: 22 + 23 + 22 + 23
    cuts = [plan_shard(gpt_oss, r, 4).expert_intermediate for r in range(4)]
    assert [len(c) // 32 for c in cuts] == [22, 23, 22, 23] and cuts[-1].stop == 2880
    assert all(c.start % 32 == 0 for c in cuts)
    olmoe = ModelConfig(architecture="olmoe", vocab_size=100, hidden_size=64, intermediate_size=96,
                        num_layers=1, num_heads=4, num_kv_heads=1, head_dim=16,
                        max_position_embeddings=64, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, qk_norm="projection")
    with pytest.raises(TensorParallelConfigError,
                       match="q/k norm over all heads is not split with kv heads rep"):
        plan_shard(olmoe, 0, 2)  # (the norm's sums would count a replicated kv head twice)
    # one block cannot go to two ranks
    small = dataclasses.replace(gpt_oss, moe_intermediate_size=32)
    with pytest.raises(TensorParallelConfigError,
                       match="MXFP4 experts split in whole blocks of 32"):
        tensor_slices("model.layers.0.mlp.experts.down_proj_blocks", (4, 64, 1, 16), small,
                      plan_shard(small, 0, 2))


def _gguf_of(family: str, directory: Path, path: Path) -> None:
    """The family's tiny checkpoint as the GGUF file llama.cpp's converter writes
    (tests/engine/models/ writers)."""
    if family == "gpt_oss":
        from tests.engine.models._gpt_oss import write_gguf

        write_gguf(directory, path)
    elif family == "deepseek_v3":  # the writer reads dense projections: the FP8 file's dense twin
        import json
        import shutil

        from safetensors.torch import load_file, save_file

        from engine.loader.fp8_blocks import dequantize_checkpoint
        from tests.engine.models.test_deepseek_v3_gguf import write_deepseek2_gguf

        twin = path.parent / "dense"
        shutil.copytree(directory, twin)
        tensors = load_file(str(directory / "model.safetensors"))
        dequantize_checkpoint(tensors, (16, 16), torch.float32)
        save_file(tensors, str(twin / "model.safetensors"), metadata={"format": "pt"})
        raw = json.loads((twin / "config.json").read_text())
        raw.pop("quantization_config")
        (twin / "config.json").write_text(json.dumps(raw))
        write_deepseek2_gguf(twin, path)
    else:
        from tests.engine.models.test_gemma3_llama4_gguf import write_gemma3_gguf, write_llama4_gguf

        (write_gemma3_gguf if family == "gemma3_text" else write_llama4_gguf)(directory, path)


@pytest.mark.parametrize("family", ["gemma3_text", "llama4_text", "gpt_oss", "deepseek_v3"])
def test_a_family_gguf_is_cut_into_shards_its_rank_model_takes_whole(family: str,
                                                                     family_checkpoint: Any,
                                                                     tmp_path: Path) -> None:
    """These families' GGUF files are loaded whole and cut: every rank's tensors have the shapes of
    its local config and none is left over (the model takes each by shape and refuses leftovers)."""
    from engine.layers import make_linear_factory
    from engine.layers.attention import build_attention_backend
    from engine.models.registry import build_model
    from engine.parallel.loading import load_rank_weights

    path = tmp_path / f"{family}.gguf"
    _gguf_of(family, family_checkpoint(family), path)
    make_linear = make_linear_factory(EngineConfig(model_path=str(path), decode_weights="float"),
                                      torch.device("cpu"), {})
    for rank in (0, 1):
        config, weights = load_rank_weights(path, rank, 2)
        local = local_config(config, plan_shard(config, rank, 2))
        model = build_model(local, weights, build_attention_backend("torch"), make_linear)
        # (build_model pops what it takes)
        assert not weights and len(model.layers) == config.num_layers
        assert local.num_heads == config.num_heads // 2


def test_gpt_oss_dense_experts_split_into_partial_sums_of_the_whole(tmp_path: Path) -> None:
    """The dense expert layout (save_pretrained's interleaved gate/up [E, Hd, 2I], down [E, I, Hd],
    biases): the ranks' expert outputs add up to the unsplit layer's, the down bias counted once."""
    import transformers

    from engine.layers import make_linear_factory
    from engine.layers.attention import build_attention_backend
    from engine.loader import load_checkpoint
    from engine.models.registry import build_model
    from engine.parallel.families import parallelize
    from engine.parallel.loading import load_rank_weights
    from tests.engine.models._gpt_oss import make_config, write_tokenizer

    config = make_config(write_tokenizer(tmp_path))
    config.intermediate_size, config.num_hidden_layers = 64, 2
    config.layer_types = config.layer_types[:2]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # (transformers starts the biases at zero)
        for name, param in model.named_parameters():
            if name.endswith("_bias"):
                param.normal_(0.0, 1.0)
    model.eval().save_pretrained(tmp_path)
    make_linear = make_linear_factory(EngineConfig(model_path=str(tmp_path),
                                                   decode_weights="float"),
                                      torch.device("cpu"), {})

    def build(model_config: Any, weights: dict) -> Any:  # type: ignore[type-arg]
        return build_model(model_config, weights, build_attention_backend("torch"), make_linear)

    full = load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
    whole = build(full.config, dict(full.weights))
    x = torch.randn(5, full.config.hidden_size)
    partial = torch.zeros_like(x)
    for rank in (0, 1):
        model_config, weights = load_rank_weights(tmp_path, rank, 2)
        plan = plan_shard(model_config, rank, 2)
        shard = build(local_config(model_config, plan), weights)
        parallelize(shard, plan)  # rank 1's down bias: zeros
        assert shard.layers[0].mlp.experts.w13.shape[1] == 64  # 2I / 2
        partial += shard.layers[0].mlp(x)
    torch.testing.assert_close(partial, whole.layers[0].mlp(x), rtol=0, atol=1e-5)


def test_a_gemma3_rank_without_sliding_layers_keeps_the_general_forward(family_checkpoint: Any,
                                                                         tmp_path: Path) -> None:
    """The ranks' native steps take only Llama-shaped layers: a Gemma 3 rank (gate_up / down, no
    `mlp`) with every layer global is passed by, not an error at start."""
    import json
    import shutil

    from engine.layers import make_linear_factory
    from engine.layers.attention import build_attention_backend
    from engine.models.registry import build_model
    from engine.parallel.layers import parallelize
    from engine.parallel.loading import load_rank_weights
    from engine.parallel.native_step import parallel_native_step

    directory = tmp_path / "global"
    shutil.copytree(family_checkpoint("gemma3_text"), directory)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    config, weights = load_rank_weights(directory, 0, 2)
    plan = plan_shard(config, 0, 2)
    make_linear = make_linear_factory(EngineConfig(model_path=str(directory),
                                                   decode_weights="float"),
                                      torch.device("cpu"), {})
    model = build_model(local_config(config, plan), weights, build_attention_backend("torch"),
                        make_linear)
    assert not model.config.has_sliding_layers
    parallelize(model, plan, None)  # type: ignore[arg-type]  # (wrapping calls no collective)
    assert parallel_native_step(model, "float", None) is None  # type: ignore[arg-type]
    assert parallel_native_step(model, "q4", None) is None  # type: ignore[arg-type]
