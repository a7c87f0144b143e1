"""The shared meter: usage and limit counters in Redis, so every gateway instance counts together.

Key layout (all keys of one project share the hash tag `{p:<project>}`, so each Lua script below
touches a single Redis Cluster slot):

    aigw:{p:<P>}:lim:<scope>:req:<minute>    int  requests admitted in that minute window
    aigw:{p:<P>}:lim:<scope>:tok:<minute>    int  tokens reserved/settled in that minute window
    aigw:{p:<P>}:lim:<scope>:spent:<window>  int  nano-USD reserved/settled in that budget window
                                                  (<window>: budgets.Window.key, e.g. the day)
    aigw:{p:<P>}:lim:<scope>:inflight        zset request ids admitted and not settled, scored
                                                  by their lease's end (max_concurrent_requests)
    aigw:{p:<P>}:lim:<scope>:alert:<window>:<threshold>  str  SET NX: who sends that alert
    aigw:{p:<P>}:usage:req:<request_id>      str  UsageRecord JSON; SET NX = idempotency (TTL)
    aigw:{p:<P>}:usage:day:<day>             hash "<model>|<metric>" -> int (requests, tokens,
                                                  cost_nanos) summed at settle
    aigw:{p:<P>}:usage:ids:<day>             list request ids of that day, in settle order (TTL)
    aigw:{p:<P>}:usage:days                  set  days that have usage
    <scope> = "proj" or "key:<key_id>"; <minute> = unix_s // 60; <day> = YYYY-MM-DD (UTC)

ADMIT checks every scope and reserves in all or none, in one script (atomic: no two gateways can
both take the last tokens). SETTLE writes the record with SET NX and, only when that created it,
moves the counters by (actual - reserved) and adds to the day's sums, also in one script.
On Redis Cluster (infra/redis_client.py) the coalesced calls go out concurrently rather than in
one pipeline (redis-py blocks EVALSHA in cluster pipelines); SCRIPT LOAD reaches every primary.

A queued settle that fails because Redis cannot be reached is held in memory and written again with
backoff (0.5 s doubling to 5 s) until Redis answers; SET NX makes a repeat of one that did land a
no-op, so nothing is counted twice. What is still held at shutdown is tried once more, then logged
as `settle failed` per request. Held, queued and in-flight calls together are bounded in bytes
(`backlog_bytes`, settings.backlog_max_bytes): past the bound new requests are refused
(BaseMeter.admit, MeterBacklogged: 503), none is dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from functools import partial
from typing import Any

import orjson
from redis.exceptions import ClusterDownError, NoScriptError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.metering.budgets import Window
from gateway.metering.coalescer import Coalescer
from gateway.metering.contract import UsageRecord
from gateway.metering.limits import (
    CONCURRENCY_LEASE_S,
    WINDOW_S,
    Clock,
    Counts,
    MeterAdmission,
    ScopeLimits,
    Spend,
    rate_headers,
    rate_limited,
)
from gateway.metering.meter import SETTLE_LINGER_S, BaseMeter, usage_day
from gateway.metering.prices import NANOS_PER_USD
from gateway.metering.settings import MeteringSettings
from gateway.metering.usage_report import UsageRow, in_range
from infra.redis_client import is_cluster_client

log = logging.getLogger("aigw.metering")
_METRICS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_nanos")

# Numbers travel packed in one space-separated ARGV (fewer arguments to encode per call).
# KEYS: per scope requests, tokens, in-flight (sorted set), then one spend key per budget.
# ARGV[1]: reserve tokens, reserve nanos, window ttl, now (unix s), concurrency lease s, then per
# scope rpm, tpm, max concurrent ('-' = no limit), number of budgets, and per budget its nanos,
# its key's ttl and the seed: what the ledger holds for the window, set when the key does not
# exist yet ('-' = not read: this gateway has seeded it before). ARGV[2]: the request id (its
# in-flight member). Mirrors limits.denied_limit.
_ADMIT_LUA = """
local a = {}
for v in string.gmatch(ARGV[1], '%S+') do a[#a + 1] = v end
local rt, rc, now = tonumber(a[1]), tonumber(a[2]), tonumber(a[4])
local counts, layout, denied, what, which = {}, {}, 0, '', 0
local k, p, s = 1, 6, 0
while p <= #a do
  s = s + 1
  local rpm, tpm, conc, nb = a[p], a[p+1], a[p+2], tonumber(a[p+3])
  p = p + 4
  local req = tonumber(redis.call('GET', KEYS[k]) or '0')
  local tok = tonumber(redis.call('GET', KEYS[k+1]) or '0')
  local inflight = 0
  if conc ~= '-' then
    redis.call('ZREMRANGEBYSCORE', KEYS[k+2], '-inf', now)
    inflight = redis.call('ZCARD', KEYS[k+2])
  end
  counts[#counts + 1] = req; counts[#counts + 1] = tok; counts[#counts + 1] = inflight
  if denied == 0 then
    if rpm ~= '-' and req >= tonumber(rpm) then denied, what = s, 'requests'
    elseif tpm ~= '-' and (tok >= tonumber(tpm) or (tok > 0 and tok + rt > tonumber(tpm))) then
      denied, what = s, 'tokens'
    elseif conc ~= '-' and inflight >= tonumber(conc) then denied, what = s, 'concurrency'
    end
  end
  layout[s] = {k, conc, nb, p}
  for b = 1, nb do
    if a[p+2] ~= '-' and redis.call('EXISTS', KEYS[k+2+b]) == 0 then
      redis.call('SET', KEYS[k+2+b], a[p+2], 'EX', a[p+1])
    end
    local spent = tonumber(redis.call('GET', KEYS[k+2+b]) or '0')
    local bud = tonumber(a[p])
    counts[#counts + 1] = spent
    if denied == 0 and (spent >= bud or (spent > 0 and spent + rc > bud)) then
      denied, what, which = s, 'budget', b - 1
    end
    p = p + 3
  end
  k = k + 3 + nb
end
if denied == 0 then
  for i = 1, s do
    local kk, conc, nb, bp = layout[i][1], layout[i][2], layout[i][3], layout[i][4]
    redis.call('INCR', KEYS[kk]); redis.call('EXPIRE', KEYS[kk], a[3])
    redis.call('INCRBY', KEYS[kk+1], rt); redis.call('EXPIRE', KEYS[kk+1], a[3])
    if conc ~= '-' then
      redis.call('ZADD', KEYS[kk+2], now + tonumber(a[5]), ARGV[2])
      redis.call('EXPIRE', KEYS[kk+2], a[5])
    end
    for b = 1, nb do
      redis.call('INCRBY', KEYS[kk+2+b], rc)
      redis.call('EXPIRE', KEYS[kk+2+b], a[bp + 3 * (b - 1) + 1])
    end
  end
end
return {denied, what, which, unpack(counts)}
"""

# KEYS: record, day hash, day ids, days set, then counters, each of a kind in ARGV[5]: 't' tokens
# (+delta tokens), 's' a budget's spend (+delta nanos; its new value is returned, '' when it had
# expired), 'c' in-flight set (the request id removed, also on a repeated settle).
# ARGV: record JSON; "record_ttl delta_tokens delta_nanos prompt cached completion cost_nanos day";
# model; request id; kinds. Returns 0 for a repeat, else {1, each 's' counter's new value}.
_SETTLE_LUA = """
local a = {}
for v in string.gmatch(ARGV[2], '%S+') do a[#a + 1] = v end
local kinds = ARGV[5]
for i = 5, #KEYS do
  if string.sub(kinds, i - 4, i - 4) == 'c' then redis.call('ZREM', KEYS[i], ARGV[4]) end
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', a[1]) then return 0 end
local result = {1}
for i = 5, #KEYS do
  local kind = string.sub(kinds, i - 4, i - 4)
  if kind == 't' then
    if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('INCRBY', KEYS[i], a[2]) end
  elseif kind == 's' then
    if redis.call('EXISTS', KEYS[i]) == 1 then
      result[#result + 1] = redis.call('INCRBY', KEYS[i], a[3])
    else
      result[#result + 1] = ''
    end
  end
end
local m = ARGV[3]
redis.call('HINCRBY', KEYS[2], m .. '|requests', 1)
redis.call('HINCRBY', KEYS[2], m .. '|prompt_tokens', a[4])
redis.call('HINCRBY', KEYS[2], m .. '|cached_tokens', a[5])
redis.call('HINCRBY', KEYS[2], m .. '|completion_tokens', a[6])
redis.call('HINCRBY', KEYS[2], m .. '|cost_nanos', a[7])
redis.call('RPUSH', KEYS[3], ARGV[4]); redis.call('EXPIRE', KEYS[3], a[1])
redis.call('SADD', KEYS[4], a[8])
return result
"""


def _project_prefix(project: str) -> str:
    return f"aigw:{{p:{project}}}"


_SCRIPTS = {"admit": _ADMIT_LUA, "settle": _SETTLE_LUA}
_SCRIPT_SHAS = {name: hashlib.sha1(lua.encode()).hexdigest() for name, lua in _SCRIPTS.items()}
ScriptCall = tuple[str, list[str], list[Any]]  # (script name, keys, args)


_RETRY_FIRST_S, _RETRY_MAX_S = 0.5, 5.0
_NUM_SEEDED = 100_000
_OUTAGE = (RedisConnectionError, RedisTimeoutError, ClusterDownError, OSError)


class RedisMeter(BaseMeter):
    """Script calls from concurrent requests share one pipeline round trip (Coalescer)."""

    def __init__(self, settings: MeteringSettings, client: Any, owns_client: bool = False) -> None:
        super().__init__(settings)
        self.client = client
        self._owns_client = owns_client
        self._scripts_loaded = False
        self._cluster = is_cluster_client(client)
        self._calls: Coalescer[ScriptCall, Any] = Coalescer(
            self._run_scripts, linger_s=SETTLE_LINGER_S, size_of=call_bytes)
        self._held: list[tuple[ScriptCall, str]] = []  # settles that met an outage, to retry
        self._held_bytes = 0  # call_bytes of self._held
        self._retrier: asyncio.Task[None] | None = None
        self._is_closing = False
        self._seeded: set[str] = set()  # spend keys this process has seeded from the ledger

    def backlog_bytes(self) -> int:
        """Script calls queued or in flight (a hung Redis) plus settles held through an outage:
        past settings.backlog_max_bytes, admit refuses (MeterBacklogged), nothing is dropped."""
        return self._calls.backlog_bytes + self._held_bytes

    async def _run_scripts(self, calls: list[ScriptCall]) -> list[Any]:
        if not self._scripts_loaded:
            await self._load_scripts()
        results = await self._pipeline(calls)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:  # the server lost its script cache (restart, SCRIPT FLUSH): load, retry once
            await self._load_scripts()
            for i, result in zip(missing, await self._pipeline([calls[i] for i in missing]),
                                 strict=True):
                results[i] = result
        return results

    async def _pipeline(self, calls: list[ScriptCall]) -> list[Any]:
        if self._cluster:  # redis-py refuses EVALSHA in a cluster pipeline: one call per script,
            # concurrently (each goes to the node of its project's slot)
            return list(await asyncio.gather(
                *(self.client.evalsha(_SCRIPT_SHAS[name], len(keys), *keys, *args)
                  for name, keys, args in calls), return_exceptions=True))
        pipe = self.client.pipeline(transaction=False)
        for name, keys, args in calls:
            pipe.evalsha(_SCRIPT_SHAS[name], len(keys), *keys, *args)
        return list(await pipe.execute(raise_on_error=False))

    async def _load_scripts(self) -> None:
        for lua in _SCRIPTS.values():
            await self.client.script_load(lua)
        self._scripts_loaded = True

    async def _reserve(self, admission: MeterAdmission, scopes: list[ScopeLimits],
                       clock: Clock) -> None:
        prefix = _project_prefix(admission.principal.project)
        keys: list[str] = []
        now = clock.now
        numbers: list[Any] = [admission.reserved_tokens, admission.reserved_nanos, 2 * WINDOW_S,
                              repr(now), CONCURRENCY_LEASE_S]
        windows = tuple(s.windows_at(now) for s in scopes)
        for scope, scope_windows in zip(scopes, windows, strict=True):
            base = f"{prefix}:lim:{scope.name}"
            keys += [f"{base}:req:{clock.minute_window}", f"{base}:tok:{clock.minute_window}",
                     f"{base}:inflight"]
            keys += [f"{base}:spent:{w.key}" for w in scope_windows]
            limits = scope.limits
            numbers += [_arg(limits.requests_per_minute), _arg(limits.tokens_per_minute),
                        _arg(limits.max_concurrent_requests), len(scope.budgets)]
            for budget, window in zip(scope.budgets, scope_windows, strict=True):
                seed = "-"
                if f"{base}:spent:{window.key}" not in self._seeded:
                    seed = str(await self._ledger_spend(admission, scope, window))
                numbers += [budget.nanos, math.ceil(window.reset_s(now)) + 86_400, seed]
        denied, what, which, *raw = await self._calls.submit(
            ("admit", keys, [" ".join(map(str, numbers)), admission.request_id]))
        if len(self._seeded) > _NUM_SEEDED:
            self._seeded.clear()
        self._seeded.update(k for k in keys if ":spent:" in k)
        before, at = [], 0
        for scope in scopes:
            num_budgets = len(scope.budgets)
            values = [int(v) for v in raw[at:at + 3 + num_budgets]]
            before.append(Counts(values[0], values[1], tuple(values[3:]), values[2]))
            at += 3 + num_budgets
        if int(denied):
            pairs = list(zip(scopes, before, strict=True))
            raise rate_limited(scopes[int(denied) - 1], (str(what), int(which)), pairs, clock)
        after = [(s, Counts(c.num_requests + 1, c.num_tokens + admission.reserved_tokens,
                            tuple(v + admission.reserved_nanos for v in c.spent_nanos),
                            c.num_concurrent + (s.limits.max_concurrent_requests is not None)))
                 for s, c in zip(scopes, before, strict=True)]
        admission.minute_window, admission.windows = clock.minute_window, windows
        admission.concurrent_scopes = tuple(s.name for s in scopes
                                            if s.limits.max_concurrent_requests is not None)
        admission.headers = rate_headers(after, clock)

    async def _ledger_spend(self, admission: MeterAdmission, scope: ScopeLimits,
                            window: Window) -> int:
        """What the ledger holds for the scope in the window, nano-USD: a budget set (or a
        window begun) after requests were settled counts them. A project's whole-day windows
        from the per-day sums; a key's, or a window that cuts a day, from the records."""
        project = admission.principal.project
        first, last = usage_day(window.start_s), usage_day(window.end_s - 0.001)
        if scope.is_project and window.start_s % 86_400 == 0 and window.end_s % 86_400 == 0:
            rows = await self._daily_rows(project, first, last)
            return sum(row.cost_nanos for row in rows)
        return sum(round(r.cost_usd * NANOS_PER_USD)
                   for r in await self.usage_records(project, first, last)
                   if window.start_s <= r.created_at < window.end_s
                   and (scope.is_project or r.key_id == scope.key_id))

    async def _claim_alert(self, spend: Spend, threshold: float) -> bool:
        scope, window = spend.scope, spend.window
        key = (f"{_project_prefix(scope.project)}:lim:{scope.name}:alert:{window.key}:"
               f"{threshold:g}")
        ttl_s = math.ceil(max(window.end_s - time.time(), 0)) + 86_400
        return bool(await self.client.set(key, "1", nx=True, ex=ttl_s))

    async def _record(self, admission: MeterAdmission, record: UsageRecord, cost_nanos: int,
                      delta_tokens: int, delta_nanos: int) -> None:
        call = self._settle_call(admission, record, cost_nanos, delta_tokens, delta_nanos)
        try:
            result = await self._calls.submit(call)
        except _OUTAGE as exc:  # Redis went away after the admission: held like a queued one
            self._on_settle_result(call, record.request_id, exc)
            return
        self._observe_spends(_spends(admission, result))

    def _record_nowait(self, admission: MeterAdmission, record: UsageRecord, cost_nanos: int,
                       delta_tokens: int, delta_nanos: int) -> None:
        self._submit_settle(self._settle_call(admission, record, cost_nanos, delta_tokens,
                                              delta_nanos), record.request_id, admission)

    def _submit_settle(self, call: ScriptCall, request_id: str,
                       admission: MeterAdmission | None = None) -> None:
        self._calls.submit_nowait(call, partial(self._on_settle_result, call, request_id,
                                                admission=admission))

    def _on_settle_result(self, call: ScriptCall, request_id: str, result: Any,
                          admission: MeterAdmission | None = None) -> None:
        if not isinstance(result, BaseException):
            if admission is not None:
                self._observe_spends(_spends(admission, result))
            return
        if not isinstance(result, _OUTAGE) or self._is_closing:
            log.error("settle failed for %s", request_id, exc_info=result)
        else:  # held whatever their number: admit refuses new requests past the byte bound
            self._held.append((call, request_id))
            self._held_bytes += call_bytes(call)
            if self._retrier is None or self._retrier.done():
                log.warning("Redis unreachable: holding usage records until it answers (%s)",
                            result)
                self._retrier = asyncio.get_running_loop().create_task(self._retry_held())

    async def _retry_held(self) -> None:
        """Write the held settles again, with backoff, until none is left."""
        delay_s = _RETRY_FIRST_S
        while self._held:
            await asyncio.sleep(delay_s)
            await self._resubmit_held()
            delay_s = min(delay_s * 2, _RETRY_MAX_S)
        log.warning("Redis answers again: held usage records written")

    async def _resubmit_held(self) -> None:
        held, self._held, self._held_bytes = self._held, [], 0
        for call, request_id in held:
            self._submit_settle(call, request_id)  # a failure holds it again
        await self._calls.flush()

    def _settle_call(self, admission: MeterAdmission, record: UsageRecord, cost_nanos: int,
                     delta_tokens: int, delta_nanos: int) -> ScriptCall:
        prefix = _project_prefix(record.project)
        day = usage_day(record.created_at)
        keys = [f"{prefix}:usage:req:{record.request_id}", f"{prefix}:usage:day:{day}",
                f"{prefix}:usage:ids:{day}", f"{prefix}:usage:days"]
        kinds = []
        if admission.principal.project == record.project:
            for name, windows in zip(admission.scopes, admission.windows, strict=True):
                base = f"{prefix}:lim:{name}"
                keys.append(f"{base}:tok:{admission.minute_window}")
                keys += [f"{base}:spent:{w.key}" for w in windows]
                kinds += ["t"] + ["s"] * len(windows)
                if name in admission.concurrent_scopes:
                    keys.append(f"{base}:inflight")
                    kinds.append("c")
        numbers = (self.settings.record_ttl_days * 86_400, delta_tokens, delta_nanos,
                   record.prompt_tokens, record.cached_tokens, record.completion_tokens,
                   cost_nanos, day)
        args = [orjson.dumps(record), " ".join(map(str, numbers)), record.model,
                record.request_id, "".join(kinds)]
        return ("settle", keys, args)

    async def _daily_rows(self, project: str, since: str | None,
                          until: str | None) -> list[UsageRow]:
        await self._calls.flush()  # settles queued by settle_nowait
        prefix = _project_prefix(project)
        days = sorted(d for d in await self.client.smembers(f"{prefix}:usage:days")
                      if in_range(d, since, until))
        pipe = self.client.pipeline(transaction=False)
        for day in days:
            pipe.hgetall(f"{prefix}:usage:day:{day}")
        rows = []
        for day, sums in zip(days, await pipe.execute(), strict=True):
            per_model: dict[str, dict[str, int]] = {}
            for field, value in sums.items():
                model, _, metric = field.rpartition("|")
                per_model.setdefault(model, {})[metric] = int(value)
            rows += [UsageRow(day, model, m.get("requests", 0), m.get("prompt_tokens", 0),
                              m.get("cached_tokens", 0), m.get("completion_tokens", 0),
                              m.get("cost_nanos", 0))
                     for model, m in sorted(per_model.items())]
        return rows

    async def usage_records(self, project: str, since: str | None = None,
                            until: str | None = None) -> list[UsageRecord]:
        await self._calls.flush()  # settles queued by settle_nowait
        prefix = _project_prefix(project)
        days = sorted(d for d in await self.client.smembers(f"{prefix}:usage:days")
                      if in_range(d, since, until))
        records = []
        for day in days:
            ids = await self.client.lrange(f"{prefix}:usage:ids:{day}", 0, -1)
            if ids:
                raws = await self.client.mget([f"{prefix}:usage:req:{i}" for i in ids])
                records += [UsageRecord(**json.loads(raw)) for raw in raws if raw is not None]
        return sorted(records, key=lambda r: (r.created_at, r.request_id))

    async def close(self) -> None:
        await self._calls.close()
        await self._close_alerts()
        if self._retrier is not None:
            self._retrier.cancel()
        self._is_closing = True
        await self._resubmit_held()  # a last try; what fails now is logged
        if self._owns_client:
            await self.client.aclose()


def call_bytes(call: ScriptCall) -> int:
    """What a script call weighs while it waits: its keys and arguments (the usage record's
    JSON, for a settle), plus a fixed 200 for the objects around them."""
    _, keys, args = call
    return 200 + sum(len(k) for k in keys) + sum(len(a) if isinstance(a, str | bytes) else 8
                                                 for a in args)


def _arg(limit: int | None) -> Any:
    return "-" if limit is None else limit


def _spends(admission: MeterAdmission, result: Any) -> list[Spend]:
    """The budgets' spend after a settle, from the settle script's answer (0 for a repeat)."""
    if not isinstance(result, list) or not admission.scope_limits:
        return []
    values = iter(result[1:])
    spends = []
    for scope, windows in zip(admission.scope_limits, admission.windows, strict=True):
        for budget, window in zip(scope.budgets, windows, strict=True):
            value = next(values, "")
            if value != "":
                spends.append(Spend(scope, budget, window, int(value)))
    return spends
