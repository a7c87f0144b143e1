"""Sliding windows and sinks in both attention backends, on a mixed batch built by ModelRunner
(plain decodes, a cascade group sharing a prefix, a fresh prefill, a chunk after a cached prefix):
the torch backend (CPU engine) and the Triton backend (interpreter on CPU) against the kernels'
torch reference, which tests/engine/kernels/test_paged_attention_variants.py checks against
transformers' semantics."""

from __future__ import annotations

import os

import pytest
import torch

from engine.batch import ScheduledSequence
from engine.config import ModelConfig
from engine.kernels.paged_attention import paged_attention_reference
from engine.layers.torch_attention import TorchPagedAttention
from engine.layers.triton_attention import TritonPagedAttention
from engine.testing import random_weights
from tests.engine.models._greedy import BLOCK_SIZE, make_runner
from tests.engine.models.test_triton_attention import CONFIG, mixed_batch

VARIANTS = {"window_8": (8, False), "window_40": (40, False), "sinks": (None, True),
            "window_20_and_sinks": (20, True)}


def _step(dtype: torch.dtype):
    runner = make_runner(CONFIG, random_weights(CONFIG, torch.device("cpu"), torch.float32))
    seqs = mixed_batch()
    decodes, num_plain, groups = runner._plan_decodes([s for s in seqs
                                                       if s.num_scheduled_tokens == 1])
    assert groups, "the batch should form a cascade group"
    _, _, (meta,) = runner._prepare(decodes, [s for s in seqs if s.num_scheduled_tokens > 1],
                                    num_plain, groups)
    gen = torch.Generator().manual_seed(0)
    num_tokens = int(meta.cu_query_lens[-1])
    q = torch.randn(num_tokens, 4, 16, generator=gen).to(dtype)  # [T, H, Dh]
    k = torch.randn(num_tokens, 2, 16, generator=gen).to(dtype)  # [T, G, Dh]
    v = torch.randn(num_tokens, 2, 16, generator=gen).to(dtype)
    cache_shape = (48, BLOCK_SIZE, 2, 16)  # [num_blocks, block_size, G, Dh]
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    sinks = torch.randn(4, generator=gen) * 2
    return meta, q, k, v, k_cache, v_cache, sinks


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_torch_backend_matches_reference_with_windows_and_sinks(variant: str) -> None:
    window, with_sinks = VARIANTS[variant]
    meta, q, k, v, k_cache, v_cache, sinks = _step(torch.float32)
    sinks = sinks if with_sinks else None
    out = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, 0.25, meta,
                                        sliding_window=window, sinks=sinks)
    expected = paged_attention_reference(q, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens,
                                         meta.block_tables, 0.25, sliding_window=window,
                                         sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_a_window_changes_only_rows_that_reach_past_it() -> None:
    meta, q, k, v, k_cache, v_cache, _ = _step(torch.float32)
    full = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, 0.25, meta)
    windowed = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, 0.25, meta,
                                             sliding_window=40)
    starts, lens = meta.cu_query_lens.tolist(), meta.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        rows = slice(starts[i], starts[i + 1])
        first_pos = seq_len - (starts[i + 1] - starts[i])
        if seq_len <= 40:  # every row's context fits the window
            torch.testing.assert_close(windowed[rows], full[rows])
        elif first_pos >= 40:  # every row reaches past it
            assert (windowed[rows] - full[rows]).abs().amax(dim=(1, 2)).min() > 1e-4


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", ["window_20_and_sinks", "window_8"])
def test_triton_backend_matches_torch_backend_with_windows_and_sinks(
        variant: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    window, with_sinks = VARIANTS[variant]
    meta, q, k, v, k_cache, v_cache, sinks = _step(dtype)
    sinks = sinks if with_sinks else None
    k_ref, v_ref = k_cache.float(), v_cache.float()
    expected = TorchPagedAttention().forward(q.float(), k.float(), v.float(), k_ref, v_ref, 0.25,
                                             meta, sliding_window=window, sinks=sinks)
    monkeypatch.setattr("engine.kernels.FORCED_BACKEND", "triton")
    actual = TritonPagedAttention().forward(q, k, v, k_cache, v_cache, 0.25, meta,
                                            sliding_window=window, sinks=sinks)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


WINDOWED = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=32,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_position_embeddings=512,
                       layer_types=("sliding_attention", "full_attention"), sliding_window=20)


def windowed_batch() -> list[ScheduledSequence]:
    """Group 1 (window 20) tables hold None where the window released a block (as the manager
    leaves them): decodes at 40 and 3, a fresh prefill, a chunk of 13 after 35 cached tokens."""
    return [ScheduledSequence("decode-40", [1], 40, [1, 2, 3], True,
                              extra_block_tables=([None, 21, 22],)),
            ScheduledSequence("decode-3", [1], 3, [4], True, extra_block_tables=([23],)),
            ScheduledSequence("fresh", [1] * 21, 0, [5, 6], True, extra_block_tables=([40, 41],)),
            ScheduledSequence("chunk", [1] * 13, 35, [7, 8, 9], True,
                              extra_block_tables=([None, 43, 44],))]


@pytest.mark.parametrize("with_sinks", [False, True])
def test_runner_built_window_metadata_skips_released_blocks_in_both_backends(
        with_sinks: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make_runner(WINDOWED, random_weights(WINDOWED, torch.device("cpu"), torch.float32))
    assert runner.kv_layout.group_windows == (None, 20)
    seqs = windowed_batch()
    _, _, (full_meta, window_meta) = runner._prepare(seqs[:2], seqs[2:], 2, [])
    assert window_meta.decode_first_positions.tolist() == [16, 0]  # decode-40 gathers from block 1
    assert window_meta.prefills[1].context_start == 16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(36, 4, 16, generator=gen)  # [T, H, Dh]
    k, v = torch.randn(36, 2, 16, generator=gen), torch.randn(36, 2, 16, generator=gen)
    k_cache = torch.randn(48, BLOCK_SIZE, 2, 16, generator=gen)
    v_cache = torch.randn(48, BLOCK_SIZE, 2, 16, generator=gen)
    k_cache[0], v_cache[0] = 1e4, -1e4  # what a released block's table entry points at
    sinks = torch.randn(4, generator=gen) if with_sinks else None
    out = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, 0.25, window_meta,
                                        sliding_window=20, sinks=sinks)
    expected = paged_attention_reference(q, k_cache, v_cache, window_meta.cu_query_lens,
                                         window_meta.seq_lens, window_meta.block_tables, 0.25,
                                         sliding_window=20, sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert out.abs().max() < 100  # nothing of the poisoned block leaked in
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.setenv("AIGW_KERNELS", "triton")
        k2, v2 = k_cache.clone(), v_cache.clone()
        actual = TritonPagedAttention().forward(q, k, v, k2, v2, 0.25, window_meta,
                                                sliding_window=20, sinks=sinks)
        torch.testing.assert_close(actual, expected, rtol=2e-4, atol=2e-4)
