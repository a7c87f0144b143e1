"""Llama 4 text, served by the engine from tiny random checkpoints that transformers wrote
(tests/engine/models/_llama4.py: chunked local attention of 24 on the RoPE layers, a NoPE global
layer with temperature tuning, L2 q/k norm; all-dense, and MoE every other layer with a sigmoid
top-1 router and a shared expert): greedy tokens equal transformers' and their logprobs agree within
2e-3 (float32) on a prompt several chunks long, prefilled in chunks of the step budget, among 8
concurrent requests, after prefix-cache hits (one branching inside a chunk) and under preemption;
every KV block comes back. Config refusals are one line."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from contracts.sampling_params import SamplingParams
from engine.engine import LLMEngine
from engine.kv_cache.layout import KVCacheLayout, kv_bytes_per_sequence, kv_bytes_per_token
from engine.loader.checkpoint import UnsupportedCheckpointError
from engine.loader.hf_checkpoint import model_config_from_hf
from tests.engine.fakes import assert_idle_and_clean, drive, generate
from tests.engine.models import _serving_checks as serving
from tests.engine.models._greedy import hf_greedy
from tests.engine.models._llama4 import CHUNK_SIZE, VARIANTS
from tests.engine.models._qwen3 import TinyCheckpoint
from tests.engine.models._serving_checks import (
    EngineFactory,
    assert_matches_transformers,
)
from tests.engine.models.test_qwen3 import GREEDY, NUM_NEW_TOKENS, OTHERS, TARGET

STEP_TOKENS = 32  # the engine's step budget: the target prompt prefills in several chunks


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest,
            llama4_checkpoints: dict[str, TinyCheckpoint]) -> TinyCheckpoint:
    return llama4_checkpoints[request.param]


@pytest.fixture(scope="module")
def make_engine(variant: TinyCheckpoint) -> EngineFactory:
    return functools.partial(serving.make_engine, variant.directory,
                             max_num_batched_tokens=STEP_TOKENS)


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> dict[str, list[int]]:
    encoded = serving.encode_chat_prompts(engine, TARGET, OTHERS, system="be brief")
    assert len(encoded["target"]) > 4 * CHUNK_SIZE  # the RoPE layers attend within 4+ chunks
    assert len(encoded["target"]) > 2 * STEP_TOKENS
    return encoded


@pytest.fixture(scope="module")
def expected(variant: TinyCheckpoint,
             prompts: dict[str, list[int]]) -> tuple[list[int], list[float]]:
    return serving.transformers_reference(variant.model, prompts["target"], NUM_NEW_TOKENS)


def test_greedy_tokens_and_logprobs_equal_transformers_with_chunked_prefill(
        variant: TinyCheckpoint, engine: LLMEngine, prompts: dict[str, list[int]],
        expected: tuple[list[int], list[float]]) -> None:
    config = engine.runner.model.config
    assert config.llama4 is not None and config.llama4.rope_layers == (True, True, False, True)
    assert bool(config.llama4.moe_layers) == (variant.name == "llama4-moe")
    assert engine.runner._native_decode is None  # the general forward: chunks and NoPE layers
    result = generate(engine, {"target": prompts["target"]}, GREEDY)["target"]
    assert_matches_transformers(result, expected)
    assert_idle_and_clean(engine)


def test_chunk_groups_release_the_blocks_of_chunks_left_behind(
        engine: LLMEngine, prompts: dict[str, list[int]]) -> None:
    """The RoPE layers' groups keep only the blocks of the chunk the next token is in (plus the
    step's), the NoPE layer's group the whole context; the tokens are the same with or without
    it."""
    layout, manager = engine.runner.kv_layout, engine.kv_cache
    assert layout.groups[0].is_full and layout.groups[0].layers == (2,)
    chunk_groups = [g for g, c in enumerate(layout.group_chunks) if c == CHUNK_SIZE]
    assert [layout.groups[g].layers for g in chunk_groups] == [(0,), (1,), (3,)]
    # (context tokens, blocks per chunk group) before each step
    held: list[tuple[int, list[int]]] = []

    def record(_: int) -> None:
        manager.check_integrity()
        running = [r for r in engine.scheduler.running if r.request_id == "target"]
        if running and manager.num_requests:
            request = running[0]
            held.append((request.num_computed_tokens,
                         [manager.num_held_blocks("target", g) for g in chunk_groups]))

    engine.add_request("target", prompts["target"], SamplingParams(temperature=0.0, max_tokens=12,
                                                                   ignore_eos=True))
    drive(engine, on_step=record)
    assert held, "the target was never seen holding blocks"
    num_tokens, last = held[-1]
    assert num_tokens > 4 * CHUNK_SIZE
    chunk_start = num_tokens // CHUNK_SIZE * CHUNK_SIZE
    assert last == [-(-(num_tokens + 1) // 16) - chunk_start // 16] * 3  # its chunk's blocks only
    assert max(max(blocks) for _, blocks in held) <= -(-(CHUNK_SIZE - 1 + STEP_TOKENS) // 16) + 1
    assert_idle_and_clean(engine)


def test_same_tokens_among_8_concurrent_requests_and_after_a_prefix_cache_hit(
        engine: LLMEngine, prompts: dict[str, list[int]],
        expected: tuple[list[int], list[float]]) -> None:
    serving.check_same_tokens_together_and_after_a_prefix_hit(engine, prompts, expected, GREEDY)


def test_a_branch_inside_a_chunk_is_served_from_the_prefix_cache(
        variant: TinyCheckpoint, engine: LLMEngine, prompts: dict[str, list[int]],
        expected: tuple[list[int], list[float]]) -> None:
    """The hit ends at 32 tokens, inside the chunk 24..47: the first computed token reads the
    cached 24..31 of its chunk and none before."""
    serving.check_prefix_cache_hit(engine, variant.model, prompts["target"], expected[0],
                                   SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS,
                                                  ignore_eos=True))


def test_outputs_under_preemption_equal_the_roomy_engines(
        variant: TinyCheckpoint, engine: LLMEngine, make_engine: EngineFactory,
        prompts: dict[str, list[int]], expected: tuple[list[int], list[float]]) -> None:
    # 40 blocks: one request fits (its chunk groups' blocks included), the 8 together do not
    serving.check_preemption_matches_roomy(engine, make_engine, prompts, expected[0], num_blocks=40)


def test_the_chunks_bind_on_this_prompt(variant: TinyCheckpoint,
                                        prompts: dict[str, list[int]]) -> None:
    """transformers' own logits change when the chunk is lifted, so the parity above checks the
    mask."""
    import transformers

    config = transformers.Llama4TextConfig.from_dict(variant.model.config.to_dict() | {
        "attention_chunk_size": None, "layer_types": None})
    unchunked = transformers.Llama4ForCausalLM(config).eval()
    unchunked.load_state_dict(variant.model.state_dict())
    ids = torch.tensor([prompts["target"]])
    with torch.inference_mode():
        chunked_logits, global_logits = (variant.model(input_ids=ids).logits,
                                         unchunked(input_ids=ids).logits)
    assert torch.allclose(chunked_logits[0, :CHUNK_SIZE], global_logits[0, :CHUNK_SIZE], atol=1e-5)
    assert (chunked_logits[0, -1] - global_logits[0, -1]).abs().max() > 1e-2


def _write_config(directory: Path, source: Path, **changes: object) -> Path:
    directory.mkdir()
    config = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | changes))
    return directory


@pytest.mark.parametrize(("changes", "message"), [
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"layer_types": ["full_attention"] * 4}, "disagree with no_rope_layers"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers names 2 layers, the model has 4"),
    ({"attention_chunk_size": 0}, "attention_chunk_size=0 must be >= 1"),
])
def test_a_setting_the_engine_does_not_run_is_refused_in_one_line(
        llama4_checkpoints: dict[str, TinyCheckpoint], tmp_path: Path, changes: dict[str, object],
        message: str) -> None:
    directory = _write_config(tmp_path / "changed", llama4_checkpoints["moe"].directory, **changes)
    with pytest.raises(UnsupportedCheckpointError, match=message):
        model_config_from_hf(directory)


def test_released_scout_and_maverick_fields_map_to_their_layers(tmp_path: Path) -> None:
    """Llama-4-Scout's text config (MoE every layer, NoPE every 4th) and Maverick's (MoE every
    other layer), as config.json states them: defaults fill no_rope_layers and moe_layers."""
    base = {"model_type": "llama4_text", "vocab_size": 202_048, "hidden_size": 5120,
            "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
            "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 10_485_760, "num_local_experts": 16,
            "num_experts_per_tok": 1, "attention_chunk_size": 8192, "rope_theta": 500_000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}
    scout = model_config_from_hf(_write_config(tmp_path / "scout", _json_dir(tmp_path / "s", base),
                                               interleave_moe_layer_step=1))
    maverick = model_config_from_hf(_write_config(
        tmp_path / "maverick", _json_dir(tmp_path / "m", base), interleave_moe_layer_step=2,
        num_local_experts=128, use_qk_norm=False))
    assert scout.llama4 is not None and maverick.llama4 is not None
    assert ([i for i, rope in enumerate(scout.llama4.rope_layers) if not rope]
            == list(range(3, 48, 4)))
    assert scout.llama4.moe_layers == tuple(range(48)) and scout.num_experts == 16
    assert maverick.llama4.moe_layers == tuple(range(1, 48, 2)) and not maverick.llama4.use_qk_norm
    assert scout.llama4.attention_chunk_size == 8192 and scout.llama4.floor_scale == 8192
    assert dict(scout.rope_scaling or ())["rope_type"] == "llama3"
    assert scout.layer_types is None and scout.layer_attention_chunk(0) == 8192
    assert scout.layer_attention_chunk(3) is None  # a NoPE layer: global
    # KV (bf16, block size 16, one sequence decoding; docs/models.md's figures): the 12 NoPE layers
    # keep the context, the 36 chunked ones only the current chunk's blocks
    assert kv_bytes_per_token(scout, 2) * 12 == 49_152
    layout = KVCacheLayout.for_model(scout, scout.max_position_embeddings)
    assert ([(g.attention_chunk, len(g.layers)) for g in layout.groups]
            == [(None, 12)] + [(8192, 12)] * 3)
    for num_tokens, chunked_mib, full_mib in ((32_768, 2_688, 6_144), (131_072, 7_296, 24_576)):
        chunked = kv_bytes_per_sequence(layout, scout, num_tokens, 16, 2)
        full = kv_bytes_per_sequence(KVCacheLayout.full_attention(48), scout, num_tokens, 16, 2)
        assert (chunked / 2**20, full / 2**20) == (chunked_mib, full_mib)


def _json_dir(directory: Path, config: dict[str, object]) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_multimodal_llama4_checkpoint_serves_its_text_model(
        llama4_checkpoints: dict[str, TinyCheckpoint], tmp_path: Path) -> None:
    """Llama4ForConditionalGeneration (model_type llama4, a tiny vision tower beside the MoE text
    model): the engine reads text_config and the language_model.* tensors only, and its tokens and
    logprobs are the text model's."""
    import transformers

    source = llama4_checkpoints["moe"]
    vision = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 64, "image_size": 28, "patch_size": 14, "vision_output_dim": 32,
              "projector_input_dim": 32, "projector_output_dim": 32, "pixel_shuffle_ratio": 0.5}
    config = transformers.Llama4Config(text_config=source.model.config.to_dict(),
                                       vision_config=vision)
    torch.manual_seed(1)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    model.language_model.load_state_dict(source.model.state_dict())
    directory = tmp_path / "multimodal"
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source.directory / name, directory / name)
    assert json.loads((directory / "config.json").read_text())["model_type"] == "llama4"
    engine = serving.make_engine(directory, max_num_batched_tokens=STEP_TOKENS)
    assert engine.runner.model.config.architecture == "llama4_text"
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": TARGET}])
    expected = hf_greedy(source.model, prompt, NUM_NEW_TOKENS)
    assert_matches_transformers(generate(engine, {"p": prompt}, GREEDY)["p"], expected)
    assert_idle_and_clean(engine)


def test_a_multimodal_config_without_a_text_config_is_refused_in_one_line(tmp_path: Path) -> None:
    directory = _json_dir(tmp_path / "mm", {"model_type": "llama4", "vision_config": {}})
    with pytest.raises(UnsupportedCheckpointError, match="llama4: config.json has no text_config"):
        model_config_from_hf(directory)
