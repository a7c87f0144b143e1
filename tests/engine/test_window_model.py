"""A tiny Llama-shaped model with alternating sliding-window and full layers, served by the engine
(chunked prefill, prefix-cache hits across KV cache groups, preemption), against a dense torch
reference written here from the definitions (a query at p sees p-W+1..p on window layers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.testing import RandomEngine, placeholder_tokenizer, random_weights

WINDOW = 24
CONFIG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=512,
                     layer_types=("sliding_attention", "full_attention") * 2, sliding_window=WINDOW,
                     model_id="tiny-window")
NUM_NEW = 20
BYTES_PER_BLOCK = 2 * 16 * 2 * 2 * 16 * 4  # 2 tensor slots x 16 tokens x K,V x G x Dh x fp32


def _weights() -> dict[str, torch.Tensor]:
    weights = random_weights(CONFIG, torch.device("cpu"), torch.float32, seed=3)
    return {k: v if "norm" in k else v * 10 for k, v in weights.items()}  # peaky attention


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG.rms_norm_eps) * w


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    dh = x.shape[-1]
    inv_freq = 1.0 / (CONFIG.rope_theta ** (torch.arange(0, dh, 2).float() / dh))
    freqs = torch.outer(positions.float(), inv_freq)  # [T, Dh/2]
    cos, sin = (torch.cat([freqs, freqs], -1).cos()[:, None],
                torch.cat([freqs, freqs], -1).sin()[:, None])
    rotated = torch.cat([-x[..., dh // 2:], x[..., :dh // 2]], -1)
    return x * cos + rotated * sin


def reference_logits(w: dict[str, torch.Tensor], ids: list[int],
                     windows: bool = True) -> torch.Tensor:
    """Dense causal forward over the whole sequence -> the last position's logits [vocab]."""
    cfg = CONFIG
    t = len(ids)
    positions = torch.arange(t)
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]  # [T, hidden]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, cfg.num_heads, cfg.head_dim)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = _rotate(q, positions), _rotate(k, positions)
        k = k.repeat_interleave(cfg.num_queries_per_kv, dim=1)  # [T, H, Dh]
        v = v.repeat_interleave(cfg.num_queries_per_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * cfg.head_dim ** -0.5  # [H, T, T]
        allowed = positions[None, :] <= positions[:, None]
        window = cfg.layer_sliding_window(i)
        if windows and window is not None:
            allowed &= positions[None, :] > positions[:, None] - window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(t, -1)  # [T, H * Dh]
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["model.norm.weight"])[-1] @ w["lm_head.weight"].T


def reference_greedy(w: dict[str, torch.Tensor], prompt: list[int],
                     windows: bool = True) -> list[int]:
    ids = list(prompt)
    for _ in range(NUM_NEW):
        ids.append(int(reference_logits(w, ids, windows).argmax()))
    return ids[len(prompt):]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, CONFIG.vocab_size, (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


BASE = [_prompt(70, 1), _prompt(45, 2), _prompt(90, 3)]
SHARED = [BASE[0][:64] + _prompt(9, 4), BASE[2] + _prompt(5, 5), BASE[0]]  # prefix hits


@pytest.fixture(scope="module")
def expected() -> dict[tuple[int, ...], list[int]]:
    w = _weights()
    return {tuple(p): reference_greedy(w, p) for p in BASE + SHARED}


def _engine(num_blocks: int) -> RandomEngine:
    config = EngineConfig(model_path="<random>", device="cpu", dtype="float32", num_threads=1,
                          cache=CacheConfig(kv_cache_memory_bytes=num_blocks * BYTES_PER_BLOCK),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8))
    runner = ModelRunner(config, CONFIG, _weights())
    assert runner.num_blocks == num_blocks
    return RandomEngine(LLMEngine(config, CONFIG, runner, placeholder_tokenizer(CONFIG.vocab_size)))


def _assert_clean(engine: RandomEngine) -> None:
    kv = engine.engine.kv_cache
    kv.check_integrity()
    assert kv.num_requests == 0 and kv.num_free_blocks == kv.num_blocks


def test_windows_change_what_the_reference_generates() -> None:
    w = _weights()
    assert any(reference_greedy(w, p) != reference_greedy(w, p, windows=False) for p in BASE)


def test_engine_with_window_layers_matches_the_dense_reference_with_prefix_hits(expected) -> None:
    engine = _engine(64)
    assert engine.engine.kv_cache.group_windows == (None, WINDOW)
    first = engine.generate(BASE, NUM_NEW)
    assert [g.token_ids for g in first] == [expected[tuple(p)] for p in BASE]
    second = engine.generate(SHARED, NUM_NEW)
    assert [g.token_ids for g in second] == [expected[tuple(p)] for p in SHARED]
    assert engine.engine.stats().num_prefix_cache_hit_tokens >= 64 + 80 + 64
    _assert_clean(engine)


def test_engine_with_window_layers_matches_the_reference_under_preemption(expected) -> None:
    engine = _engine(22)
    results = engine.generate(BASE + SHARED, NUM_NEW)
    assert [g.token_ids for g in results] == [expected[tuple(p)] for p in BASE + SHARED]
    assert engine.engine.scheduler.num_preemptions_total > 0
    _assert_clean(engine)


def test_native_decode_step_refuses_window_layers() -> None:
    """The native CPU decode kernel attends to the whole context: windowed models keep the general
    forward (whose attention applies the window), full-attention twins may take it."""
    from dataclasses import replace

    from engine.layers import make_linear_factory
    from engine.layers.torch_attention import TorchPagedAttention
    from engine.models.llama_decode import native_step
    from engine.models.registry import build_model

    config = EngineConfig(model_path="<random>", device="cpu", dtype="float32", num_threads=1,
                          cache=CacheConfig(kv_cache_memory_bytes=64 * BYTES_PER_BLOCK))
    windowed = ModelRunner(config, CONFIG, _weights())
    assert windowed._native_decode is None
    assert native_step(windowed.model, "float") is None
    twin = replace(CONFIG, layer_types=None, sliding_window=None)
    make_linear = make_linear_factory(config, torch.device("cpu"), {})
    twin_model = build_model(twin, _weights(), TorchPagedAttention(), make_linear)
    twin_step = native_step(twin_model, "float")
    assert twin_step is not None and twin_step.name == "FloatDecodeStep"
