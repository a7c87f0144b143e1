"""Prompt chunks of a q4 Llama model in bfloat16: the prefill half of the q4 mode on a CPU with
AMX-BF16 or AVX512-BF16 (engine/kernels/cpu/isa.py `prefill`); decode rows stay on the integer
kernels (engine/models/llama_decode.py NativeDecodeStep), over the same float16 KV cache.

Dimension legend: T prompt rows of the step (every chunk's), H query heads, G kv heads, Dh head
dim, I intermediate size. Per layer:

    x = rms_norm(hidden) -> bf16                                        [T, hidden]
    qkv = bf16_linear(x, W_qkv) -> float32                              [T, (H + 2G) * Dh]
    q, k = rotary(q, k); k, v -> the float16 cache at the rows' slots
    attn = SDPA per chunk, bf16 (q; the cached prefix + chunk's K/V)    [T, H, Dh]
    hidden += bf16_linear(attn, W_o)                                    (float32 residual)
    gate_up = bf16_linear(rms_norm(hidden) -> bf16, W_gate_up)          [T, 2I]
    hidden += bf16_linear(silu(gate) * up -> bf16, W_down)

then logits = the integer lm head of the rows that sample (a few rows: the GEMV the integer kernel
is fast at). The GEMMs run in oneDNN's bf16 kernels (AMX tiles or vdpbf16ps, float32 accumulation,
each product rounded to bf16 once), the weights dequantized tile by tile into one bounded scratch
(engine/layers/bf16_linear.py); SDPA's CPU flash kernel keeps its softmax and sums in float32.
The residual stream, norms and rotary stay float32.

Numerics: bf16 keeps 8 significant bits (relative rounding <= 2^-9), so each GEMM's inputs and
output carry ~0.2-0.4% of relative error against the float32 product of the same (dequantized)
weights, where the integer path's 8-bit activation blocks carry ~0.5-1% (its 127 steps span each
32-value block's largest magnitude). A prompt's K/V, and so the first tokens, differ slightly from
the integer path's: greedy tokens agree until a step whose two best logits are near a tie.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.layers.attention import AttentionMetadata, PrefillSegment
from engine.layers.bf16_linear import Bf16Scratch, bf16_linear
from engine.layers.native_linear import NativeQuantLinear
from engine.layers.norm import rms_norm_fast
from engine.layers.rotary import apply_rotary
from engine.layers.torch_attention import TorchPagedAttention
from engine.models.llama import DenseMLP, LlamaModel
from engine.models.llama_decode import DecodeInputs, NativeDecodeStep, _norm_qk_heads

BF16 = torch.bfloat16


class Bf16PrefillStep:
    """Prompt rows of a model NativeDecodeStep serves (every linear a NativeQuantLinear), in bf16."""

    def __init__(self, model: LlamaModel, scratch: Bf16Scratch | None = None) -> None:
        self.model = model
        self.scratch = scratch or Bf16Scratch()
        self.attention = TorchPagedAttention()

    @classmethod
    def build(cls, model: LlamaModel) -> Bf16PrefillStep | None:
        return cls(model) if NativeDecodeStep.build(model) is not None else None

    def __call__(self, step: DecodeInputs, rows_per_sequence: Sequence[int],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """`step`: the prompt rows of len(rows_per_sequence) sequences, each sequence's rows
        consecutive (a chunk: positions p, p + 1, ...). -> logits [S, vocab] float32 of
        `step.logit_rows` (every row when None)."""
        model, cfg = self.model, self.model.config
        eps, num_q, num_kv, head_dim = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        meta = _prefill_metadata(step, rows_per_sequence, kv_caches[0][0].shape[1])
        cos, sin = model.rotary.lookup(step.positions)  # [T, 1, Dh]
        hidden = F.embedding(step.input_ids, model.embed_tokens)  # [T, hidden] float32
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            mlp: DenseMLP = layer.mlp  # type: ignore[assignment]
            x = rms_norm_fast(hidden, layer.input_norm, eps).to(BF16)
            qkv = self._linear(x, layer.qkv).float()  # [T, (H + 2G) * Dh]
            if cfg.qk_norm == "per_head":
                _norm_qk_heads(qkv, layer, cfg)
            heads = qkv.view(-1, num_q + 2 * num_kv, head_dim)  # [T, H + 2G, Dh]
            qk = apply_rotary(heads[:, :num_q + num_kv], cos, sin)  # [T, H + G, Dh]
            q, k, v = qk[:, :num_q], qk[:, num_q:], heads[:, num_q + num_kv:]
            attn = self.attention.forward(q.to(BF16), k, v, k_cache, v_cache, model.scale, meta)  # [T, H, Dh]
            hidden = hidden + self._linear(attn.reshape(-1, num_q * head_dim), layer.o_proj).float()
            x = rms_norm_fast(hidden, layer.post_attention_norm, eps).to(BF16)
            gate, up = self._linear(x, mlp.gate_up).chunk(2, dim=-1)  # 2 x [T, I] bf16
            act = (F.silu(gate.float()) * up.float()).to(BF16)
            hidden = hidden + self._linear(act, mlp.down).float()
        if step.logit_rows is not None:
            hidden = hidden.index_select(0, step.logit_rows)  # [S, hidden]
        lm_head = model.lm_head
        assert isinstance(lm_head, NativeQuantLinear)
        return lm_head.native(hidden, model.norm, eps)

    def _linear(self, x: torch.Tensor, weight: object) -> torch.Tensor:
        assert isinstance(weight, NativeQuantLinear)
        return bf16_linear(x, weight, self.scratch)


def _prefill_metadata(step: DecodeInputs, rows_per_sequence: Sequence[int], block_size: int
                      ) -> AttentionMetadata:
    """The chunks as PrefillSegments (each row of a chunk shares its sequence's block table)."""
    segments, start = [], 0
    for num_rows in rows_per_sequence:
        end = start + num_rows
        context_len = int(step.context_lens[end - 1])
        num_blocks = -(-context_len // block_size)
        segments.append(PrefillSegment(start, end, step.block_tables[start, :num_blocks], context_len,
                                       int(step.positions[start])))
        start = end
    return AttentionMetadata(slot_mapping=step.slots, num_decode_tokens=0, decode_blocks=None,
                             decode_len=0, decode_mask=None, prefills=tuple(segments))
