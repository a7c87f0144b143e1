"""Reserved shares (provisioned throughput): a project's share of every step's token budget, of the
KV blocks and of the running batch's seats, which other projects cannot take while it has work,
and which it takes back from them when they hold it.

    shares = ReservedShares({"acme": 0.25}, num_blocks, block_size)
    shares.begin_step(token_budget, max_num_running, scheduler.running, scheduler.waiting)
    n = shares.num_tokens_for(request, budget_left)      # what `request` may schedule
    shares.spend(request, n)
    shares.can_take_blocks(request, num_new_blocks, num_free_blocks)
    shares.can_take_seat(request, num_free_seats)
    shares.is_protected(victim, preemptor)               # may `preemptor` preempt `victim`?

A reservation is work-conserving: each step a project with work holds

    tokens: min(share * token budget, what its requests can use this step)
    blocks: min(share * num_blocks, the blocks its requests need) - the blocks they hold
    seats:  min(max(share * running batch cap, 1), its requests) - its running requests

and gives back what it does not use. Other projects' requests may schedule only the budget left
after the unspent reservations of every reserved project but their own, admit a waiting request
only if its new blocks and its seat leave the others' unmet reservations free, and grow a running
request only into blocks no unmet reservation needs. A project that has no work holds nothing.

Taking back (the scheduler, at the start of each step): while the unmet block or seat reservations
exceed what is free, the running request of another project that is lowest in class and most
recently admitted is preempted (recompute), skipping projects that are short themselves and
reserved projects within their own share (`is_protected`): a reserved project that holds no more
than its share, in blocks and in seats, is never preempted by another project, whatever the
class; one over its share competes as any project does.

The project is the one in the request's cache salt (auth/cache_salt.py: "project:NAME",
"key:NAME:KEY"); a request without one has none. Blocks are counted in the first KV cache group
(a request's computed tokens / block size).
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
        self._unmet_seats: dict[str, int] = {}
        self._held_blocks: dict[str, int] = {}  # what each reserved project with work holds now
        self._held_seats: dict[str, int] = {}
        self._reserved_seats: dict[str, int] = {}
        # this step's waiting requests of reserved projects
        self.waiting_reserved: list[Request] = []

    @property
    def is_active(self) -> bool:
        """Whether any reserved project has work this step (else nothing is held)."""
        return bool(self._unspent_tokens)

    def reserved_blocks(self, project: str) -> int:
        return int(self.shares[project] * self.num_blocks)

    def begin_step(self, token_budget: int, max_num_running: int, running: Iterable[Request],
                   waiting: Iterable[Request]) -> None:
        demand_tokens: dict[str, int] = {}
        need_blocks: dict[str, int] = {}
        num_requests: dict[str, int] = {}
        self._held_blocks, self._held_seats = {}, {}
        self.waiting_reserved = []
        for request, is_running in [(r, True) for r in running] + [(r, False) for r in waiting]:
            project = project_of(request.cache_salt)
            if project not in self.shares:
                continue
            remaining = request.num_tokens - (request.num_computed_tokens if is_running else 0)
            demand_tokens[project] = demand_tokens.get(project, 0) + max(remaining, 1)
            need_blocks[project] = need_blocks.get(project, 0) + math.ceil(
                (request.num_tokens + 1) / self.block_size)
            num_requests[project] = num_requests.get(project, 0) + 1
            self._held_blocks.setdefault(project, 0)
            self._held_seats.setdefault(project, 0)
            if is_running:
                self._held_blocks[project] += self.blocks_of(request)
                self._held_seats[project] += 1
            else:
                self.waiting_reserved.append(request)
        self._reserved_seats = {p: max(int(self.shares[p] * max_num_running), 1)
                                for p in num_requests}
        self._unspent_tokens = {p: min(int(self.shares[p] * token_budget), demand)
                                for p, demand in demand_tokens.items()}
        self._unmet_blocks = {p: max(min(self.reserved_blocks(p), need) - self._held_blocks[p], 0)
                              for p, need in need_blocks.items()}
        self._unmet_seats = {p: max(min(self._reserved_seats[p], n) - self._held_seats[p], 0)
                             for p, n in num_requests.items()}

    def blocks_of(self, request: Request) -> int:
        """The blocks a running request holds, as reservations count them."""
        return math.ceil(request.num_computed_tokens / self.block_size)

    # ---- what other projects may take ------------------------------------------------------------
    def num_tokens_for(self, request: Request, budget_left: int) -> int:
        """Tokens `request` may schedule now: the budget left less the other projects' unspent
        reservations."""
        project = project_of(request.cache_salt)
        held = sum(n for p, n in self._unspent_tokens.items() if p != project)
        return max(budget_left - held, 0)

    def can_take_blocks(self, request: Request, num_new_blocks: int, num_free_blocks: int) -> bool:
        """Whether `request` taking `num_new_blocks` leaves the other projects' unmet block
        reservations free (its own project's reservation is its to use)."""
        project = project_of(request.cache_salt)
        held = sum(n for p, n in self._unmet_blocks.items() if p != project)
        return num_free_blocks - num_new_blocks >= held

    def can_take_seat(self, request: Request, num_free_seats: int) -> bool:
        """Whether admitting `request` leaves the other projects' unmet seat reservations free."""
        project = project_of(request.cache_salt)
        held = sum(n for p, n in self._unmet_seats.items() if p != project)
        return num_free_seats - 1 >= held

    def shortfall(self) -> tuple[int, int]:
        """(blocks, seats) the reserved projects with work are owed in all this step."""
        return sum(self._unmet_blocks.values()), sum(self._unmet_seats.values())

    def is_short(self, request: Request) -> bool:
        """Whether `request`'s project is owed blocks or seats this step."""
        project = project_of(request.cache_salt)
        return bool(self._unmet_blocks.get(project or "") or self._unmet_seats.get(project or ""))

    def owes_seat(self, request: Request) -> bool:
        """Whether `request`'s project is owed a seat this step."""
        return bool(self._unmet_seats.get(project_of(request.cache_salt) or ""))

    def is_protected(self, victim: Request, preemptor: Request | None) -> bool:
        """Whether `victim` (running) is inside its reserved project's share, which `preemptor`
        (None: a reservation taking blocks back) of another project may not preempt: the project
        holds no more than its share in blocks and in seats."""
        project = project_of(victim.cache_salt)
        if project not in self._held_blocks:
            return False
        if preemptor is not None and project_of(preemptor.cache_salt) == project:
            return False
        return (self._held_blocks[project] <= self.reserved_blocks(project)
                and self._held_seats[project] <= self._reserved_seats[project])

    # ---- bookkeeping as the step schedules -------------------------------------------------------
    def spend(self, request: Request, num_tokens: int) -> None:
        project = project_of(request.cache_salt)
        if project in self._unspent_tokens:
            self._unspent_tokens[project] = max(self._unspent_tokens[project] - num_tokens, 0)

    def took_blocks(self, request: Request, num_new_blocks: int) -> None:
        project = project_of(request.cache_salt)
        if project in self._unmet_blocks:
            self._unmet_blocks[project] = max(self._unmet_blocks[project] - num_new_blocks, 0)
            self._held_blocks[project] += num_new_blocks

    def took_seat(self, request: Request) -> None:
        project = project_of(request.cache_salt)
        if project in self._unmet_seats:
            self._unmet_seats[project] = max(self._unmet_seats[project] - 1, 0)
            self._held_seats[project] += 1

    def released(self, request: Request, num_blocks: int) -> None:
        """A running request of a reserved project was preempted, giving up `num_blocks`."""
        project = project_of(request.cache_salt)
        if project in self._held_blocks:
            self._held_blocks[project] = max(self._held_blocks[project] - num_blocks, 0)
            self._held_seats[project] = max(self._held_seats[project] - 1, 0)
