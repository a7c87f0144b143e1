"""ModelRunner: owns the device, the weights, the KV tensors; turns a ScheduledBatch into logits.

Only this module builds device tensors. Per step:

    metadata = build from batch (slots, decode contexts, prefill segments)   # plain ints -> tensors
    with forward_context(metadata): hidden = model.forward(ids, positions, kv)
    logits = model.compute_logits(hidden[rows that sample])                  # only those rows
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.batch import ScheduledBatch, ScheduledSequence
from engine.config import EngineConfig, ModelConfig
from engine.layers.attention import (
    AttentionMetadata,
    PrefillSegment,
    build_attention_backend,
    forward_context,
)
from engine.models.registry import build_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StepLogits:
    request_ids: list[str]  # one per logits row, in row order
    logits: torch.Tensor  # [S, vocab] float32


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights: dict[str, torch.Tensor],
                 raw_weights: dict | None = None) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.resolved_dtype]
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        from engine.layers import attention_backend_name, make_linear_factory

        attention = build_attention_backend(attention_backend_name(self.device))
        self.model = build_model(model_config, weights, attention,
                                 make_linear_factory(config, self.device, raw_weights or {}))
        self.block_size = config.cache.block_size
        self.num_blocks = self._num_blocks_for_budget()
        shape = (self.num_blocks, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(model_config.num_layers)]
        logger.info("KV cache: %d blocks of %d tokens (%.0f MiB)", self.num_blocks, self.block_size,
                    self.num_blocks * self.bytes_per_block / 2**20)

    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * element_size

    def _num_blocks_for_budget(self) -> int:
        num_blocks = self.config.cache.kv_cache_memory_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-memory must hold at least one block ({self.bytes_per_block} bytes)")
        return int(num_blocks)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        decodes = [s for s in batch.sequences if s.num_scheduled_tokens == 1 and s.start_position > 0]
        prefills = [s for s in batch.sequences if not (s.num_scheduled_tokens == 1 and s.start_position > 0)]
        ordered = decodes + prefills
        input_ids, positions, metadata = self._prepare(decodes, prefills)
        with forward_context(metadata):
            hidden = self.model.forward(input_ids, positions, self.kv_caches)
        rows, request_ids, row = [], [], 0
        for seq in ordered:
            row += seq.num_scheduled_tokens
            if seq.needs_sample:
                rows.append(row - 1)
                request_ids.append(seq.request_id)
        if not rows:
            return StepLogits([], torch.empty(0, self.model_config.vocab_size))
        index = torch.tensor(rows, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return StepLogits(request_ids, logits.cpu() if logits.device.type != "cpu" else logits)

    def _prepare(self, decodes: list[ScheduledSequence], prefills: list[ScheduledSequence]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        for seq in decodes + prefills:
            ids.extend(seq.token_ids)
            pos.extend(range(seq.start_position, seq.seq_len))
        positions = torch.tensor(pos, dtype=torch.int64)
        tables = _block_table_tensor(decodes + prefills)  # [S, max_blocks]
        seq_index = torch.repeat_interleave(torch.arange(len(decodes) + len(prefills)),
                                            torch.tensor([s.num_scheduled_tokens for s in decodes + prefills]))
        slot_mapping = tables[seq_index, positions // bs] * bs + positions % bs  # [T]

        decode_slots = decode_mask = None
        if decodes:
            seq_lens = torch.tensor([s.seq_len for s in decodes])
            max_len = int(seq_lens.max())
            ctx = torch.arange(max_len)
            decode_slots = tables[: len(decodes), ctx // bs] * bs + ctx % bs  # [D, L]
            decode_mask = (ctx[None, :] < seq_lens[:, None]).view(len(decodes), 1, 1, max_len)
            decode_slots = decode_slots.masked_fill(~decode_mask.view(len(decodes), max_len), 0)

        segments = []
        query_start = len(decodes)
        for i, seq in enumerate(prefills):
            ctx = torch.arange(seq.seq_len)
            context_slots = tables[len(decodes) + i, ctx // bs] * bs + ctx % bs  # [C]
            mask = None
            if seq.start_position > 0:
                q_pos = torch.arange(seq.start_position, seq.seq_len)
                mask = ctx[None, :] <= q_pos[:, None]  # [q_len, C]
                mask = mask.to(self.device)
            query_end = query_start + seq.num_scheduled_tokens
            segments.append(PrefillSegment(query_start, query_end, context_slots.to(self.device), mask))
            query_start = query_end

        to = self.device
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping.to(to),
            num_decode_tokens=len(decodes),
            decode_slots=decode_slots.to(to) if decode_slots is not None else None,
            decode_mask=decode_mask.to(to) if decode_mask is not None else None,
            prefills=tuple(segments),
            cu_query_lens=torch.tensor([0] + _cumsum([s.num_scheduled_tokens for s in decodes + prefills]),
                                       dtype=torch.int32, device=to),
            seq_lens=torch.tensor([s.seq_len for s in decodes + prefills], dtype=torch.int32, device=to),
            block_tables=tables.to(torch.int32).to(to),
        )
        return torch.tensor(ids, dtype=torch.int64, device=to), positions.to(to), metadata

    def warmup(self) -> float:
        """One small forward pass so the first request does not pay for lazy initialisation."""
        start = time.perf_counter()
        seq = ScheduledSequence("warmup", [0] * min(8, self.block_size), 0, [0], True)
        self.execute(ScheduledBatch([seq]))
        for k, v in self.kv_caches:
            k[0].zero_()
            v[0].zero_()
        return time.perf_counter() - start


def _block_table_tensor(seqs: list[ScheduledSequence]) -> torch.Tensor:
    width = max(len(s.block_table) for s in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        table[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int64)
    return table


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
