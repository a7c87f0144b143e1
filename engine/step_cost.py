"""The step-time model of the SLO scheduler (engine/slo.py): what a step costs, fitted from every
step the engine runs, recent steps weighing most.

    step_s = base_s + prefill_s_per_token * num_prefill_tokens + decode_s_per_seq * num_decode_seqs
             + attention_s_per_pair * num_attention_pairs

`num_attention_pairs` is the step's attention work: each scheduled sequence's new tokens times the
context they attend to (`attention_pairs`; a decode: its context). Without it a prefill chunk deep
in a long prompt (its queries attend to every position before them) costs far more than the same
number of tokens at its start, and a plan sized from a flat cost per token overruns the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_STEPS_FITTED = 4  # steps measured before the model predicts anything
_RIDGE = 1e-6  # keeps the fit solvable before the steps vary in every feature


def attention_pairs(start_position: int, num_tokens: int) -> int:
    """A chunk's attention work: its `num_tokens` queries times the context they attend to (every
    position up to the chunk's end; the backends score the chunk's block against all of it)."""
    return num_tokens * (start_position + num_tokens)


def prompt_pairs(start_position: int, num_tokens: int) -> int:
    """The attention work left in a prompt computed from `start_position` on, `num_tokens` more,
    in small chunks (each query attends to the positions before it)."""
    end = start_position + num_tokens
    return (end * (end + 1) - start_position * (start_position + 1)) // 2


@dataclass(frozen=True)
class StepCost:
    """Seconds a step takes: base + per prefill token + per decoding sequence + per attention pair
    (a query times a context position it attends to)."""

    base_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    attention_s_per_pair: float = 0.0

    def step_s(self, num_prefill_tokens: float, num_decode_seqs: float,
               num_attention_pairs: float = 0.0) -> float:
        return (self.base_s + self.prefill_s_per_token * num_prefill_tokens
                + self.decode_s_per_seq * num_decode_seqs
                + self.attention_s_per_pair * num_attention_pairs)

    def chunk_s(self, start_position: int, num_tokens: int) -> float:
        """A prefill chunk's share of a step (its tokens and its attention)."""
        return (self.prefill_s_per_token * num_tokens
                + self.attention_s_per_pair * attention_pairs(start_position, num_tokens))

    def max_chunk(self, start_position: int, room_s: float) -> int | None:
        """The most tokens a chunk starting at `start_position` fits into `room_s` (None: any)."""
        a = self.attention_s_per_pair
        b = self.prefill_s_per_token + a * start_position
        if room_s <= 0.0:
            return 0
        if a <= 0.0:
            return None if b <= 0.0 else int(room_s / b)
        n = int((-b + math.sqrt(b * b + 4.0 * a * room_s)) / (2.0 * a))  # a n^2 + b n <= room
        while n > 0 and self.chunk_s(start_position, n) > room_s:  # (float rounding)
            n -= 1
        return n


class StepCostModel:
    """Least squares of step_s on (1, prefill tokens, decode seqs, attention pairs) with
    exponential forgetting (`half_life_steps`): the model follows the machine as load and contexts
    change.

    The features are scaled by the step's limits (`prefill_scale` tokens, `decode_scale` seqs, a
    full chunk's pairs `prefill_scale ** 2`), so where the steps do not tell the terms apart (every
    step full, say) the minimum-norm solution splits a step's time evenly between its parts."""

    def __init__(self, half_life_steps: float = 64.0, prefill_scale: float = 512.0,
                 decode_scale: float = 64.0) -> None:
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._scales = (1.0, float(prefill_scale), float(decode_scale), float(prefill_scale) ** 2)
        self._xtx = [[0.0] * 4 for _ in range(4)]
        self._xty = [0.0] * 4
        self.num_steps = 0
        self.cost: StepCost | None = None  # None until MIN_STEPS_FITTED steps were measured

    def observe(self, num_prefill_tokens: int, num_decode_seqs: int, step_s: float,
                num_attention_pairs: int = 0) -> None:
        if num_prefill_tokens + num_decode_seqs <= 0 or not step_s > 0.0:
            return
        features = (1.0, num_prefill_tokens, num_decode_seqs, num_attention_pairs)
        x = [f / scale for f, scale in zip(features, self._scales, strict=True)]
        for i in range(4):
            for j in range(4):
                self._xtx[i][j] = self._xtx[i][j] * self._decay + x[i] * x[j]
            self._xty[i] = self._xty[i] * self._decay + x[i] * step_s
        self.num_steps += 1
        if self.num_steps >= MIN_STEPS_FITTED:
            fitted = _solve_nonnegative(self._xtx, self._xty)
            base, prefill, decode, pair = (max(v, 0.0) / scale
                                           for v, scale in zip(fitted, self._scales, strict=True))
            self.cost = StepCost(base, prefill, decode, pair)


def _solve_nonnegative(a: list[list[float]], b: list[float]) -> list[float]:
    """The least-squares fit (normal equations `a x = b`) with every term >= 0: a term that comes
    out negative is dropped (the most negative first) and the rest refitted. Clamping it to 0
    instead would leave the others fitted to it: steps that all look alike (one decode deep in a
    long context, a term collinear with the others) then predicted 130 ms for a 27 ms step."""
    terms = list(range(len(b)))
    while True:
        x = _solve([[a[i][j] for j in terms] for i in terms], [b[i] for i in terms])
        if min(x) >= 0.0 or len(terms) == 1:
            break
        del terms[x.index(min(x))]
    full = [0.0] * len(b)
    for term, value in zip(terms, x, strict=True):
        full[term] = max(value, 0.0)
    return full


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """(a + ridge) x = b by Gaussian elimination with partial pivoting."""
    n = len(b)
    m = [[a[i][j] + (_RIDGE if i == j else 0.0) for j in range(n)] + [b[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for row in range(col + 1, n):
            factor = m[row][col] / m[col][col]
            for k in range(col, n + 1):
                m[row][k] -= factor * m[col][k]
    x = [0.0] * n
    for row in reversed(range(n)):
        x[row] = (m[row][n] - sum(m[row][k] * x[k] for k in range(row + 1, n))) / m[row][row]
    return x
