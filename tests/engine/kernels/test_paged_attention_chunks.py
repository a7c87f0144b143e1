"""Chunked local attention (Llama 4's RoPE layers: a query at p sees floor(p / C) * C .. p) in the
paged attention kernels: the torch reference against a naive float64 attention written from
transformers' chunked_causal mask (kv_idx // C == q_idx // C, causal), the Triton kernels
(interpreter on CPU) against the reference, and dead table entries before a chunk ignored."""

import pytest
import torch

from engine.kernels.paged_attention import paged_attention_reference, paged_attention_triton
from tests.engine.kernels._util import DTYPES, assert_close
from tests.engine.kernels.test_paged_attention import make_batch

CASES = {
    # name: (ctx_lens, q_lens, chunk)
    "decode_inside_and_at_a_chunk_start": ([40, 33, 9, 49], [1, 1, 1, 1], 16),
    "prefill_over_several_chunks": ([70, 33], [70, 33], 20),
    "step_after_a_prefix_across_a_chunk_boundary": ([90, 50], [13, 40], 24),
    "mixed_chunk_wider_than_context": ([17, 40, 9], [17, 1, 5], 128),
}


def naive_chunked_attention(q, cu, dense_k, dense_v, scale, chunk):
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (k, v) in enumerate(zip(dense_k, dense_v, strict=True)):
        start, end = int(cu[i]), int(cu[i + 1])
        ctx, n = k.shape[0], end - start
        group = q.shape[1] // k.shape[1]
        q_idx = torch.arange(ctx - n, ctx)[:, None]
        kv_idx = torch.arange(ctx)[None, :]
        allowed = (kv_idx <= q_idx) & (kv_idx // chunk == q_idx // chunk)
        for h in range(q.shape[1]):
            kh, vh = k[:, h // group].double(), v[:, h // group].double()
            scores = (q[start:end, h].double() @ kh.T * scale).masked_fill(~allowed, float("-inf"))
            out[start:end, h] = torch.softmax(scores, -1) @ vh
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_chunks_match_transformers_semantics(case):
    ctx_lens, q_lens, chunk = CASES[case]
    args, (dense_k, dense_v) = make_batch(ctx_lens, q_lens, 4, 2, 32, torch.float32)
    out = paged_attention_reference(*args, scale=0.125, attention_chunk=chunk)
    expected = naive_chunked_attention(args[0].cpu(), args[3].cpu(), dense_k, dense_v, 0.125, chunk)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("case", "dtype"),
                         [(c, DTYPES[i % len(DTYPES)]) for i, c in enumerate(sorted(CASES))])
def test_triton_chunks_match_reference(case, dtype):
    ctx_lens, q_lens, chunk = CASES[case]
    args, _ = make_batch(ctx_lens, q_lens, 4, 2, 32, dtype)
    out = paged_attention_triton(*args, scale=0.125, attention_chunk=chunk)
    expected = paged_attention_reference(*args, scale=0.125, attention_chunk=chunk)
    assert_close(out, expected, dtype)


def test_table_entries_before_the_chunk_do_not_matter():
    """A chunk group's table points released entries at any block: garbage there changes nothing."""
    args, _ = make_batch([64, 48], [1, 16], 4, 2, 16, torch.float32)
    q, k_cache, v_cache, cu, seq_lens, tables = args
    expected = paged_attention_reference(*args, scale=0.25, attention_chunk=32)
    spare = sorted(set(range(k_cache.shape[0])) - set(tables.flatten().tolist()))[0]
    poisoned = tables.clone()
    poisoned[0, :2] = spare  # request 0 (decode at 63) sees its chunk 32..63: blocks 0-1 are dead
    poisoned[1, :2] = spare  # request 1 (rows 32..47) sees 32..47: blocks 0-1 are dead
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache[spare], v_cache[spare] = 1e4, -1e4
    out = paged_attention_triton(q, k_cache, v_cache, cu, seq_lens, poisoned, scale=0.25,
                                 attention_chunk=32)
    assert_close(out, expected, torch.float32)
