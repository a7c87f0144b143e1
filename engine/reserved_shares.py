"""Reserved shares (provisioned throughput): a project's share of every step's token budget and of
the KV blocks, which other projects cannot take while it has work.

    shares = ReservedShares({"acme": 0.25}, num_blocks, block_size)
    shares.begin_step(token_budget, scheduler.running, scheduler.waiting)
    n = shares.num_tokens_for(request, budget_left)      # what `request` may schedule
    shares.spend(request, n)
    shares.can_take_blocks(request, num_new_blocks, num_free_blocks)

A reservation is work-conserving: each step a project with work holds

    tokens: min(share * token budget, what its requests can use this step)
    blocks: min(share * num_blocks, the blocks its requests need) - the blocks they hold

and gives back what it does not use. Other projects' requests may schedule only the budget left
after the unspent reservations of every reserved project but their own, and admit a waiting
request only if its new blocks leave the others' unmet block reservations free. A project that
has no work holds nothing. The project is the one in the request's cache salt
(auth/cache_salt.py: "project:NAME", "key:NAME:KEY"); a request without one has none.

Blocks are counted in the first KV cache group (a request's computed tokens / block size).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from engine.request import Request


def project_of(cache_salt: str | None) -> str | None:
    """The project a cache salt names (auth/cache_salt.py's formats), or None."""
    if not cache_salt:
        return None
    kind, _, rest = cache_salt.partition(":")
    if kind == "project" and rest:
        return rest
    if kind == "key" and rest:
        return rest.rsplit(":", 1)[0] or None
    return None


class ReservedShares:
    def __init__(self, shares: dict[str, float], num_blocks: int, block_size: int) -> None:
        self.shares = dict(shares)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._unspent_tokens: dict[str, int] = {}  # this step's reservations not yet scheduled
        self._unmet_blocks: dict[str, int] = {}

    @property
    def is_active(self) -> bool:
        """Whether any reserved project has work this step (else nothing is held)."""
        return bool(self._unspent_tokens or self._unmet_blocks)

    def begin_step(self, token_budget: int, running: Iterable[Request], waiting: Iterable[Request]
                   ) -> None:
        demand_tokens: dict[str, int] = {}
        need_blocks: dict[str, int] = {}
        held_blocks: dict[str, int] = {}
        for request, is_running in [(r, True) for r in running] + [(r, False) for r in waiting]:
            project = project_of(request.cache_salt)
            if project not in self.shares:
                continue
            remaining = request.num_tokens - (request.num_computed_tokens if is_running else 0)
            demand_tokens[project] = demand_tokens.get(project, 0) + max(remaining, 1)
            need_blocks[project] = need_blocks.get(project, 0) + math.ceil(
                (request.num_tokens + 1) / self.block_size)
            if is_running:
                held_blocks[project] = held_blocks.get(project, 0) + math.ceil(
                    request.num_computed_tokens / self.block_size)
        self._unspent_tokens = {p: min(int(self.shares[p] * token_budget), demand)
                                for p, demand in demand_tokens.items()}
        self._unmet_blocks = {p: max(min(int(self.shares[p] * self.num_blocks), need)
                                     - held_blocks.get(p, 0), 0)
                              for p, need in need_blocks.items()}

    def num_tokens_for(self, request: Request, budget_left: int) -> int:
        """Tokens `request` may schedule now: the budget left less the other projects' unspent
        reservations."""
        project = project_of(request.cache_salt)
        held = sum(n for p, n in self._unspent_tokens.items() if p != project)
        return max(budget_left - held, 0)

    def spend(self, request: Request, num_tokens: int) -> None:
        project = project_of(request.cache_salt)
        if project in self._unspent_tokens:
            self._unspent_tokens[project] = max(self._unspent_tokens[project] - num_tokens, 0)

    def can_take_blocks(self, request: Request, num_new_blocks: int, num_free_blocks: int) -> bool:
        """Whether admitting `request` with `num_new_blocks` leaves the other projects' unmet
        block reservations free (its own project's reservation is its to use)."""
        project = project_of(request.cache_salt)
        held = sum(n for p, n in self._unmet_blocks.items() if p != project)
        return num_free_blocks - num_new_blocks >= held

    def took_blocks(self, request: Request, num_new_blocks: int) -> None:
        project = project_of(request.cache_salt)
        if project in self._unmet_blocks:
            self._unmet_blocks[project] = max(self._unmet_blocks[project] - num_new_blocks, 0)
