"""MLA's absorbed attention on the CUDA backend (here the Triton interpreter on CPU tensors): one kv
head of a head dim that is no power of two (kv_lora_rank 32 + rope 8), K and V the one latent cache
tensor, matches TorchPagedAttention on the mixed batch of
tests/engine/models/test_triton_attention.py."""

from __future__ import annotations

import os

import pytest
import torch

from engine.layers.torch_attention import TorchPagedAttention
from engine.layers.triton_attention import TritonPagedAttention
from engine.testing import random_weights
from tests.engine.models._greedy import BLOCK_SIZE, make_runner
from tests.engine.models.test_triton_attention import CONFIG, mixed_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1 (set by "
                                       "tests/conftest.py)")

LATENT = 32 + 8  # kv_lora_rank + qk_rope_head_dim


def test_triton_backend_runs_latent_attention_as_the_torch_backend_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make_runner(CONFIG, random_weights(CONFIG, torch.device("cpu"), torch.float32))
    seqs = mixed_batch()
    decodes, num_plain, groups = runner._plan_decodes([s for s in seqs
                                                       if s.num_scheduled_tokens == 1])
    _, _, (meta,) = runner._prepare(decodes, [s for s in seqs if s.num_scheduled_tokens > 1],
                                    num_plain, groups)
    gen = torch.Generator().manual_seed(0)
    num_tokens = int(meta.cu_query_lens[-1])
    q = torch.randn(num_tokens, 4, LATENT, generator=gen)  # [T, H, R + P]: absorbed queries
    k = torch.randn(num_tokens, 1, LATENT, generator=gen)  # [T, 1, R + P]: latent + rope key
    cache = torch.randn(48, BLOCK_SIZE, 1, LATENT, generator=gen)  # K and V: one tensor
    reference_cache = cache.clone()

    expected = TorchPagedAttention().forward(q, k, k, reference_cache, reference_cache, 0.3, meta)
    monkeypatch.setattr("engine.kernels.FORCED_BACKEND", "triton")
    actual = TritonPagedAttention().forward(q, k, k, cache, cache, 0.3, meta)

    torch.testing.assert_close(cache, reference_cache, rtol=0, atol=0)
    torch.testing.assert_close(actual, expected, rtol=2e-4, atol=2e-4)
