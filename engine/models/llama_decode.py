"""The native step of a Llama model: every row of a step through engine/kernels/cpu, one layer loop
for both weight modes, one process or a tensor-parallel rank.

    step = native_step(model, decode_weights)   # None: the runner keeps the general forward

The loop is the same everywhere; three pieces are chosen once, at build:

- the kernels (`QuantKernels` in the q4 mode: every linear a `NativeQuantLinear`, float16 KV;
  `FloatKernels` in the float32 mode: oneDNN GEMMs, float32 KV, decode rows only; the q4 mode's
  bf16 prompt rows, engine/models/llama_prefill.py `Bf16Kernels`);
- the world (`ONE_PROCESS`: no collectives; a tensor-parallel rank's all-reduce and gather,
  engine/parallel/native_step.py);
- each layer's MLP (dense: gate_up then down; MoE, one process in the q4 mode: the layer's router
  over its native experts, engine/models/moe.py).

Per layer of the q4 step (the float step runs the same with F.rms_norm and oneDNN GEMMs, the
residual add fused into the GEMM, ~9 ops a layer):

    qkv = q_linear(hidden, W_qkv, rms_norm=input_norm)                 [M, (H + 2G) * Dh]
    attn = decode_attention(qkv, rotary, k/v cache, slots, block tables, context lens)   [M, H * Dh]
    hidden += reduce(q_linear(attn, W_o))                              (in place)
    gate_up = q_linear(hidden, W_gate_up, rms_norm=post_attention_norm)  [M, 2I]
    hidden += reduce(q_linear(silu(gate) * up, W_down))                (in place)

(`reduce`: nothing in one process, where the add is fused into the kernel; the rank's all-reduce)
then logits = q_linear(hidden[rows that sample], W_lm_head, rms_norm=final norm), gathered to rank
0 on a rank. A sparse layer's MLP half is `hidden += moe(rms_norm(hidden, post_attention_norm))`
(router top-k, per-expert q_linear pairs, the shared expert). Qwen3's per-head q/k norm runs
between the qkv projection and the attention kernel (which applies the rotary), as two F.rms_norm
over the q and k heads (+2 ops a layer). The q4 step fuses the norms, rotary, the KV store,
SiLU-and-mul and the residual adds into the kernels, so a step dispatches ~5 ops per layer instead
of ~60: at one sequence the eager step spent more time dispatching ops than reading weights. The
float step reads K/V straight from the cache blocks instead of gathering them for SDPA (at 32 rows
the gather alone cost ~23 ms a step).

In the q4 mode the runner sends every row here, decode rows and prefill chunks alike
(`runs_prefill`): a chunk of C tokens is C rows, row i attending to the context up to its own
position (the attention kernel tiles a chunk's rows so each pass over the K/V serves 16 of them),
so prefill pays for no element-wise ops, K/V gathers or float16-to-float32 copies between the
kernels (through the general forward they took ~45% of a profiled 1,024-token q4 prefill; this path
took it from 560 to 763 tokens/s in an A/B run, bench/results/engine-cpu.md has the later figures).
Every row is computed alone and in the same order whatever else the step holds (the experts add a
token's contributions in ascending expert order), so a sequence's tokens do not depend on what it
was batched with, nor on how its prompt was chunked. The float32 mode sends only decode rows
(prefill chunks take the general forward).

`native_step` returns None for anything else: biases, OLMoE's projection q/k norm, MLA, Gemma 3,
Llama 4, sliding windows (the native attention kernel has none: such models keep the general
forward, whose attention backends do), head_dim not a multiple of 8, other dtypes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.layers.linear import DenseLinear, OneDNNLinear
from engine.layers.native_experts import NativeExperts
from engine.layers.native_linear import NativeQuantLinear
from engine.layers.norm import rms_norm_fast
from engine.models.llama import DecoderLayer, DenseMLP
from engine.models.moe import MoEMLP

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
Reduce = Callable[[torch.Tensor], torch.Tensor] | None  # the rank's all-reduce; None: one process


@dataclass(frozen=True)
class DecodeInputs:
    """One step of M rows, one token each: a decode row, or one token of a prefill chunk (its row
    attends to the positions up to its own, like a decode row). Integer tensors are int64 on the
    CPU."""

    input_ids: torch.Tensor  # [M]
    positions: torch.Tensor  # [M] position of the token (= context length - 1)
    slots: torch.Tensor  # [M] where its K/V goes: block_id * block_size + offset
    block_tables: torch.Tensor  # [M, W] blocks of each row's context, padded with block 0
    context_lens: torch.Tensor  # [M] positions to attend to, the row's own included
    logit_rows: torch.Tensor | None = None  # [S] rows that get logits, in order; None: every row


class Kernels(Protocol):
    """How a step's linears run: `normed` (the input norm fused), `add` (into the residual, summed
    over the ranks by `reduce`), `logits` (the final norm and the lm head)."""

    name: str
    kv_dtype: torch.dtype
    runs_prefill: bool

    def normed(self, linear: Any, x: torch.Tensor, norm: torch.Tensor, eps: float
               ) -> torch.Tensor: ...

    def add(self, residual: torch.Tensor, linear: Any, x: torch.Tensor, reduce: Reduce,
            silu_and_mul: bool = False) -> torch.Tensor: ...

    def logits(self, head: Any, hidden: torch.Tensor, norm: torch.Tensor, eps: float
               ) -> torch.Tensor: ...


class QuantKernels:
    """The q4 mode: the linears on the GGUF's own blocks (engine/layers/native_linear.py), with
    the norm, SiLU-and-mul and (in one process) the residual add fused into the kernel."""

    name = "q4"
    kv_dtype = torch.float16  # half the bytes the attention reads per step; q4 is approximate
    runs_prefill = True  # prefill chunks take this step too, a row per token (see the module doc)

    @staticmethod
    def fits(linear: object) -> bool:
        return isinstance(linear, NativeQuantLinear)

    fits_head = fits

    @staticmethod
    def normed(linear: Any, x: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x, norm) @ W^T."""
        return linear.native(x, norm, eps)

    @staticmethod
    def add(residual: torch.Tensor, linear: Any, x: torch.Tensor, reduce: Reduce,
            silu_and_mul: bool = False) -> torch.Tensor:
        """residual += reduce(x @ W^T), in place; x = silu(x[:, :in]) * x[:, in:] first when
        `silu_and_mul`."""
        if reduce is None:
            linear.add_into(residual, x, silu_and_mul)
        else:
            residual += reduce(linear.silu_mul_native(x) if silu_and_mul else linear.native(x))
        return residual

    @staticmethod
    def logits(head: Any, hidden: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        return head.native(hidden, norm, eps)


class FloatKernels:
    """The float32 mode: the general forward's math for decode rows (F.rms_norm, oneDNN GEMMs with
    the residual add fused in one process)."""

    name = "float"
    kv_dtype = torch.float32
    runs_prefill = False  # prefill chunks take the general forward (SDPA, oneDNN GEMMs)

    @staticmethod
    def fits(linear: object) -> bool:
        return isinstance(linear, (OneDNNLinear, DenseLinear))

    @staticmethod
    def fits_head(linear: object) -> bool:
        return True

    @staticmethod
    def normed(linear: Any, x: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        return linear(rms_norm_fast(x, norm, eps))

    @staticmethod
    def add(residual: torch.Tensor, linear: Any, x: torch.Tensor, reduce: Reduce,
            silu_and_mul: bool = False) -> torch.Tensor:
        """residual + reduce(x @ W^T) (a new tensor)."""
        if silu_and_mul:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        if reduce is not None:
            return residual + reduce(linear(x))
        if isinstance(linear, OneDNNLinear):
            return linear.add_to(residual, x)  # one oneDNN call, the add fused
        return residual + linear(x)

    @staticmethod
    def logits(head: Any, hidden: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        return head(rms_norm_fast(hidden, norm, eps)).float()


Q4_KERNELS, FLOAT_KERNELS = QuantKernels(), FloatKernels()


class OneProcess:
    """The world of one process: no collectives."""

    parallel = False
    reduce: Reduce = None

    def embed(self, model: Any, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, model.embed_tokens)  # [M, hidden]: this step's own tensor

    def logits_width(self, model: Any) -> int:
        return int(model.config.vocab_size)

    def gathered(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


ONE_PROCESS = OneProcess()

# what compute_info["native_step"] reports: (parallel, kernels, MoE) -> name
STEP_NAMES = {(False, "q4", False): "NativeDecodeStep", (False, "q4", True): "NativeMoEDecodeStep",
              (False, "float", False): "FloatDecodeStep", (True, "q4", False): "ParallelNativeStep",
              (True, "float", False): "ParallelFloatStep"}


class NativeStep:
    """The layer loop (module doc) with its kernels, world and per-layer MLPs chosen at build."""

    def __init__(self, model: Any, kernels: Kernels, world: Any, name: str) -> None:
        self.model = model
        self.kernels = kernels
        self.world = world
        self.name = name  # compute_info["native_step"]
        self.kv_dtype = kernels.kv_dtype
        self.runs_prefill = kernels.runs_prefill
        self._mlps = [self._dense if isinstance(layer.mlp, DenseMLP) else self._moe
                      for layer in model.layers]

    def __call__(self, step: DecodeInputs, kv_caches: KVCaches) -> torch.Tensor:
        """-> logits of `step.logit_rows` (every row when None): [S, vocab] float32 (on a rank:
        [S, vocab] on rank 0, its own [S, vocab / N] elsewhere)."""
        model, cfg, kernels, world = self.model, self.model.config, self.kernels, self.world
        eps, reduce = cfg.rms_norm_eps, world.reduce
        cos, sin = model.rotary.cos, model.rotary.sin  # [P, Dh]
        hidden = world.embed(model, step.input_ids)  # [M, hidden]
        for layer, (k_cache, v_cache), mlp in zip(model.layers, kv_caches, self._mlps, strict=True):
            qkv = kernels.normed(layer.qkv, hidden, layer.input_norm, eps)  # [M, (H + 2G) * Dh]
            if cfg.qk_norm == "per_head":
                _norm_qk_heads(qkv, layer, cfg)
            attn = torch.ops.aigw_cpu.decode_attention(
                qkv, cos, sin, step.positions, k_cache, v_cache, step.slots, step.block_tables,
                step.context_lens, cfg.num_heads, cfg.num_kv_heads, model.scale)  # [M, H * Dh]
            hidden = kernels.add(hidden, layer.o_proj, attn, reduce)
            hidden = mlp(hidden, layer)
        if step.logit_rows is not None:
            if not len(step.logit_rows):  # no row samples (a prompt chunk): no gather on any rank
                return hidden.new_empty((0, world.logits_width(model)))
            hidden = hidden.index_select(0, step.logit_rows)  # [S, hidden]
        return world.gathered(kernels.logits(model.lm_head, hidden, model.norm, eps))

    def _dense(self, hidden: torch.Tensor, layer: DecoderLayer) -> torch.Tensor:
        mlp: DenseMLP = layer.mlp  # type: ignore[assignment]
        eps = self.model.config.rms_norm_eps
        gate_up = self.kernels.normed(mlp.gate_up, hidden, layer.post_attention_norm, eps)  # [M,2I]
        return self.kernels.add(hidden, mlp.down, gate_up, self.world.reduce, silu_and_mul=True)

    def _moe(self, hidden: torch.Tensor, layer: DecoderLayer) -> torch.Tensor:
        eps = self.model.config.rms_norm_eps
        hidden += layer.mlp(rms_norm_fast(hidden, layer.post_attention_norm, eps))  # [M, hidden]
        return hidden


def native_step(model: Any, decode_weights: str, world: Any = ONE_PROCESS) -> NativeStep | None:
    """The step for `model` (a LlamaModel, or a rank's unwrapped view of one) in this decode-weights
    mode: the q4 kernels where every linear (and the lm head) is a NativeQuantLinear, else the float
    kernels where every linear is a float32 oneDNN / dense one; None when a part does not fit."""
    kinds = (Q4_KERNELS, FLOAT_KERNELS) if decode_weights == "q4" else (FLOAT_KERNELS,)
    for kernels in kinds:
        if _fits(model, kernels, world):
            name = STEP_NAMES[world.parallel, kernels.name, model.config.is_moe]
            return NativeStep(model, kernels, world, name)
    return None


def _fits(model: Any, kernels: QuantKernels | FloatKernels, world: Any) -> bool:
    """True when every layer is the plain Llama shape the step handles (module doc) with its linears
    on `kernels`; MoE layers (their experts native) only in the q4 mode in one process."""
    cfg: ModelConfig = model.config
    if (cfg.attention_bias or cfg.mla or cfg.gemma or cfg.llama4 or cfg.head_dim % 8
            or cfg.has_sliding_layers or cfg.qk_norm not in (None, "per_head")
            or model.embed_tokens.dtype != torch.float32 or not kernels.fits_head(model.lm_head)):
        return False
    moe_fits = kernels is Q4_KERNELS and not world.parallel
    if cfg.is_moe and not moe_fits:
        return False
    for layer in model.layers:
        if not (isinstance(layer, DecoderLayer) and kernels.fits(layer.qkv)
                and kernels.fits(layer.o_proj)):
            return False
        mlp = layer.mlp
        if isinstance(mlp, DenseMLP):
            if not (kernels.fits(mlp.gate_up) and kernels.fits(mlp.down)):
                return False
        elif not (isinstance(mlp, MoEMLP) and isinstance(mlp.experts, NativeExperts)):
            return False
    return True


def _norm_qk_heads(qkv: torch.Tensor, layer: DecoderLayer, cfg: ModelConfig) -> None:
    """Qwen3's per-head RMSNorm of the q and k heads of qkv [M, (H + 2G) * Dh], in place (before
    the attention kernel's rotary), as LlamaModel.forward computes it."""
    num_q, num_kv, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    heads = qkv.view(qkv.shape[0], num_q + 2 * num_kv, head_dim)  # [M, H + 2G, Dh]
    heads[:, :num_q] = F.rms_norm(heads[:, :num_q], (head_dim,), layer.q_norm, cfg.rms_norm_eps)
    heads[:, num_q:num_q + num_kv] = F.rms_norm(heads[:, num_q:num_q + num_kv], (head_dim,),
                                                layer.k_norm, cfg.rms_norm_eps)
