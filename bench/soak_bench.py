"""`aigw bench soak`: many mixed requests through a real gateway to a real replica, then three
checks: memory flat, no KV block leaked, the usage ledger equal to what the clients received.

One run, all on 127.0.0.1: an `aigw replica` on the default model (SmolLM2-135M Q4_1;
`--replica-args`, default "--decode-weights q4") requiring a fresh replica secret, and an
`aigw serve` with auth and the SQLite meter in front of it (a key per project, `--projects`).
`--requests` of the mix in bench/soak_workload.py go through `--concurrency` clients, bounded by
`--max-duration-s` too. Reported:
  - RSS (VmRSS) of the gateway and the replica, sampled every 2 s: after warm-up (the first
    `--warmup-fraction` of the requests) against the end, the ratio and the slope after warm-up
    in MiB per 1,000 requests (bench/soak_rss.py); flat when end <= (1 + `--max-rss-growth`) x
    warm-up, judged on runs of `--rss-min-requests` or more; `--plot PATH` draws both curves;
  - KV: the replica's aigw_replica_kv_blocks_used (and running/waiting requests) back at 0 once
    the clients are done;
  - ledger: every answered request's record (its id starts with the client's x-request-id) has
    exactly the client's prompt/cached/completion tokens and status; an aborted stream has exactly
    one record (status 499, or 200 when its whole answer was out first); a refused request has
    none with tokens; and `aigw usage` per project
    sums to the records.
Exit status 1 when a check fails (memory that is not flat included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from bench.soak_ledger import aigw_usage_totals, compare, read_ledger, record_totals
from bench.soak_rss import PROCESSES, Sample, plot_rss, render_trends, rss_trend
from bench.soak_workload import Outcome, mix, send


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=100_000, help="requests in all")
    parser.add_argument("--max-duration-s", type=float, default=4 * 3600.0,
                        help="stop sending after this long, whatever is left of --requests")
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once")
    parser.add_argument("--projects", type=int, default=3, help="projects, one key each")
    parser.add_argument("--replica-args", default="--decode-weights q4",
                        help="extra `aigw replica` options, one string")
    parser.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="replica KV bytes")
    parser.add_argument("--threads", type=int, default=None, help="replica CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the report (markdown) here")
    parser.add_argument("--warmup-fraction", type=float, default=0.2,
                        help="the share of the requests that is warm-up, the RSS baseline after it")
    parser.add_argument("--max-rss-growth", type=float, default=0.05,
                        help="flat: RSS at the end <= (1 + this) x RSS after warm-up")
    parser.add_argument("--rss-min-requests", type=int, default=2000,
                        help="runs of fewer requests report RSS without judging it")
    parser.add_argument("--plot", default=None, help="write the RSS curves (PNG) here")


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(soak(args))
    if args.plot:
        plot_rss(report["samples"], report["trends"], args.plot,
                 f"aigw bench soak: {report['requests']} requests")
    text = render(report)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0 if report["ok"] else 1


def _free_port() -> int:
    from infra.ports import free_port

    return free_port()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _get(url: str, headers: dict[str, str] | None = None, timeout_s: float = 5.0) -> bytes:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return bytes(response.read())


def _wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            _get(url, timeout_s=1.0)
            return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(f"{url} not up after {timeout_s:g}s")


async def _make_keys(data_dir: Path, num_projects: int) -> dict[str, str]:
    from auth import Scope, open_auth
    from auth.settings import AuthSettings

    services = await open_auth(AuthSettings(data_dir=data_dir))
    try:
        keys = {}
        for i in range(num_projects):
            project = f"soak-{i}"
            await services.admin.create_project(project)
            _, keys[project] = await services.admin.create_key(project, [Scope.INVOKE.value])
        return keys
    finally:
        await services.close()


def replica_gauges(replica_url: str, secret: str) -> dict[str, float]:
    text = _get(replica_url + "/metrics", {"Authorization": f"Bearer {secret}"}).decode()
    gauges: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("kv_blocks_used", "kv_blocks_total", "num_requests_running",
                     "num_requests_waiting"):
            if line.startswith(f"aigw_replica_{name}{{"):
                gauges[name] = float(line.rsplit(" ", 1)[1])
    return gauges


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    work = Path(tempfile.mkdtemp(prefix="aigw-soak-"))
    secret = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIGW_")}
    env["AIGW_REPLICA_SECRET"] = secret
    replica_port, gateway_port = _free_port(), _free_port()
    replica_url = f"http://127.0.0.1:{replica_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    replica_cmd = [sys.executable, "-m", "cli.main", "replica", "--host", "127.0.0.1",
                   "--port", str(replica_port), "--kv-cache-memory", str(args.kv_cache_memory),
                   *(["--threads", str(args.threads)] if args.threads else []),
                   *shlex.split(args.replica_args)]
    processes: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    try:
        with open(work / "replica.log", "wb") as log:
            replica = subprocess.Popen(replica_cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        processes.append(replica)
        keys = await _make_keys(work / "data", args.projects)  # while the replica loads
        _wait_http(replica_url + "/health", replica, 600)
        auth = {"Authorization": f"Bearer {secret}"}
        entry = json.loads(_get(replica_url + "/v1/models", auth))["data"][0]
        model, context_len = entry["id"], int(entry["max_model_len"])
        config = work / "gateway.toml"
        config.write_text(f'data_dir = "{work / "data"}"\nhealth_interval_s = 1.0\n'
                          f'[[models]]\nname = "{model}"\nbackend = "replica"\n'
                          f'endpoints = ["{replica_url}"]\n')
        with open(work / "gateway.log", "wb") as log:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "serve", "--config", str(config), "--host",
                 "127.0.0.1", "--port", str(gateway_port)],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        processes.append(gateway)
        _wait_http(gateway_url + "/health", gateway, 120)
        startup_s = time.monotonic() - started
        projects = sorted(keys)
        kinds = mix(args.requests, args.seed)
        rss: dict[str, dict[str, int]] = {}
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for i in range(4):  # warm-up: tokenizers, kernels, the first grammar
                await send(session, gateway_url, -1 - i,
                           ("chat", "stream", "tools", "anthropic")[i],
                           keys[projects[0]], projects[0], model, context_len * 4)
            rss["start"] = {"gateway": rss_bytes(gateway.pid), "replica": rss_bytes(replica.pid)}
            outcomes, elapsed_s = await _drive(session, gateway_url, kinds, keys, projects, model,
                                               context_len * 4, args, gateway.pid, replica.pid,
                                               rss)
        rss["end"] = {"gateway": rss_bytes(gateway.pid), "replica": rss_bytes(replica.pid)}
        kv = _wait_kv_idle(replica_url, secret)
        usage_totals = aigw_usage_totals(work / "data", projects, env)
        gateway.terminate()  # drains: every settlement is written before it exits
        gateway.wait(60)
        records = read_ledger(work / "data")
        ledger = compare(outcomes, records)
        ledger["aigw_usage_equals_records"] = usage_totals == record_totals(records)
        samples: list[Sample] = rss.pop("samples")  # type: ignore[assignment]
        samples.append((elapsed_s, len(outcomes), rss["end"]["gateway"], rss["end"]["replica"]))
        trends = [rss_trend(samples, process, args.warmup_fraction) for process in PROCESSES]
        flat = all(t.verdict(args.max_rss_growth, args.rss_min_requests) != "FAIL"
                   for t in trends)
        ok = (ledger["mismatches"] == 0 and ledger["aigw_usage_equals_records"]
              and kv["kv_blocks_used"] == 0 and kv["num_requests_running"] == 0
              and kv["num_requests_waiting"] == 0 and flat)
        return {"ok": ok, "requests": len(outcomes), "planned": args.requests,
                "elapsed_s": elapsed_s, "startup_s": startup_s, "concurrency": args.concurrency,
                "projects": len(projects), "replica_args": args.replica_args, "rss": rss,
                "kv": kv, "ledger": ledger, "statuses": _statuses(outcomes),
                "samples": samples, "trends": trends, "max_rss_growth": args.max_rss_growth,
                "rss_min_requests": args.rss_min_requests,
                "work_dir": str(work)}
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()


async def _drive(session: Any, url: str, kinds: list[str], keys: dict[str, str],
                 projects: list[str], model: str, context_chars: int, args: argparse.Namespace,
                 gateway_pid: int, replica_pid: int, rss: dict[str, dict[str, int]]
                 ) -> tuple[list[Outcome], float]:
    """`kinds[i]` as request i, `args.concurrency` at a time, until done or out of time."""
    outcomes: list[Outcome] = []
    started = time.monotonic()
    deadline = started + args.max_duration_s
    next_index = 0

    samples: list[Sample] = []  # (s since start, requests done, gateway RSS, replica RSS)

    async def client() -> None:
        nonlocal next_index
        while next_index < len(kinds) and time.monotonic() < deadline:
            i = next_index
            next_index += 1
            project = projects[i % len(projects)]
            outcomes.append(await send(session, url, i, kinds[i], keys[project], project, model,
                                       context_chars))

    async def sample() -> None:
        while True:
            samples.append((time.monotonic() - started, len(outcomes), rss_bytes(gateway_pid),
                            rss_bytes(replica_pid)))
            await asyncio.sleep(2.0)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    sampler.cancel()
    elapsed_s = time.monotonic() - started
    rss["tenths"] = [min(samples, key=lambda s, t=t: abs(s[0] - elapsed_s * t / 10))
                     for t in range(11)]  # type: ignore[assignment]
    rss["samples"] = samples  # type: ignore[assignment]
    return sorted(outcomes, key=lambda o: o.index), elapsed_s


def _wait_kv_idle(replica_url: str, secret: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The replica's gauges once nothing runs (aborts reach the engine a step later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = replica_gauges(replica_url, secret)
        idle = all(gauges.get(name) == 0 for name in ("kv_blocks_used", "num_requests_running",
                                                      "num_requests_waiting"))
        if idle or time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


def _statuses(outcomes: list[Outcome]) -> dict[str, dict[int, int]]:
    table: dict[str, Counter[int]] = {}
    for outcome in outcomes:
        table.setdefault(outcome.kind, Counter())[outcome.status] += 1
    return {kind: dict(sorted(c.items())) for kind, c in sorted(table.items())}


def render(report: dict[str, Any]) -> str:
    mib = 1024 * 1024
    rss = report["rss"]
    lines = [f"# aigw bench soak: {'PASS' if report['ok'] else 'FAIL'}", "",
             f"requests {report['requests']} of {report['planned']} planned, concurrency "
             f"{report['concurrency']}, {report['projects']} projects, replica "
             f"`{report['replica_args']}`",
             f"start-up (replica load, gateway) {report['startup_s']:.1f} s; requests "
             f"{report['elapsed_s']:.1f} s, {report['requests'] / report['elapsed_s']:.2f} "
             "requests/s", "",
             f"RSS after the 4 warm-up requests: gateway {rss['start']['gateway'] / mib:.1f} MiB, "
             f"replica {rss['start']['replica'] / mib:.1f} MiB", "",
             *render_trends(report["trends"], report["max_rss_growth"],
                            report["rss_min_requests"])]
    for column, process in ((2, "gateway"), (3, "replica")):
        trend = " ".join(f"{sample[column] / mib:.0f}" for sample in rss["tenths"])
        lines.append(f"\n{process} RSS (MiB) at each tenth of the run: {trend}")
    kv, ledger = report["kv"], report["ledger"]
    lines += ["", f"replica after the run: kv_blocks_used {kv.get('kv_blocks_used')} of "
                  f"{kv.get('kv_blocks_total')}, running {kv.get('num_requests_running')}, "
                  f"waiting {kv.get('num_requests_waiting')}",
              f"ledger: {ledger['records']} records; answered {ledger.get('answered', 0)}, "
              f"aborted {ledger.get('aborted', 0)}, refused {ledger.get('refused', 0)}; "
              f"mismatches {ledger['mismatches']}; aigw usage = records: "
              f"{ledger['aigw_usage_equals_records']}", "", "statuses by kind:"]
    lines += [f"- {kind}: {statuses}" for kind, statuses in report["statuses"].items()]
    lines += [f"- problem: {p}" for p in ledger["problems"]]
    lines.append(f"\nlogs: {report['work_dir']}")
    return "\n".join(lines) + "\n"
