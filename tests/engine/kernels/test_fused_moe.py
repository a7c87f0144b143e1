"""Fused MoE: routing helpers, reference vs a naive per-token loop, Triton vs reference."""

import pytest
import torch

from engine.kernels.fused_moe import (
    fused_moe_reference,
    fused_moe_triton,
    moe_align_block_size,
    select_experts,
)
from tests.engine.kernels._util import DEVICE, DTYPES, assert_close


def make_moe(num_tokens, num_experts, hidden, inter, dtype):
    h = torch.randn(num_tokens, hidden, dtype=dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(dtype)
    return h.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE)


def naive_moe(h, w13, w2, topk_weights, topk_ids):
    """Per token, per chosen expert, in float64."""
    inter = w2.shape[2]
    out = torch.zeros(h.shape, dtype=torch.float64)
    for t in range(h.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate_up = w13[e].double() @ h[t].double()
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(topk_weights[t, k]) * (w2[e].double() @ act)
    return out


def routing_without_expert(num_tokens, num_experts, top_k, missing):
    logits = torch.randn(num_tokens, num_experts)
    logits[:, missing] = -1e9  # this expert is never chosen
    return select_experts(logits, top_k, renormalize=True)


@pytest.mark.parametrize("top_k", [1, 2])
def test_reference_matches_naive_loop(top_k):
    h, w13, w2 = make_moe(9, 4, 72, 24, torch.float32)
    weights, ids = routing_without_expert(9, 4, top_k, missing=2)
    expected = naive_moe(h.cpu(), w13.cpu(), w2.cpu(), weights, ids)
    out = fused_moe_reference(h.cpu(), w13.cpu(), w2.cpu(), weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (1, 2), (13, 2), (40, 1)])
def test_triton_matches_reference(num_tokens, top_k, dtype):
    h, w13, w2 = make_moe(num_tokens, 4, 72, 40, dtype)
    weights, ids = routing_without_expert(num_tokens, 4, top_k, missing=1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    out = fused_moe_triton(h, w13, w2, weights, ids)
    assert_close(out, fused_moe_reference(h, w13, w2, weights, ids), dtype)


def test_align_groups_pairs_by_expert_padded_to_block_without_dropping_any():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 3]])  # expert 2 has no pairs
    routing = moe_align_block_size(ids, block_m=4, num_experts=5)
    num_pairs = ids.numel()
    total = int(routing.num_pairs_post_padded)
    # expert 0: 2 pairs -> 4 rows; expert 1: 1 -> 4; expert 3: 5 -> 8; experts 2, 4: none
    assert total == 16
    assert routing.expert_ids[: total // 4].tolist() == [0, 1, 3, 3]
    used = routing.sorted_pair_ids[:total]
    real = used[used < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    flat = ids.flatten()
    for block, expert in enumerate(routing.expert_ids[: total // 4].tolist()):
        rows = used[block * 4 : (block + 1) * 4]
        assert all(int(flat[p]) == expert for p in rows if p < num_pairs)
    assert (routing.sorted_pair_ids[total:] == num_pairs).all()


def test_select_experts_renormalizes_top_k_softmax():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2]] and ids.dtype == torch.int32
    e = torch.exp(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(weights, (e / e.sum()).unsqueeze(0))
    raw, _ = select_experts(logits, 2, renormalize=False)
    torch.testing.assert_close(raw, torch.softmax(logits, -1)[:, [1, 2]])
    with pytest.raises(ValueError):
        select_experts(logits, 2, renormalize=False, scoring="bogus")
