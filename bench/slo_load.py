"""The open-loop load of `aigw bench slo`: Poisson arrivals of token-id requests over a replica's
HTTP API (POST /v1/completions, streamed, ignore_eos), each timed at the client.

    plan = mixed_plan(source, rate_per_s, duration_s, rng, ...)    # or agent_plan(sessions, ...)
    records = asyncio.run(run_plan(url, model, plan, drain_timeout_s))

A plan is a list of `Arrival`s: at `at_s` (from the start of the window) a client starts
`turns` requests one after another (one turn for a one-shot request; an agent session's turns,
each after the previous answer). An agent session appends each turn's planned answer tokens
to its context whatever the replica generated (the lengths are what scheduling sees), and a
refused turn (429) is skipped, not retried: offered load is the same for every policy.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from bench.plotting import percentile
from bench.workloads import AgentSession, PlannedRequest, TokenSource


@dataclass(frozen=True)
class Arrival:
    at_s: float
    service_tier: str
    turns: Sequence[PlannedRequest] | AgentSession  # one-shot requests, or a session's plan


@dataclass
class SloRecord:
    """One request as the client saw it (perf_counter seconds)."""

    service_tier: str
    num_prompt_tokens: int
    sent_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    status: int = 0  # HTTP status; 0: the connection failed
    retry_after: str | None = None

    @property
    def is_refused(self) -> bool:
        return self.status == 429

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.finish_s is None or self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)

    def meets(self, ttft_target_s: float, tpot_target_s: float) -> bool:
        """Finished, first token within its TTFT target, and tokens within the TPOT target."""
        ttft, tpot = self.ttft_s, self.tpot_s
        return (self.status == 200 and self.finish_s is not None and ttft is not None
                and ttft <= ttft_target_s and (tpot is None or tpot <= tpot_target_s))


def poisson_times(rate_per_s: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of `rate_per_s` within [0, duration_s)."""
    times, t = [], rng.expovariate(rate_per_s)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def tier_of(rng: random.Random, priority_fraction: float) -> str:
    return "priority" if rng.random() < priority_fraction else "default"


def mixed_plan(source: TokenSource, rate_per_s: float, duration_s: float, rng: random.Random, *,
               priority_fraction: float, long_fraction: float, short: tuple[int, int],
               long: tuple[int, int]) -> list[Arrival]:
    """One-shot requests: a `long_fraction` of (prompt, output) = `long`, the rest `short`."""
    plan = []
    for at_s in poisson_times(rate_per_s, duration_s, rng):
        num_prompt, num_output = long if rng.random() < long_fraction else short
        plan.append(Arrival(at_s, tier_of(rng, priority_fraction),
                            [PlannedRequest(source.take(num_prompt), num_output)]))
    return plan


def agent_plan(sessions: Sequence[AgentSession], rate_per_s: float, duration_s: float,
               rng: random.Random, *, priority_fraction: float) -> list[Arrival]:
    """Sessions start as a Poisson process of rate_per_s / turns (so `rate_per_s` requests a
    second are offered), each a fresh copy of the next planned session."""
    num_turns = max(1, len(sessions[0].turn_message_ids))
    times = poisson_times(rate_per_s / num_turns, duration_s, rng)
    return [Arrival(at_s, tier_of(rng, priority_fraction), sessions[i % len(sessions)].fresh())
            for i, at_s in enumerate(times)]


async def run_plan(url: str, model: str, plan: Sequence[Arrival], drain_timeout_s: float,
                   filler: TokenSource) -> list[SloRecord]:
    """Every arrival of `plan` at its time; returns once all have finished (or after
    `drain_timeout_s` past the window: the rest are recorded unfinished)."""
    import aiohttp

    records: list[SloRecord] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=drain_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.perf_counter()

        async def client(arrival: Arrival) -> None:
            await asyncio.sleep(max(0.0, started + arrival.at_s - time.perf_counter()))
            turns = arrival.turns
            if isinstance(turns, AgentSession):
                turns = turns.fresh()  # (a plan is replayed once per policy)
                previous: list[int] | None = None
                while (planned := turns.next_request(previous)) is not None:
                    await _send(session, url, model, planned, arrival.service_tier, records)
                    previous = filler.take(planned.max_tokens)  # the planned answer, as context
            else:
                for planned in turns:
                    await _send(session, url, model, planned, arrival.service_tier, records)

        tasks = [asyncio.ensure_future(client(arrival)) for arrival in plan]
        window_s = max((arrival.at_s for arrival in plan), default=0.0)
        done, pending = await asyncio.wait(tasks, timeout=window_s + drain_timeout_s) if tasks \
            else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records


async def _send(session: object, url: str, model: str, planned: PlannedRequest,
                service_tier: str, records: list[SloRecord]) -> SloRecord:
    """One request, recorded in `records` as it is sent (one still unanswered when the cell's
    drain timeout cancels it stays there, unfinished: it met no target)."""
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    record = SloRecord(service_tier, len(planned.prompt_token_ids), time.perf_counter())
    records.append(record)
    body = {"model": model, "prompt": planned.prompt_token_ids, "max_tokens": planned.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "service_tier": service_tier,
            "stream_options": {"include_usage": True}}
    try:
        async with session.post(url + "/v1/completions", data=orjson.dumps(body),
                                headers={"content-type": "application/json"}) as response:
            record.status = response.status
            record.retry_after = response.headers.get("retry-after")
            if response.status != 200:
                await response.read()
                return record
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(line[6:])
                if chunk.get("choices") and record.first_token_s is None:
                    record.first_token_s = time.perf_counter()
                usage = chunk.get("usage")
                if usage:
                    record.num_output_tokens = int(usage.get("completion_tokens") or 0)
            record.finish_s = time.perf_counter()
    except (TimeoutError, aiohttp.ClientError):
        record.status = record.status or 0
        record.finish_s = None
    return record


@dataclass
class CellSummary:
    """One (workload, policy, rate) cell."""

    rate_per_s: float
    num_sent: int
    num_refused: int
    num_finished: int
    num_good: int
    goodput_per_s: float
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    priority_ttft_p90_s: float | None
    priority_num_sent: int
    priority_num_refused: int
    num_refused_without_retry_after: int = 0
    num_unfinished: int = 0  # no answer (or a broken one) by the end of the drain timeout

    @property
    def attainment(self) -> float:
        """Of the requests sent, the fraction that met both targets."""
        return self.num_good / self.num_sent if self.num_sent else 0.0


def summarize(records: Sequence[SloRecord], rate_per_s: float, duration_s: float,
              ttft_target_s: float, tpot_target_s: float) -> CellSummary:
    finished = [r for r in records if r.status == 200 and r.finish_s is not None]
    priority = [r for r in records if r.service_tier == "priority"]
    ttfts = [t for r in finished if (t := r.ttft_s) is not None]
    tpots = [t for r in finished if (t := r.tpot_s) is not None]
    # priority's TTFT over every priority request sent: a refused or failed one never got a
    # first token (infinite), so refusing priority cannot make its p90 look better
    priority_ttfts = [t if r.status == 200 and (t := r.ttft_s) is not None else math.inf
                      for r in priority]
    num_good = sum(r.meets(ttft_target_s, tpot_target_s) for r in records)
    return CellSummary(rate_per_s, len(records), sum(r.is_refused for r in records),
                       len(finished), num_good, num_good / duration_s,
                       percentile(ttfts, 90), percentile(tpots, 90),
                       nearest_rank(priority_ttfts, 90), len(priority),
                       sum(r.is_refused for r in priority),
                       sum(r.is_refused and not r.retry_after for r in records),
                       len(records) - len(finished) - sum(r.is_refused for r in records))


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile by nearest rank (exact with infinite values); None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100.0 * len(ordered)) - 1)]
