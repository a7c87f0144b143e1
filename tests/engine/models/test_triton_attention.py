"""TritonPagedAttention (the CUDA backend; here the Triton interpreter on CPU tensors) matches
TorchPagedAttention on a mixed batch built by ModelRunner: plain decodes, a cascade group of decodes
sharing a prompt prefix, a fresh prefill and a prefill chunk after a cached prefix."""

from __future__ import annotations

import os

import pytest
import torch

from engine.batch import ScheduledSequence
from engine.config import ModelConfig
from engine.layers.torch_attention import TorchPagedAttention
from engine.layers.triton_attention import TritonPagedAttention, max_lens
from engine.model_runner import CASCADE_MIN_GROUP, CASCADE_MIN_PREFIX_BLOCKS
from engine.testing import random_weights
from tests.engine.models._greedy import BLOCK_SIZE, make_runner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1 (set by "
                                       "tests/conftest.py)")

CONFIG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=32,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=512)


def mixed_batch() -> list[ScheduledSequence]:
    """Decodes (two plain, a cascade group sharing blocks 0..P-1), a fresh prefill, a chunk after a
    prefix."""
    prefix = list(range(CASCADE_MIN_PREFIX_BLOCKS))
    seqs = [ScheduledSequence("plain-0", [1], 40, [20, 21, 22], True),
            ScheduledSequence("plain-1", [1], 3, [23], True)]
    for i in range(CASCADE_MIN_GROUP):
        own = 30 + 2 * i
        seq_len = len(prefix) * BLOCK_SIZE + 5 + 7 * i  # past the prefix by a few tokens
        seqs.append(ScheduledSequence(f"group-{i}", [1], seq_len - 1, prefix + [own, own + 1],
                                      True))
    seqs.append(ScheduledSequence("fresh", [1] * 21, 0, [40, 41], True))
    seqs.append(ScheduledSequence("chunk", [1] * 13, 35, [42, 43, 44, 45], True))
    return seqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_backend_matches_torch_backend_on_a_mixed_batch(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make_runner(CONFIG, random_weights(CONFIG, torch.device("cpu"), torch.float32))
    seqs = mixed_batch()
    decodes, num_plain, groups = runner._plan_decodes([s for s in seqs
                                                       if s.num_scheduled_tokens == 1])
    assert groups, "the batch should form a cascade group"
    _, _, (meta,) = runner._prepare(decodes, [s for s in seqs if s.num_scheduled_tokens > 1],
                                    num_plain, groups)
    assert max_lens(meta) == (21, max(s.seq_len for s in seqs))  # exact, read off host-side shapes

    gen = torch.Generator().manual_seed(0)
    num_tokens = int(meta.cu_query_lens[-1])
    q = torch.randn(num_tokens, 4, 16, generator=gen).to(dtype)  # [T, H, Dh]
    k = torch.randn(num_tokens, 2, 16, generator=gen).to(dtype)  # [T, G, Dh]
    v = torch.randn(num_tokens, 2, 16, generator=gen).to(dtype)
    # [num_blocks, block_size, G, Dh], stale contents everywhere
    cache_shape = (48, BLOCK_SIZE, 2, 16)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.float(), v_cache.float()  # the reference runs in float32

    expected = TorchPagedAttention().forward(q.float(), k.float(), v.float(), k_ref, v_ref, 0.25,
                                             meta)
    monkeypatch.setattr("engine.kernels.FORCED_BACKEND", "triton")
    actual = TritonPagedAttention().forward(q, k, v, k_cache, v_cache, 0.25, meta)

    torch.testing.assert_close(k_cache.float(), k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v_cache.float(), v_ref, rtol=0, atol=0)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)
