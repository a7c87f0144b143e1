"""Sliding windows and attention sinks in the paged attention kernels: the torch reference against a
naive float64 attention written from transformers' definitions, the Triton kernels (interpreter on
CPU) against the reference."""

import pytest
import torch

from engine.kernels.paged_attention import paged_attention_reference, paged_attention_triton
from tests.engine.kernels._util import DEVICE, DTYPES, assert_close
from tests.engine.kernels.test_paged_attention import make_batch


def naive_attention(q, cu, dense_k, dense_v, scale, window=None, sinks=None):
    """Causal attention, float64, one head at a time: key j visible from query i iff j <= i and
    j > i - window (transformers' sliding_window_overlay); a sink logit joins each softmax and is
    dropped (transformers' gpt_oss eager_attention_forward)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (k, v) in enumerate(zip(dense_k, dense_v, strict=True)):
        start, end = int(cu[i]), int(cu[i + 1])
        ctx, n = k.shape[0], end - start
        group = q.shape[1] // k.shape[1]
        q_idx = torch.arange(ctx - n, ctx)[:, None]
        kv_idx = torch.arange(ctx)[None, :]
        allowed = kv_idx <= q_idx
        if window is not None:
            allowed &= kv_idx > q_idx - window
        for h in range(q.shape[1]):
            kh, vh = k[:, h // group].double(), v[:, h // group].double()  # [ctx, D]
            scores = (q[start:end, h].double() @ kh.T * scale).masked_fill(~allowed, float("-inf"))
            if sinks is not None:
                sink = torch.full((n, 1), float(sinks[h]), dtype=torch.float64)
                probs = torch.softmax(torch.cat([scores, sink], -1), -1)[:, :-1]
            else:
                probs = torch.softmax(scores, -1)
            out[start:end, h] = probs @ vh
    return out


CASES = {
    # name: (ctx_lens, q_lens, window)
    "decode_window_inside_context": ([40, 33, 9], [1, 1, 1], 16),
    "decode_window_of_one": ([21, 5], [1, 1], 1),
    "prefill_longer_than_window": ([70, 33], [70, 33], 20),
    "chunk_after_prefix_with_window": ([90, 50], [13, 40], 24),
    "mixed_window_wider_than_context": ([17, 40, 9], [17, 1, 5], 128),
}


def _sinks(num_heads):
    return (torch.randn(num_heads) * 2).to(DEVICE)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_window_and_sinks_match_transformers_semantics(case, with_sinks):
    ctx_lens, q_lens, window = CASES[case]
    args, (dk, dv) = make_batch(ctx_lens, q_lens, 4, 2, 16, torch.float32)
    args = [t.cpu() for t in args]
    sinks = _sinks(4).cpu() if with_sinks else None
    out = paged_attention_reference(*args, scale=0.125, sliding_window=window, sinks=sinks)
    expected = naive_attention(args[0], args[3], dk, dv, 0.125, window, sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def test_sinks_alone_shrink_every_row_without_changing_its_direction():
    args, (dk, dv) = make_batch([20, 7], [20, 1], 4, 4, 16, torch.float32)
    args = [t.cpu() for t in args]
    sinks = torch.full((4,), 3.0)
    out = paged_attention_reference(*args, scale=0.25, sinks=sinks)
    expected = naive_attention(args[0], args[3], dk, dv, 0.25, None, sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    plain = paged_attention_reference(*args, scale=0.25)
    ratio = (out / plain)[..., 0]  # [T, H]: one factor sigmoid(lse - sink) per row and head
    torch.testing.assert_close(out, plain * ratio[..., None], atol=1e-5, rtol=1e-4)
    assert bool((ratio < 1).all() and (ratio > 0).all())


TRITON_CASES = [  # (case, with sinks, dtype): each case once, both dtypes and both sink settings
    ("decode_window_inside_context", True, DTYPES[0]),
    ("decode_window_of_one", False, DTYPES[-1]),
    ("prefill_longer_than_window", True, DTYPES[-1]),
    ("prefill_longer_than_window", False, DTYPES[0]),
    ("chunk_after_prefix_with_window", True, DTYPES[0]),
    ("mixed_window_wider_than_context", False, DTYPES[-1]),
]


@pytest.mark.parametrize(("case", "with_sinks", "dtype"), TRITON_CASES)
def test_triton_window_and_sinks_match_reference(case, with_sinks, dtype):
    ctx_lens, q_lens, window = CASES[case]
    args, _ = make_batch(ctx_lens, q_lens, 4, 2, 32, dtype)
    sinks = _sinks(4) if with_sinks else None
    num_decodes = sum(1 for n in q_lens if n == 1)
    first_prefill = next((i for i, n in enumerate(q_lens) if n > 1), len(q_lens))
    hint = num_decodes if first_prefill == num_decodes else None  # decodes-first batches only
    out = paged_attention_triton(*args, scale=0.125, sliding_window=window, sinks=sinks,
                                 num_decode_seqs=hint)
    expected = paged_attention_reference(*args, scale=0.125, sliding_window=window, sinks=sinks)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_windowed_split_decode_is_independent_of_split_count(num_splits):
    args, _ = make_batch([100, 33, 7], [1, 1, 1], 4, 1, 32, torch.float32)
    sinks = _sinks(4)
    out = paged_attention_triton(*args, scale=0.2, num_splits=num_splits, sliding_window=50,
                                 sinks=sinks)
    expected = paged_attention_reference(*args, scale=0.2, sliding_window=50, sinks=sinks)
    assert_close(out, expected, torch.float32)


def test_table_entries_before_the_window_do_not_matter():
    """A window group's table points dead entries (blocks that slid out) at any block: garbage there
    changes nothing."""
    args, _ = make_batch([64, 48], [1, 16], 4, 2, 16, torch.float32)
    q, k_cache, v_cache, cu, seq_lens, tables = args
    expected = paged_attention_reference(*args, scale=0.25, sliding_window=16)
    spare = sorted(set(range(k_cache.shape[0])) - set(tables.flatten().tolist()))[0]
    poisoned = tables.clone()
    poisoned[0, :2] = spare  # request 0 (decode at 63) sees 48..63: blocks 0-1 are dead
    poisoned[1, :1] = spare  # request 1 (rows 32..47) sees 17..47: block 0 is dead
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache[spare], v_cache[spare] = 1e4, -1e4
    out = paged_attention_triton(q, k_cache, v_cache, cu, seq_lens, poisoned, scale=0.25,
                                 sliding_window=16)
    assert_close(out, expected, torch.float32)
