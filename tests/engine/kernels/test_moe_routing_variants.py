"""Qwen-MoE routing variants through the Triton fused-MoE kernel (Triton's interpreter on CPU)
against the torch reference: softmax top-k with and without renormalisation (`norm_topk_prob`), and
the layer plan of `decoder_sparse_step` / `mlp_only_layers` (routed experts on some layers, the
dense MLP on the others), each layer's MLP built by the engine's own factory."""

import pytest
import torch

from engine.config import ModelConfig
from engine.kernels.fused_moe import fused_moe_reference, fused_moe_triton, select_experts
from engine.layers.linear import DenseLinear
from engine.models.llama import DenseMLP
from engine.models.moe import MoEMLP, moe_mlp_factory
from tests.engine.kernels._util import DEVICE, DTYPES, assert_close

HIDDEN, INTER, MOE_INTER, NUM_EXPERTS, TOP_K = 64, 96, 32, 8, 2


def routing_reference(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool):  # type: ignore[no-untyped-def]
    """transformers' Qwen2MoeTopKRouter / Qwen3MoeTopKRouter: softmax in float32, top-k, then
    divided by the top-k sum iff norm_topk_prob."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_experts_match_the_reference_with_and_without_renormalised_weights(
        norm_topk_prob, dtype):
    num_tokens = 5
    hidden = torch.randn(num_tokens, HIDDEN).to(dtype)
    w13 = (torch.randn(NUM_EXPERTS, 2 * MOE_INTER, HIDDEN) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, MOE_INTER) / MOE_INTER**0.5).to(dtype)
    logits = torch.randn(num_tokens, NUM_EXPERTS)
    weights, ids = select_experts(logits, TOP_K, renormalize=norm_topk_prob)
    expected_weights, expected_ids = routing_reference(logits, TOP_K, norm_topk_prob)
    torch.testing.assert_close(weights, expected_weights)
    assert torch.equal(ids.long(), expected_ids)
    assert torch.allclose(weights.sum(-1), torch.ones(num_tokens)) == norm_topk_prob
    args = [t.to(DEVICE) for t in (hidden, w13, w2, weights, ids)]
    assert_close(fused_moe_triton(*args), fused_moe_reference(*args), dtype)


def _layer_weights(config: ModelConfig, layer: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named MLP weights of `layer`: per-expert tensors on a sparse layer, a dense MLP else."""
    p = f"model.layers.{layer}.mlp."

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape) / shape[-1] ** 0.5).to(dtype)

    if not config.is_sparse_layer(layer):
        return {p + "gate_proj.weight": randn(INTER, HIDDEN),
                p + "up_proj.weight": randn(INTER, HIDDEN),
                p + "down_proj.weight": randn(HIDDEN, INTER)}
    weights = {p + "gate.weight": randn(NUM_EXPERTS, HIDDEN)}
    for e in range(NUM_EXPERTS):
        weights |= {f"{p}experts.{e}.gate_proj.weight": randn(MOE_INTER, HIDDEN),
                    f"{p}experts.{e}.up_proj.weight": randn(MOE_INTER, HIDDEN),
                    f"{p}experts.{e}.down_proj.weight": randn(HIDDEN, MOE_INTER)}
    return weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("step,mlp_only,norm_topk_prob,sparse", [
    (1, (1,), True, [True, False, True, True]),  # Qwen3-MoE style with an mlp-only layer
    (2, (), False, [False, True, False, True]),  # every second layer sparse
    (2, (3,), True, [False, True, False, False]),
])
def test_layer_plan_builds_routed_and_dense_layers_and_triton_matches_torch(
        step, mlp_only, norm_topk_prob, sparse, dtype, monkeypatch):
    config = ModelConfig(architecture="qwen3_moe", vocab_size=32, hidden_size=HIDDEN,
                         intermediate_size=INTER, num_layers=4, num_heads=4, num_kv_heads=2,
                         head_dim=16, max_position_embeddings=64,
                         num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
                         moe_intermediate_size=MOE_INTER,
                         norm_topk_prob=norm_topk_prob, decoder_sparse_step=step,
                         mlp_only_layers=mlp_only, qk_norm="per_head")
    assert [config.is_sparse_layer(i) for i in range(4)] == sparse
    x = torch.randn(7, HIDDEN).to(dtype).to(DEVICE)
    for layer in range(4):
        weights = {k: v.to(DEVICE) for k, v in _layer_weights(config, layer, dtype).items()}
        outputs = {}
        for backend in ("torch", "triton"):
            monkeypatch.setenv("AIGW_KERNELS", backend)
            mlp = moe_mlp_factory(config, dict(weights), layer, lambda _name, w: DenseLinear(w))
            assert isinstance(mlp, MoEMLP if sparse[layer] else DenseMLP)
            if isinstance(mlp, MoEMLP):
                assert mlp.renormalize == norm_topk_prob and mlp.shared is None
            outputs[backend] = mlp(x)
        assert_close(outputs["triton"], outputs["torch"], dtype)
