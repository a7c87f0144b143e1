"""ModelRunner: owns the device, the weights, the KV tensors; turns a ScheduledBatch into logits.

Only this module builds device tensors. Per step:

    metadata = build from batch (slots, decode contexts, prefill segments)   # plain ints -> tensors
    with forward_context(metadata): hidden = model.forward(ids, positions, kv)
    logits = model.compute_logits(hidden[rows that sample])                  # only those rows
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from engine.batch import ScheduledBatch, ScheduledSequence
from engine.block_tables import block_table_tensor, blocks_from, num_shared_blocks, padded_blocks
from engine.config import EngineConfig, ModelConfig
from engine.kernels.cpu import huge_pages
from engine.kv_cache.layout import KVCacheGroup, KVCacheLayout, kv_bytes_per_token
from engine.layers.attention import (
    AttentionMetadata,
    CascadeGroup,
    PrefillSegment,
    build_attention_backend,
    forward_context,
)
from engine.models.llama_decode import DecodeInputs
from engine.models.registry import build_model

if TYPE_CHECKING:
    from engine.parallel.rank import RankShard

logger = logging.getLogger(__name__)

# Cascade attention for decode rows that share a prompt prefix (engine/layers/torch_attention.py):
CASCADE_MIN_GROUP = 4  # sequences
CASCADE_MIN_PREFIX_BLOCKS = 8  # shared leading blocks (128 tokens at block size 16)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StepLogits:
    request_ids: list[str]  # one per logits row, in row order
    logits: torch.Tensor  # [S, vocab] float32
    # sequences with `needs_prompt_logits`: the logits of every scheduled row, [num_scheduled,
    # vocab]
    prompt_logits: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 weights: dict[str, torch.Tensor],
                 raw_weights: dict | None = None, shard: RankShard | None = None) -> None:
        """`shard`: this process is one rank of a tensor-parallel replica (engine/parallel/):
        `model_config` and `weights` are the rank's, and the KV blocks are counted for the
        replica."""
        self.config = config
        self.shard = shard
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.resolved_dtype]
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        from engine.layers import attention_backend_name, make_linear_factory

        attention = build_attention_backend(attention_backend_name(self.device))
        self.model = build_model(model_config, weights, attention,
                                 make_linear_factory(config, self.device, raw_weights or {}),
                                 self.device, self.dtype)
        if shard is not None:
            # before the native step: a rank's takes the wrappers off itself
            shard.parallelize(self.model)
        self._forward = self.model.forward
        self._native_decode = _native_decode_step(self.model, config, shard)
        self._prefill_step = _bf16_prefill_step(self.model, self._native_decode, shard)
        self.compute_info = _compute_info(self.model, config, self._native_decode)
        info = self.compute_info
        logger.info("weights: %s%s, experts: %s, native step: %s", info["weights"],
                    f" ({info['weights_source']})" if info["weights_source"] else "",
                    info["experts"] or "none", info["native_step"])
        if self._prefill_step is not None:
            from engine.kernels.cpu import isa

            self.compute_info["cpu_prefill_isa"] = isa.selection().prefill
        if config.compile:
            self._forward = _compiled_forward(self.model)
        self.block_size = config.cache.block_size
        max_len = min(model_config.max_position_embeddings,
                      config.max_model_len or model_config.max_position_embeddings)
        self.kv_layout = KVCacheLayout.for_model(model_config, max_len)
        # cascade shares group 0's prefix blocks: only where group 0 is full attention
        self.enable_cascade = self.device.type == "cpu" and self.kv_layout.groups[0].is_full
        self.kv_dtype = (self._native_decode.kv_dtype if self._native_decode is not None
                         else self.dtype)
        self.num_blocks = self._num_blocks_for_budget()
        shape = (self.num_blocks, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        slots = []
        for _ in range(self.kv_layout.num_tensor_slots):
            k = self._kv_tensor(shape)  # MLA: the latent is K and V (one tensor, kv_is_shared)
            slots.append((k, k if model_config.kv_is_shared else self._kv_tensor(shape)))
        # per layer (slots are shared)
        self.kv_caches = [slots[j] for j in self.kv_layout.layer_slot]
        logger.info("KV cache: %d blocks of %d tokens (%.0f MiB), %d group(s)", self.num_blocks,
                    self.block_size, self.num_blocks * self.bytes_per_block / 2**20,
                    len(self.kv_layout.groups))

    def _kv_tensor(self, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """[num_blocks, block_size, G, Dh] zeros; on the CPU on huge pages
        (engine/kernels/cpu/huge_pages.py)."""
        if self.device.type == "cpu":
            return huge_pages.zeros(shape, self.kv_dtype)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    @property
    def bytes_per_block(self) -> int:
        """One block id's bytes: a block of K and V in every tensor slot (layers of one group)."""
        element_size = torch.empty((), dtype=self.kv_dtype).element_size()
        return (self.kv_layout.num_tensor_slots * self.block_size
                * kv_bytes_per_token(self.model_config, element_size))

    def max_num_tokens_per_sequence(self, chunk_tokens: int) -> int:
        """The longest sequence the cache can hold alone, with prefill chunks of `chunk_tokens`."""
        bs, groups = self.block_size, self.kv_layout.groups
        # a local group's reach (or None)
        spans = [g.sliding_window or g.attention_chunk for g in groups]
        window_blocks = sum(-(-(w - 1 + chunk_tokens) // bs) + 2 for w in spans if w is not None)
        num_full_groups = sum(1 for w in spans if w is None)
        if not num_full_groups:  # only windows: any length, if one sequence's windows fit at all
            return (self.model_config.max_position_embeddings if window_blocks <= self.num_blocks
                    else 0)
        return max(0, self.num_blocks - window_blocks) // num_full_groups * bs

    def _num_blocks_for_budget(self) -> int:
        """Blocks the budget holds; a tensor-parallel rank counts the bytes of every rank's slice,
        so all ranks hold the same block ids and the budget is the replica's."""
        bytes_per_block = self.bytes_per_block
        if self.shard is not None:
            bytes_per_block = self.shard.replica_bytes_per_block(bytes_per_block)
        num_blocks = self.config.cache.kv_cache_memory_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-memory must hold at least one block ({bytes_per_block} "
                             "bytes)")
        return int(num_blocks)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        if self._native_decode is None:
            return self._execute(batch)
        # prompt rows: the bf16 step, decode rows native
        bf16_prefill = self._prefill_step is not None
        runs_prefill = self._native_decode.runs_prefill and not bf16_prefill
        natives = [s for s in batch.sequences if runs_prefill or _is_decode(s)]
        if not natives:
            return (self._execute_native(batch.sequences, prefill=True) if bf16_prefill
                    else self._execute(batch))
        native = self._execute_native(natives)
        if len(natives) == len(batch.sequences):
            return native
        prompts = [s for s in batch.sequences if not _is_decode(s)]
        rest = (self._execute_native(prompts, prefill=True) if bf16_prefill
                else self._execute(ScheduledBatch(prompts)))
        # (a rest without sampled rows is [0, local vocab] on a tensor-parallel rank: not
        # concatenated)
        logits = torch.cat([native.logits, rest.logits]) if len(rest.logits) else native.logits
        return StepLogits(native.request_ids + rest.request_ids, logits,
                          {**native.prompt_logits, **rest.prompt_logits})

    def _execute(self, batch: ScheduledBatch) -> StepLogits:
        decodes, num_plain, groups = self._plan_decodes(
            [s for s in batch.sequences if s.num_scheduled_tokens == 1 and s.start_position > 0])
        prefills = [s for s in batch.sequences
                    if not (s.num_scheduled_tokens == 1 and s.start_position > 0)]
        ordered = decodes + prefills
        input_ids, positions, per_group = self._prepare(decodes, prefills, num_plain, groups)
        per_layer = None
        if len(per_group) > 1:
            per_layer = tuple(per_group[g] for g in self.kv_layout.layer_group)
        with forward_context(per_group[0], per_layer):
            hidden = self._forward(input_ids, positions, self.kv_caches)
        rows, request_ids, spans, row = [], [], [], 0
        for seq in ordered:
            if seq.needs_prompt_logits:
                spans.append((seq.request_id, row, row + seq.num_scheduled_tokens))
            row += seq.num_scheduled_tokens
            if seq.needs_sample:
                rows.append(row - 1)
                request_ids.append(seq.request_id)
        if not rows and not spans:
            return StepLogits([], torch.empty(0, self.model_config.vocab_size))
        index = torch.tensor(_with_spans(rows, spans), dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        logits = logits.cpu() if logits.device.type != "cpu" else logits
        return _split_logits(request_ids, logits, spans)

    def _execute_native(self, seqs: list[ScheduledSequence], prefill: bool = False) -> StepLogits:
        """These sequences through the native kernels (engine/models/llama_decode.py), a row per
        scheduled token; logits only for each sampling sequence's last row. `prefill`: prompt
        chunks through the bf16 prefill step instead (engine/models/llama_prefill.py)."""
        assert self._native_decode is not None
        bs = self.block_size
        tables = block_table_tensor([s.block_table for s in seqs])  # [S, W] (one full group here)
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)),
                                            # [M]
                                            torch.tensor([s.num_scheduled_tokens for s in seqs]))
        positions = torch.cat([torch.arange(s.start_position, s.seq_len) for s in seqs])  # [M]
        row_tables = tables[seq_index]  # [M, W]
        slots = row_tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        ends = list(accumulate(s.num_scheduled_tokens for s in seqs))  # [S] each sequence's row end
        sampled = [i for i, s in enumerate(seqs) if s.needs_sample]
        spans = [(s.request_id, end - s.num_scheduled_tokens, end)
                 for s, end in zip(seqs, ends, strict=True) if s.needs_prompt_logits]
        rows = [ends[i] - 1 for i in sampled]
        every_row = not spans and len(sampled) == len(positions)
        logit_rows = torch.tensor(_with_spans(rows, spans), dtype=torch.long)  # [S + span rows]
        step = DecodeInputs(input_ids=torch.tensor([t for s in seqs for t in s.token_ids]),
                            positions=positions, slots=slots, block_tables=row_tables,
                            context_lens=positions + 1,
                            logit_rows=None if every_row else logit_rows)
        if prefill:
            assert self._prefill_step is not None
            logits = self._prefill_step(step, self.kv_caches)
        else:
            logits = self._native_decode(step, self.kv_caches)  # [len(rows) + span rows, vocab]
        return _split_logits([seqs[i].request_id for i in sampled], logits, spans)

    def _prepare(self, decodes: list[ScheduledSequence], prefills: list[ScheduledSequence],
                 num_plain: int, groups: list[tuple[int, int, int]]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """Step tensors and one AttentionMetadata per KV cache group. `decodes` come ordered by
        `_plan_decodes` (plain rows, then cascade groups); rows are in that order in every group."""
        seqs = decodes + prefills
        ids: list[int] = []
        pos: list[int] = []
        for seq in seqs:
            ids.extend(seq.token_ids)
            pos.extend(range(seq.start_position, seq.seq_len))
        positions = torch.tensor(pos, dtype=torch.int64)
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)),
                                            torch.tensor([s.num_scheduled_tokens for s in seqs]))
        per_group = []
        for g, group in enumerate(self.kv_layout.groups):
            cascade = (num_plain, groups) if g == 0 else (len(decodes), [])  # cascade: group 0 only
            per_group.append(self._group_metadata(g, group, decodes, prefills, *cascade,
                                                  positions, seq_index))
        to = self.device
        return torch.tensor(ids, dtype=torch.int64, device=to), positions.to(to), per_group

    def _group_metadata(self, g: int, group: KVCacheGroup, decodes: list[ScheduledSequence],
                        prefills: list[ScheduledSequence], num_plain: int,
                        groups: list[tuple[int, int, int]], positions: torch.Tensor,
                        seq_index: torch.Tensor) -> AttentionMetadata:
        """Group g's metadata. Window and chunk groups gather only the blocks each row can see."""
        bs, to = self.block_size, self.device
        seqs = decodes + prefills
        tables = block_table_tensor([s.block_tables[g] for s in seqs])  # [S, max_blocks]
        slot_mapping = tables[seq_index, positions // bs] * bs + positions % bs  # [T]

        decode_blocks = decode_mask = decode_context_lens = first_positions = None
        decode_len = 0
        if num_plain:
            plain_lens = [s.seq_len for s in decodes[:num_plain]]
            if group.is_full:
                decode_blocks, decode_len, decode_mask = padded_blocks(tables[:num_plain],
                                                                       plain_lens,
                                                                        0, bs, to)
            else:  # the query at n - 1 sees from its window's or chunk's first position on
                firsts = [group.first_visible_position(n - 1) // bs for n in plain_lens]
                decode_blocks, decode_len, first_positions = blocks_from(tables[:num_plain],
                                                                         plain_lens,
                                                                          firsts, bs, to)
            decode_context_lens = torch.tensor(plain_lens, dtype=torch.int64, device=to)
        cascade_groups = []
        for start, end, num_prefix_blocks in groups:
            suffix_blocks, suffix_len, suffix_mask = padded_blocks(
                tables[start:end], [s.seq_len for s in decodes[start:end]], num_prefix_blocks, bs,
                to)
            cascade_groups.append(CascadeGroup(start, end, tables[start, :num_prefix_blocks].to(to),
                                               suffix_blocks, suffix_len, suffix_mask))

        segments = []
        query_start = len(decodes)
        for i, seq in enumerate(prefills):
            first = group.first_visible_position(seq.start_position) // bs
            query_end = query_start + seq.num_scheduled_tokens
            context_blocks = tables[len(decodes) + i, first:-(-seq.seq_len // bs)].to(to)
            segments.append(PrefillSegment(query_start, query_end, context_blocks, seq.seq_len,
                                           seq.start_position, context_start=first * bs))
            query_start = query_end

        return AttentionMetadata(
            slot_mapping=slot_mapping.to(to),
            num_decode_tokens=len(decodes),
            decode_blocks=decode_blocks,
            decode_len=decode_len,
            decode_mask=decode_mask,
            prefills=tuple(segments),
            cascade_groups=tuple(cascade_groups),
            max_query_len=max(s.num_scheduled_tokens for s in seqs),
            max_seq_len=max(s.seq_len for s in seqs),
            cu_query_lens=torch.tensor(list(accumulate((s.num_scheduled_tokens for s in seqs),
                                                       initial=0)),
                                       dtype=torch.int32, device=to),
            seq_lens=torch.tensor([s.seq_len for s in seqs], dtype=torch.int32, device=to),
            block_tables=tables.to(torch.int32).to(to),
            decode_context_lens=decode_context_lens,
            decode_first_positions=first_positions,
        )

    def _plan_decodes(self, decodes: list[ScheduledSequence]
                      ) -> tuple[list[ScheduledSequence], int, list[tuple[int, int, int]]]:
        """Order decode rows: plain rows first, then cascade groups side by side.

        Returns (ordered rows, number of plain rows, [(row_start, row_end, num_shared_blocks)]). A
        group is worth it only when >= CASCADE_MIN_GROUP sequences share >=
        CASCADE_MIN_PREFIX_BLOCKS leading blocks (the same physical blocks: the prefix cache made
        them shared).
        """
        if not self.enable_cascade or len(decodes) < CASCADE_MIN_GROUP:
            return decodes, len(decodes), []
        by_first_block: dict[int, list[ScheduledSequence]] = {}
        for seq in decodes:
            by_first_block.setdefault(seq.block_table[0], []).append(seq)
        plain: list[ScheduledSequence] = []
        grouped: list[tuple[list[ScheduledSequence], int]] = []
        for members in by_first_block.values():
            shared = 0
            if len(members) >= CASCADE_MIN_GROUP:
                shared = num_shared_blocks([m.block_table for m in members],
                                            [m.seq_len for m in members], self.block_size)
            if shared >= CASCADE_MIN_PREFIX_BLOCKS:
                grouped.append((members, shared))
            else:
                plain.extend(members)
        ordered, groups = list(plain), []
        for members, shared in grouped:
            groups.append((len(ordered), len(ordered) + len(members), shared))
            ordered.extend(members)
        return ordered, len(plain), groups

    def warmup(self) -> float:
        """One small forward pass so the first request does not pay for lazy initialisation."""
        start = time.perf_counter()
        seq = ScheduledSequence("warmup", [0] * min(8, self.block_size), 0, [0], True,
                                extra_block_tables=([0],) * (len(self.kv_layout.groups) - 1))
        self.execute(ScheduledBatch([seq]))
        for k, v in self.kv_caches:
            k[0].zero_()
            v[0].zero_()
        return time.perf_counter() - start


def _compute_info(model, config: EngineConfig, native_step: object) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """How this replica computes, for /v1/models and the metrics: the decode-weights mode, what the
    first layer's attention projections run on (`weights`: q4-native / q8_0-native on the native
    kernels' Q4_1 / Q8_0 blocks, q4-int4, or the float dtype) and whether those blocks are the
    file's or quantized at load (`weights_source`), the same for the MoE experts (`experts`, None
    for a dense model), the fused native step, and on the CPU the kernel variant chosen at start-up
    (engine/kernels/cpu/isa.py)."""
    from engine.layers.native_linear import NativeQuantLinear
    from engine.layers.q4_linear import Q4DecodeLinear

    layers = list(getattr(model, "layers", ()))
    first = layers[0] if layers else None
    linears = [getattr(first, name, None) for name in ("qkv", "o_proj")]
    native = next((w for w in linears if isinstance(w, NativeQuantLinear)), None)
    weights = (f"{_block_label(native.block_type)}-native" if native is not None
               else "q4-int4" if any(isinstance(w, Q4DecodeLinear) for w in linears)
               else config.resolved_dtype)
    source = None
    if native is not None:
        source = "quantized at load" if native.quantized_at_load else "file"
    info: dict[str, object] = {"decode_weights": config.decode_weights, "weights": weights,
                               "weights_source": source, "experts": _experts_info(layers, config),
                               "native_step": getattr(native_step, "name", None)}
    if config.device.startswith("cpu"):
        from engine.kernels import cpu as native
        from engine.kernels.cpu import isa

        selection = isa.selection()
        info["cpu_isa"] = native.loaded_variant()  # None: the native kernels are off
        info["cpu_isa_forced"] = selection.forced
        # the runner sets the bf16 prefill ISA where prompt rows use it
        info["cpu_prefill_isa"] = None
        info["cpu_features"] = list(selection.features)
    return info


def _block_label(block_type: str) -> str:
    """The kernel block format as /v1/models names it: Q4_1 (the file's Q4_0 / Q4_1) is "q4"."""
    return "q4" if block_type == "Q4_1" else block_type.lower()


def _experts_info(layers: list[object], config: EngineConfig) -> str | None:
    """What the first MoE layer's routed experts run on: "<format>-native (file|quantized at load)",
    "mxfp4", "fp8" or the float dtype; None for a model without experts."""
    from engine.layers.native_experts import NativeExperts

    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not hasattr(mlp, "router"):  # a dense MLP (every MoE layer class has a router)
            continue
        experts = getattr(mlp, "native", None) or getattr(mlp, "experts", None)
        if isinstance(experts, NativeExperts):
            source = "quantized at load" if experts.quantized_at_load else "file"
            return f"{_block_label(experts.block_type)}-native ({source})"
        if getattr(experts, "is_mxfp4", False):
            return "mxfp4"
        return "fp8" if getattr(experts, "fp8", False) else config.resolved_dtype
    return None


def _native_decode_step(model, config: EngineConfig, shard: RankShard | None = None):  # type: ignore[no-untyped-def]
    """The native decode step for this model and mode (CPU, float32, native kernels built), else
    None; a tensor-parallel rank's with its collectives (engine/parallel/native_step.py)."""
    from engine.kernels import cpu as native

    if (config.compile or config.device != "cpu" or config.resolved_dtype != "float32"
            or not hasattr(model, "layers") or model.config.has_sliding_layers
            or not native.load()):
        return None  # (the native attention kernel has no sliding window)
    if shard is not None:
        return shard.native_step(model, config.decode_weights)
    from engine.models.llama_decode import native_step

    return native_step(model, config.decode_weights)  # (q4 without native blocks: the float step)


def _bf16_prefill_step(model, native_step: object, shard: RankShard | None):  # type: ignore[no-untyped-def]
    """The bf16 prefill step (engine/models/llama_prefill.py) where engine/kernels/cpu/isa.py chose
    a bf16 prefill ISA and the q4 native step serves this model on one rank; else None."""
    if shard is not None or native_step is None:
        return None
    from engine.kernels.cpu import isa

    if isa.selection().prefill is None:
        return None
    from engine.models.llama_prefill import bf16_prefill_step

    step = bf16_prefill_step(model)
    if step is not None:
        logger.info("prompt rows: bf16 GEMMs (%s), attention and decode rows on the native kernels",
                    isa.selection().prefill)
    return step


def _with_spans(rows: list[int], spans: list[tuple[str, int, int]]) -> list[int]:
    """The rows to compute logits for: the sampled rows, then every row of each span."""
    return rows + [r for _, first, end in spans for r in range(first, end)]


def _split_logits(request_ids: list[str], logits: torch.Tensor, spans: list[tuple[str, int, int]]
                  ) -> StepLogits:
    """Logits of `_with_spans` rows -> the sampled rows' and each span's own (views)."""
    num_sampled = len(request_ids)
    prompt_logits, first = {}, num_sampled
    for request_id, start, end in spans:
        prompt_logits[request_id] = logits[first:first + end - start]  # [end - start, vocab]
        first += end - start
    return StepLogits(request_ids, logits[:num_sampled], prompt_logits)


def _is_decode(seq: ScheduledSequence) -> bool:
    return seq.num_scheduled_tokens == 1 and seq.start_position > 0




def _compiled_forward(model):  # type: ignore[no-untyped-def]
    """torch.compile the model's forward with dynamic shapes (the token count varies every step).

    Attention reads per-step metadata, so this model's attention call stays eager and splits the
    graph; the element-wise runs between (norms, rotary, residual adds, SiLU-and-mul) and the dense
    GEMMs are compiled. Measured on the 2-core CPU it is SLOWER than eager
    (bench/results/engine-cpu.md: the graph breaks cost more than the fusion saves at 135M
    parameters), so it is off by default.
    """
    model.attention.forward = torch.compiler.disable(model.attention.forward)
    return torch.compile(model.forward, dynamic=True)
