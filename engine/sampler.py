"""Sampler: one batched call turns a step's logits into one next token per sequence.

Per row, in this order (OpenAI semantics, vLLM's processing order):

    raw logits ──► logprobs, when asked: log_softmax of the RAW logits, before penalties and
       │           temperature (vLLM's default "raw_logprobs"; what the model itself believed)
       ├─ presence/frequency penalties over the tokens generated so far (never the prompt):
       │      logit -= presence * (count > 0) + frequency * count
       ├─ min_tokens: eos ids and stop_token_ids set to -inf while num_output_tokens < min_tokens
       ├─ grammar (structured output): tokens the row's bitmask does not allow set to -inf
       ├─ temperature == 0 ──► argmax
       └─ logits / temperature ──► top_k ──► top_p (keeps at least one token) ──► sample

Sampling is inverse-CDF (what torch.multinomial does), vectorized over the batch with one
uniform number per row. A row whose request has a seed draws its number from the request's own
generator, so its tokens do not depend on which other rows share the batch; every other row
draws from one engine-wide generator in a single call. (An exponential race, argmax(probs / q)
with q ~ Exp(1), needs a random number per vocabulary entry: ten times slower on CPU.)

Fast path: when every row is greedy with no penalties, no logprobs, no active min_tokens and no
grammar, the whole step is one argmax.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contracts.sampling_params import SamplingParams
from engine.outputs import TokenLogprob
from engine.structured_output import unpack_bitmask


@dataclass(frozen=True)
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
    token_bitmask: torch.Tensor | None = None  # int32 [num_words]: the grammar's allowed tokens

    @property
    def blocked_token_ids(self) -> tuple[int, ...]:
        """Token ids that may not be sampled this step (min_tokens not reached yet)."""
        if self.num_output_tokens >= self.params.min_tokens:
            return ()
        return self.eos_token_ids + self.params.stop_token_ids

    @property
    def is_plain_greedy(self) -> bool:
        p = self.params
        return (p.is_greedy and not p.has_penalties and not p.logprobs
                and not self.blocked_token_ids
                and self.token_bitmask is None)


@dataclass(frozen=True)
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
        processed = apply_token_bitmasks(apply_min_tokens(apply_penalties(raw, rows), rows), rows)
        sample_idx = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not sample_idx:
            token_ids = processed.argmax(dim=-1)  # [num_rows]
        elif len(sample_idx) == num_rows:
            token_ids = self._draw(top_k_top_p_probs(processed, [r.params for r in rows]), rows)
        else:
            # argmax over every row reads the logits once: cheaper than copying out greedy rows
            token_ids = processed.argmax(dim=-1)
            idx = torch.tensor(sample_idx, device=logits.device)
            sample_rows = [rows[i] for i in sample_idx]
            probs = top_k_top_p_probs(processed[idx], [row.params for row in sample_rows])
            token_ids[idx] = self._draw(probs, sample_rows)

        token_id_list = token_ids.tolist()
        return SamplerOutput(token_id_list, compute_logprobs(raw, rows, token_ids))

    def _draw(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Inverse-CDF sampling: one token per row of probs [n, vocab] -> [n].

        One uniform number per row: a seeded row draws it from its own generator, the others
        share one draw from the engine-wide generator.
        """
        n = probs.shape[0]
        uniform = torch.empty(n, device=probs.device)  # [n], in [0, 1)
        shared_idx = [i for i, row in enumerate(rows) if row.generator is None]
        if len(shared_idx) == n:
            uniform.uniform_(generator=self._generator(probs.device))
        elif shared_idx:
            shared = torch.empty(len(shared_idx), device=probs.device)
            shared.uniform_(generator=self._generator(probs.device))
            uniform[torch.tensor(shared_idx, device=probs.device)] = shared
        for i, row in enumerate(rows):  # unavoidable: one private generator per seeded request
            if row.generator is not None:
                own = torch.empty(1, device=row.generator.device)
                uniform[i] = own.uniform_(generator=row.generator).to(probs.device)[0]
        cdf = probs.cumsum(dim=-1)  # [n, vocab], non-decreasing
        # target in (0, total]: the first index whose cdf reaches it has a nonzero probability
        target = (1.0 - uniform[:, None]) * cdf[:, -1:]  # [n, 1]
        return torch.searchsorted(cdf, target).squeeze(1)

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
    seen = torch.unique(position)  # once per distinct (row, token)
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


def apply_token_bitmasks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Sets the tokens a row's grammar does not allow to -inf (rows without a grammar untouched).

    Returns a new tensor when any row has a grammar, else `logits` itself.
    """
    masked = [i for i, row in enumerate(rows) if row.token_bitmask is not None]
    if not masked:
        return logits
    vocab_size = logits.shape[1]
    bitmask = torch.stack([rows[i].token_bitmask for i in masked])  # type: ignore[misc]  # [m, words]
    allowed = unpack_bitmask(bitmask, vocab_size).to(logits.device)  # [m, vocab]
    out = logits.clone()
    idx = torch.tensor(masked, device=logits.device)
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out


def top_k_top_p_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top_k, then top_p; returns probs [n, vocab] (zero outside the kept set).

    top_p keeps the smallest set of best tokens whose probability reaches top_p, so always at
    least the best one. At both boundaries, tokens tied with the last kept one are kept too.
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
        unlimited = torch.tensor([k == vocab_size for k in top_k], device=device)
        kth.masked_fill_(unlimited[:, None], float("-inf"))  # those rows drop nothing
        scaled.masked_fill_(scaled < kth, float("-inf"))

    probs = scaled.softmax(dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device)
        probs.masked_fill_(probs < _nucleus_floor(probs, top_p), 0.0)
    return probs


# Nucleus candidates tried before a full sort: the nucleus is usually a few dozen tokens.
_TOP_P_CANDIDATES = (64, 1024)


def _nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [n, vocab], top_p [n] -> [n, 1]: the smallest probability inside each nucleus.

    A token is in the nucleus when the mass of the tokens ranked above it is below top_p. Rows
    with top_p == 1 get 0 (keep everything). Each row looks at its k best (k = 64, then 1024,
    then the whole vocabulary) until they cover top_p: a full sort is the slow part.
    """
    n, vocab_size = probs.shape
    floor = torch.zeros((n, 1), device=probs.device)
    pending = (top_p < 1.0).nonzero().squeeze(1)  # rows whose floor is not known yet
    for k in (*(k for k in _TOP_P_CANDIDATES if k < vocab_size), vocab_size):
        if pending.numel() == 0:
            break
        candidates = probs if pending.numel() == n else probs[pending]  # [num_pending, vocab]
        values, _ = candidates.topk(k, dim=-1)  # [num_pending, k], best first
        mass_above = values.cumsum(dim=-1) - values  # [num_pending, k]
        p = top_p[pending][:, None]  # [num_pending, 1]
        covered = (mass_above[:, -1:] + values[:, -1:] >= p).squeeze(1) | (k == vocab_size)
        num_kept = (mass_above < p).sum(dim=-1, keepdim=True)  # >= 1: nothing is above the best
        floor[pending[covered]] = values.gather(1, num_kept - 1)[covered]
        pending = pending[~covered]
    return floor


def compute_logprobs(
    raw_logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> list[TokenLogprob | None]:
    """The chosen token's logprob and the best `top_logprobs` alternatives, from the RAW logits."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    want = [i for i, row in enumerate(rows) if row.params.logprobs]
    if not want:
        return out
    if len(want) == len(rows):
        wanted, wanted_ids = raw_logits, token_ids
    else:
        idx = torch.tensor(want, device=raw_logits.device)
        wanted, wanted_ids = raw_logits[idx], token_ids[idx]  # [num_want, vocab], [num_want]
    found = logprobs_of(wanted, wanted_ids, [rows[i].params.top_logprobs for i in want])
    for i, entry in zip(want, found, strict=True):
        out[i] = entry
    return out


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, num_tops: Sequence[int]
                ) -> list[TokenLogprob]:
    """logits [n, vocab], token_ids [n] -> per row: that token's logprob and the row's best
    `num_tops[row]` alternatives (log_softmax of the logits as given)."""
    logits = logits.float()
    # log_softmax(x)[t] == x[t] - logsumexp(x): no [n, vocab] log_softmax table
    log_total = logits.logsumexp(dim=-1, keepdim=True)  # [n, 1]
    chosen = (logits.gather(1, token_ids[:, None]) - log_total).squeeze(1).tolist()
    max_top = max(num_tops, default=0)
    top_values: list[list[float]] = [[] for _ in num_tops]
    top_ids: list[list[int]] = [[] for _ in num_tops]
    if max_top:
        values, ids = logits.topk(max_top, dim=-1)  # [n, max_top], best first
        top_values, top_ids = (values - log_total).tolist(), ids.tolist()
    return [TokenLogprob(token_id=token_id, logprob=logprob,
                         top=tuple(zip(top_ids[j][:num_top], top_values[j][:num_top], strict=True)))
            for j, (token_id, logprob, num_top) in enumerate(
                zip(token_ids.tolist(), chosen, num_tops, strict=True))]
