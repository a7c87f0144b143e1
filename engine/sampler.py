"""Sampler: one batched call turns a step's logits into one next token per sequence.

Per row, in this order (OpenAI semantics, vLLM's processing order):

    raw logits ──► logprobs, when asked: log_softmax of the RAW logits, before penalties and
       │           temperature (vLLM's default "raw_logprobs"; what the model itself believed)
       ├─ presence/frequency penalties over the tokens generated so far (never the prompt):
       │      logit -= presence * (count > 0) + frequency * count
       ├─ min_tokens: eos ids and stop_token_ids set to -inf while num_output_tokens < min_tokens
       ├─ temperature == 0 ──► argmax
       └─ logits / temperature ──► top_k ──► top_p (keeps at least one token) ──► sample

Sampling is an exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. picks token i with
probability probs[i] (the Gumbel-max trick in another form), so a whole batch samples in one
vectorized call. A row whose request has a seed draws its q from the request's own generator,
so its tokens do not depend on which other rows share the batch; every other row draws from one
engine-wide generator in a single call.

Fast path: when every row is greedy with no penalties, no logprobs and no active min_tokens,
the whole step is one argmax.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence for this step.

    `generator` is set when `params.seed` is given: the caller creates it once per request
    (`torch.Generator().manual_seed(seed)`) and passes the same object every step. It may live on
    any device; the row's random numbers are drawn there.
    """

    params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: Sequence[int]  # generated so far (penalties count these, not the prompt)
    num_output_tokens: int
    eos_token_ids: tuple[int, ...]

    @property
    def blocked_token_ids(self) -> tuple[int, ...]:
        """Token ids that may not be sampled this step (min_tokens not reached yet)."""
        if self.num_output_tokens >= self.params.min_tokens:
            return ()
        return self.eos_token_ids + self.params.stop_token_ids

    @property
    def is_plain_greedy(self) -> bool:
        p = self.params
        return p.is_greedy and not p.has_penalties and not p.logprobs and not self.blocked_token_ids


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row, in row order
    logprobs: list[TokenLogprob | None]  # None for rows that did not ask for logprobs


class Sampler:
    """Samples one token per row of `logits` [num_rows, vocab_size].

    `seed` seeds the engine-wide generator used by rows without their own generator (None: a
    nondeterministic seed). The caller's logits tensor is never modified.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        num_rows, _ = logits.shape
        assert num_rows == len(rows), f"{num_rows} logit rows for {len(rows)} sampling rows"
        if all(row.is_plain_greedy for row in rows):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * num_rows)

        raw = logits.float()
        processed = apply_min_tokens(apply_penalties(raw, rows), rows)
        token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)

        greedy_idx = [i for i, row in enumerate(rows) if row.params.is_greedy]
        sample_idx = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if greedy_idx:
            idx = torch.tensor(greedy_idx, device=logits.device)
            token_ids[idx] = processed[idx].argmax(dim=-1)
        if sample_idx:
            idx = torch.tensor(sample_idx, device=logits.device)
            sample_rows = [rows[i] for i in sample_idx]
            probs = top_k_top_p_probs(processed[idx], [row.params for row in sample_rows])
            token_ids[idx] = self._race(probs, sample_rows)

        token_id_list = token_ids.tolist()
        return SamplerOutput(token_id_list, compute_logprobs(raw, rows, token_ids))

    def _race(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1): one sample per row of probs [n, vocab] -> [n]."""
        uniform = torch.empty_like(probs)  # [n, vocab], in [0, 1)
        shared_idx = [i for i, row in enumerate(rows) if row.generator is None]
        if len(shared_idx) == len(rows):
            uniform.uniform_(generator=self._generator(probs.device))
        elif shared_idx:
            shared = torch.empty((len(shared_idx), probs.shape[1]), device=probs.device)
            shared.uniform_(generator=self._generator(probs.device))
            uniform[torch.tensor(shared_idx, device=probs.device)] = shared
        for i, row in enumerate(rows):  # unavoidable: one private generator per seeded request
            if row.generator is not None:
                own = torch.empty(probs.shape[1], device=row.generator.device)
                uniform[i] = own.uniform_(generator=row.generator).to(probs.device)
        # -log(u) ~ Exp(1); u < 1 keeps q > 0, and u == 0 gives q = inf, i.e. probs / q == 0.
        # (Tensor.exponential_ is several times slower on CPU than uniform_ + log.)
        q = uniform.log_().neg_()
        return (probs / q).argmax(dim=-1)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logit -= presence * (count > 0) + frequency * count, counting generated tokens only.

    Returns a new tensor when any row has penalties and generated tokens, else `logits` itself.
    Works on the generated positions only (no [rows, vocab] count table).
    """
    pen = [i for i, row in enumerate(rows) if row.params.has_penalties and row.output_token_ids]
    if not pen:
        return logits
    device = logits.device
    num_rows, vocab_size = logits.shape
    lengths = torch.tensor([len(rows[i].output_token_ids) for i in pen], device=device)
    flat_ids = list(itertools.chain.from_iterable(rows[i].output_token_ids for i in pen))
    # row_of_token: [total_generated], the batch row of each generated token
    row_of_token = torch.repeat_interleave(torch.tensor(pen, device=device), lengths)
    position = row_of_token * vocab_size + torch.tensor(flat_ids, device=device)
    presence = torch.tensor([row.params.presence_penalty for row in rows], device=device)
    frequency = torch.tensor([row.params.frequency_penalty for row in rows], device=device)

    out = logits.clone(memory_format=torch.contiguous_format)
    flat_out = out.view(num_rows * vocab_size)
    flat_out.index_add_(0, position, frequency[row_of_token], alpha=-1.0)  # once per occurrence
    seen = position.unique()  # once per distinct (row, token)
    flat_out.index_add_(0, seen, presence[seen // vocab_size], alpha=-1.0)
    return out


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Sets eos and stop token ids to -inf in rows that have not reached min_tokens yet.

    Returns a new tensor when anything is blocked, else `logits` itself.
    """
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i, row in enumerate(rows):
        blocked = row.blocked_token_ids
        row_idx.extend([i] * len(blocked))
        col_idx.extend(blocked)
    if not row_idx:
        return logits
    out = logits.clone()
    device = logits.device
    out[torch.tensor(row_idx, device=device), torch.tensor(col_idx, device=device)] = float("-inf")
    return out


def top_k_top_p_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top_k, then top_p; returns probs [n, vocab] (zero outside the kept set).

    Ties at the top_k boundary are all kept. top_p keeps the smallest set of best tokens whose
    probability reaches top_p, and always at least the best one.
    """
    n, vocab_size = logits.shape
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temperature[:, None]  # [n, vocab]

    top_k = [min(p.top_k, vocab_size) if p.top_k is not None else vocab_size for p in params]
    if min(top_k) < vocab_size:
        max_k = max(k for k in top_k if k < vocab_size)
        best, _ = scaled.topk(max_k, dim=-1)  # [n, max_k], descending
        k = torch.tensor([min(k, max_k) for k in top_k], device=device)
        kth = best.gather(1, (k - 1)[:, None])  # [n, 1]
        limited = torch.tensor([k < vocab_size for k in top_k], device=device)
        drop = (scaled < kth) & limited[:, None]
        scaled = scaled.masked_fill(drop, float("-inf"))

    probs = scaled.softmax(dim=-1)
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p_rows:
        idx = torch.tensor(top_p_rows, device=device)
        top_p = torch.tensor([params[i].top_p for i in top_p_rows], device=device)
        probs[idx] = _top_p(probs[idx], top_p)
    return probs


# Nucleus candidates tried before a full sort: the nucleus is usually a few dozen tokens.
_TOP_P_CANDIDATES = (64, 1024)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [m, vocab], top_p [m] -> probs with every token outside the nucleus zeroed.

    A token stays when the mass of the tokens ranked above it is still below top_p, so the
    best token always stays. Each row takes its k best (k = 64, then 1024, then the whole
    vocabulary) until those cover top_p: a full sort of the vocabulary is the slow part.
    """
    m, vocab_size = probs.shape
    out = torch.zeros_like(probs)
    pending = torch.arange(m, device=probs.device)
    for k in (*(k for k in _TOP_P_CANDIDATES if k < vocab_size), vocab_size):
        values, ids = probs[pending].topk(k, dim=-1)  # [num_pending, k], best first
        mass_above = values.cumsum(dim=-1) - values  # [num_pending, k]
        covered = (mass_above[:, -1] + values[:, -1] >= top_p[pending]) | (k == vocab_size)
        rows = pending[covered]
        kept = values[covered].masked_fill(mass_above[covered] >= top_p[rows][:, None], 0.0)
        out[rows] = out[rows].scatter_(1, ids[covered], kept)
        pending = pending[~covered]
        if pending.numel() == 0:
            break
    return out


def compute_logprobs(
    raw_logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> list[TokenLogprob | None]:
    """The chosen token's logprob and the best `top_logprobs` alternatives, from the RAW logits."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    want = [i for i, row in enumerate(rows) if row.params.logprobs]
    if not want:
        return out
    idx = torch.tensor(want, device=raw_logits.device)
    logprobs = raw_logits[idx].log_softmax(dim=-1)  # [num_want, vocab]
    chosen = logprobs.gather(1, token_ids[idx][:, None]).squeeze(1).tolist()
    max_top = max(rows[i].params.top_logprobs for i in want)
    top_values: list[list[float]] = [[] for _ in want]
    top_ids: list[list[int]] = [[] for _ in want]
    if max_top:
        values, ids = logprobs.topk(max_top, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    chosen_ids = token_ids[idx].tolist()
    for j, i in enumerate(want):
        num_top = rows[i].params.top_logprobs
        top = tuple(zip(top_ids[j][:num_top], top_values[j][:num_top], strict=True))
        out[i] = TokenLogprob(token_id=chosen_ids[j], logprob=chosen[j], top=top)
    return out
