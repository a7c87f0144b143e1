"""Gemma 3 text, served by the engine from a tiny random checkpoint that transformers wrote
(tests/engine/models/_gemma3.py: local window 20 between global layers, two rope bases, soft-capped
logits): greedy tokens equal transformers' and their logprobs agree within 2e-3 (float32) on a
prompt several windows long, alone with chunked prefill, among 8 concurrent requests, after a
prefix-cache hit and under preemption; every KV block comes back. Config refusals are one line."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jinja2
import pytest
import torch

from chat.registry import chat_format_for
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.kv_cache.layout import KVCacheLayout, kv_bytes_per_sequence, kv_bytes_per_token
from engine.loader.checkpoint import UnsupportedCheckpointError
from engine.loader.hf_checkpoint import model_config_from_hf
from tests.engine.fakes import assert_idle_and_clean, generate
from tests.engine.models import _serving_checks as serving
from tests.engine.models._gemma3 import SLIDING_WINDOW
from tests.engine.models._greedy import hf_greedy
from tests.engine.models._qwen3 import TinyCheckpoint
from tests.engine.models._serving_checks import (
    EngineFactory,
    assert_matches_transformers,
)
from tests.engine.models.test_qwen3 import GREEDY, NUM_NEW_TOKENS, OTHERS, TARGET


@pytest.fixture(scope="module")
def make_engine(gemma3_checkpoint: TinyCheckpoint) -> EngineFactory:
    return functools.partial(serving.make_engine, gemma3_checkpoint.directory,
                             max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    """32 tokens a step: the target prompt prefills in several chunks."""
    return make_engine()


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> dict[str, list[int]]:
    encoded = serving.encode_chat_prompts(engine, TARGET, OTHERS, system="be brief")
    assert len(encoded["target"]) > 3 * SLIDING_WINDOW  # the local layers' window slides
    assert len(encoded["target"]) > 2 * 32  # prefilled in 3 or more chunks of the step budget
    return encoded


@pytest.fixture(scope="module")
def expected(gemma3_checkpoint: TinyCheckpoint, prompts: dict[str, list[int]]
             ) -> tuple[list[int], list[float]]:
    return serving.transformers_reference(gemma3_checkpoint.model, prompts["target"],
                                          NUM_NEW_TOKENS)


def test_gemma_template_renders_bos_model_role_and_system_in_the_first_turn(
        engine: LLMEngine) -> None:
    text = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "jazz?"}])
    assert text == ("<bos><start_of_turn>user\nbe brief\n\nhi<end_of_turn>\n<start_of_turn>model\n"
                    "hello<end_of_turn>\n<start_of_turn>user\njazz?<end_of_turn>\n<start_of_turn>model\n")
    assert chat_format_for("gemma3_text", engine.tokenizer.chat_template.source).name == "hermes"
    with pytest.raises(jinja2.TemplateError, match="alternate"):  # the replica answers it as a 400
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "a"},
                                              {"role": "user", "content": "b"}])


def test_greedy_tokens_and_logprobs_equal_transformers_with_chunked_prefill(
        engine: LLMEngine, prompts: dict[str, list[int]],
        expected: tuple[list[int], list[float]]) -> None:
    assert len(engine.runner.kv_layout.groups) > 1  # the local layers hold their own blocks
    result = generate(engine, {"target": prompts["target"]}, GREEDY)["target"]
    assert_matches_transformers(result, expected)
    assert_idle_and_clean(engine)


def test_same_tokens_among_8_concurrent_requests_and_after_a_prefix_cache_hit(
        engine: LLMEngine, prompts: dict[str, list[int]],
        expected: tuple[list[int], list[float]]) -> None:
    serving.check_same_tokens_together_and_after_a_prefix_hit(engine, prompts, expected, GREEDY)


def test_outputs_under_preemption_equal_the_roomy_engines(
        engine: LLMEngine, make_engine: EngineFactory, prompts: dict[str, list[int]],
        expected: tuple[list[int], list[float]]) -> None:
    # 32 blocks: one request fits (window groups included), the 8 together do not
    serving.check_preemption_matches_roomy(engine, make_engine, prompts, expected[0], num_blocks=32)


def test_a_checkpoint_without_window_layers_matches_transformers_on_the_general_forward(
        gemma3_checkpoint: TinyCheckpoint, prompts: dict[str, list[int]], tmp_path: Path) -> None:
    """Every layer global (layer_types all full_attention): one KV group; the native float decode
    step (Llama layers only) is not taken."""
    import transformers

    directory = tmp_path / "global-only"
    shutil.copytree(gemma3_checkpoint.directory, directory)
    config = json.loads((directory / "config.json").read_text())
    config |= {"layer_types": ["full_attention"] * config["num_hidden_layers"]}
    (directory / "config.json").write_text(json.dumps(config))
    reference = transformers.Gemma3ForCausalLM.from_pretrained(directory,
                                                               dtype=torch.float32).eval()
    expected = hf_greedy(reference, prompts["target"], NUM_NEW_TOKENS)
    engine = LLMEngine.from_config(EngineConfig(
        model_path=str(directory), num_threads=1, dtype="float32",
        cache=CacheConfig(kv_cache_memory_bytes=4 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16)), progress=False)
    assert len(engine.runner.kv_layout.groups) == 1 and engine.runner._native_decode is None
    result = generate(engine, {"target": prompts["target"]}, GREEDY)["target"]
    assert_matches_transformers(result, expected)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0 is not supported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True is not supported"),
    ("hidden_activation", "gelu", "hidden_activation 'gelu' is not supported"),
])
def test_a_setting_no_backend_runs_is_refused_in_one_line(
        gemma3_checkpoint: TinyCheckpoint, tmp_path: Path, field: str, value: object,
        message: str) -> None:
    directory = tmp_path / "changed"
    directory.mkdir()
    shutil.copy(gemma3_checkpoint.directory / "config.json", directory / "config.json")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {field: value}))
    with pytest.raises(UnsupportedCheckpointError, match=message):
        model_config_from_hf(directory)


def test_released_4x_config_fields_map_to_the_same_layers_and_ropes(tmp_path: Path) -> None:
    """A transformers 4.x gemma-3 config.json: flat rope fields and sliding_window_pattern."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 512, "sliding_window": 16, "sliding_window_pattern": 6,
        "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
        "attn_logit_softcapping": None}))
    config = model_config_from_hf(tmp_path)
    assert [config.layer_sliding_window(i) for i in range(7)] == [16] * 5 + [None, 16]
    assert (config.rope_theta == 1e6
            and dict(config.rope_scaling or ()) == {"rope_type": "linear", "factor": 8.0})
    assert config.gemma is not None and config.gemma.local_rope_theta == 1e4
    assert config.tie_word_embeddings and config.gemma.final_logit_softcapping is None


# Released text configs: hidden, layers, heads, kv heads, head_dim, window, max positions
RELEASED = {"gemma-3-1b": (1152, 26, 4, 1, 256, 512, 32768),
            "gemma-3-4b": (2560, 34, 8, 4, 256, 1024, 131072),
            "gemma-3-12b": (3840, 48, 16, 8, 256, 1024, 131072),
            "gemma-3-27b": (5376, 62, 32, 16, 128, 1024, 131072)}


@pytest.mark.parametrize(("name", "full_layers", "per_token", "with_windows_mib", "full_mib"), [
    ("gemma-3-1b", 4, 4_096, 140, 832), ("gemma-3-4b", 5, 20_480, 760, 4_352),
    ("gemma-3-12b", 8, 65_536, 2_368, 12_288), ("gemma-3-27b", 10, 81_920, 3_040, 15_872)])
def test_released_shapes_keep_kv_for_the_global_layers_and_one_window_of_the_local_ones(
        tmp_path: Path, name: str, full_layers: int, per_token: int, with_windows_mib: int,
        full_mib: int) -> None:
    """bf16 KV, block size 16, one sequence decoding at 32,768 tokens (docs/models.md's figures)."""
    hidden, layers, heads, kv_heads, head_dim, window, positions = RELEASED[name]
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3_text", "vocab_size": 262_144, "hidden_size": hidden,
        "intermediate_size": 4 * hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": positions,
        "sliding_window": window, "sliding_window_pattern": 6}))
    config = model_config_from_hf(tmp_path)
    assert sum(config.layer_sliding_window(i) is None for i in range(layers)) == full_layers
    assert kv_bytes_per_token(config, 2) * full_layers == per_token
    hybrid = kv_bytes_per_sequence(KVCacheLayout.for_model(config, positions), config, 32_768, 16,
                                   2)
    full = kv_bytes_per_sequence(KVCacheLayout.full_attention(layers), config, 32_768, 16, 2)
    assert (hybrid / 2**20, full / 2**20) == (with_windows_mib, full_mib)
