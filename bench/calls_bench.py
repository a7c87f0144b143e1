"""`aigw bench calls`: Python function calls per request, counted, not timed.

Two figures, each beside its baseline in the same run:

- **gateway**: calls a request costs the `aigw serve` process (auth, SQLite meter, routing,
  tracing as configured by default) in front of the mock upstream (bench/mock_upstream.py, as a
  `replica` backend), plain and streamed, for this checkout and, with `--baseline-tree PATH` (a
  `git archive` of an earlier commit), for that one: the refactor's CPU cost, free of the noise
  that timed CPU has on a shared 2-core machine.
- **replica**: calls a chat request costs an `aigw replica` process (the default model, one
  output token, an agent prompt: system prompt and 6 tools) when it renders the messages itself
  against when it is given the prompt's ids as the gateway sends them (`prompt_token_ids` +
  `prompt_render_id`, chat/render.py): what rendering once saves the replica.
- **fallbacks** (`--parts fallbacks`): the gateway whose model has a fallback chain that no
  request takes (`fallbacks = ["mock-model-b"]`) against the same gateway without it (both with
  the second model configured): what a configured chain costs the path that does not use it.
- **cpu** (`--parts cpu`): the same two gateways as **gateway**, timed instead of counted: both
  run side by side (not under the counter), and each round sends `--cpu-requests` sequential
  requests per mode to each in turn (the order alternating between rounds); the figure is the
  process's CPU seconds (utime + stime, /proc) a request, also net of what it spends idle for as
  long afterwards, the median over `--rounds` and each round's ratio to the baseline. Timed CPU
  moves with the machine's load (other processes' cache and frequency effects), so read it beside
  the counted calls.

`--rounds N` repeats the gateway cells too (ours and the baseline alternating, each a fresh
process): the figure is the median over the rounds, with its range. A cell's count moves by a
few calls between runs with timing alone (a request body that arrives in a second TCP read
resumes the whole handler chain once more; the SQLite meter batches more rows a transaction
when requests come faster).

Each process runs under bench/call_counter.py (a profile hook counting every Python call, all
threads); counts are read after a warm-up, over `--requests` sequential requests. Background work
(health checks, the KV event loop) is counted too, so a slower run counts more of it a request;
each gateway cell is therefore also given "net of idle": the gateway then idles as long as the
requests took, and the calls it makes meanwhile are subtracted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.gateway_bench import MODEL, _cpu_seconds, _free_port, _Processes, _wait_http

COUNTER = Path(__file__).with_name("call_counter.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=200, help="counted requests per cell")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--baseline-tree", default=None,
                        help="an earlier checkout (git archive) to count the gateway against")
    parser.add_argument("--parts", default="gateway,replica",
                        help="comma-separated: gateway, replica, fallbacks, cpu")
    parser.add_argument("--rounds", type=int, default=1,
                        help="gateway and cpu cells: rounds, ours and the baseline alternating "
                             "(the median is reported)")
    parser.add_argument("--cpu-requests", type=int, default=500,
                        help="cpu part: sequential requests per mode, gateway and round")
    parser.add_argument("--out-dir", default="bench/out/calls")
    parser.add_argument("--plot", default=None, help="write a PNG here")


class _Counted:
    """A process under bench/call_counter.py; `calls()` reads its count now (SIGUSR1)."""

    def __init__(self, procs: _Processes, name: str, module_args: list[str], tree: Path,
                 env: dict[str, str]) -> None:
        self.count_file = procs.out_dir / f"{name}.calls"
        self.count_file.unlink(missing_ok=True)
        command = [sys.executable, str(COUNTER), str(self.count_file), "-m", *module_args]
        env = {**env, "PYTHONPATH": str(tree)}
        self.process = procs.start(name, command, env, cwd=str(tree))

    def calls(self) -> int:
        before = self.count_file.stat().st_mtime_ns if self.count_file.exists() else None
        os.kill(self.process.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.count_file.exists() and self.count_file.stat().st_mtime_ns != before:
                text = self.count_file.read_text().strip()
                if text:
                    return int(text)
            time.sleep(0.02)
        raise TimeoutError(f"{self.count_file}: no count written")


def _per_request(counted: _Counted, send: Any, num_warmup: int, num_requests: int) -> float:
    return _per_request_net(counted, send, num_warmup, num_requests, idle=False)[0]


def _per_request_net(counted: _Counted, send: Any, num_warmup: int, num_requests: int,
                     idle: bool = True) -> tuple[float, float]:
    """(calls a request, the same less the process's background calls): with `idle`, the process
    is then left idle as long as the requests took, and what it calls meanwhile (health checks,
    KV event polls, store polls: work paced by the clock, not by requests) is subtracted. A
    slower run (a busy machine) counts more background calls a request; the net figure does not."""
    for _ in range(num_warmup):
        send()
    start = counted.calls()
    started = time.monotonic()
    for _ in range(num_requests):
        send()
    elapsed_s = time.monotonic() - started
    end = counted.calls()
    gross = (end - start) / num_requests
    if not idle:
        return gross, gross
    time.sleep(elapsed_s)
    background = counted.calls() - end
    return gross, (end - start - background) / num_requests


MODES = ("nonstream", "stream")


def _serve_args(procs: _Processes, name: str, tree: Path, upstream: str,
                chain: bool | None) -> tuple[list[str], Path, str]:
    """(`-m MODULE serve ...` arguments, data dir, url) of a gateway in front of the mock, from
    an empty data dir. `chain` None: the bench's one model; False: a second model too; True:
    the first falls back to the second."""
    data_dir = procs.out_dir / f"{name}-data"
    shutil.rmtree(data_dir, ignore_errors=True)  # (a usage table grown by an earlier run
    config = procs.out_dir / f"{name}.toml"      # would make its writes costlier)
    fallbacks = f'fallbacks = ["{MODEL}-b"]\n' if chain else ""
    second = "" if chain is None else (f'[[models]]\nname = "{MODEL}-b"\nbackend = "replica"\n'
                                       f'upstream_model = "{MODEL}"\nendpoints = ["{upstream}"]\n')
    config.write_text(f'data_dir = "{data_dir}"\n[[models]]\nname = "{MODEL}"\nbackend = '
                      '"replica"\n'
                      f'endpoints = ["{upstream}"]\n{fallbacks}[models.prices]\n'
                      'input_per_token = 1e-7\noutput_per_token = 2e-7\n' + second)
    module = "cli.main" if (tree / "cli" / "main.py").exists() else "gateway.cli"
    port = _free_port()
    return ([module, "serve", "--config", str(config), "--port", str(port), "--workers", "1"],
            data_dir, f"http://127.0.0.1:{port}")


def _auth_headers(data_dir: Path) -> dict[str, str]:
    key_file = data_dir / "default-key.txt"
    deadline = time.monotonic() + 30
    while not (key_file.exists() and key_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"authorization": "Bearer " + key_file.read_text().strip()}


def _sender(client: httpx.Client, mode: str) -> Any:
    body = {"model": MODEL, "max_tokens": 16, "stream": mode == "stream",
            "messages": [{"role": "user", "content": "Hello, how are you today?"}]}

    def send() -> None:
        response = client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        response.read()

    return send


def _gateway_env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIGW_")}
    return {**env, "PYTHONPATH": str(tree)}


def _gateway(procs: _Processes, name: str, tree: Path, upstream: str, args: argparse.Namespace,
             chain: bool | None = None) -> dict[str, float]:
    """Calls a request, plain and streamed (see `_serve_args` for `chain`)."""
    module_args, data_dir, url = _serve_args(procs, name, tree, upstream, chain)
    counted = _Counted(procs, name, module_args, tree, _gateway_env(tree))
    _wait_http(url + "/health", 90, counted.process)
    figures = {}
    with httpx.Client(base_url=url, headers=_auth_headers(data_dir), timeout=60) as client:
        for mode in MODES:
            figures[mode], figures[f"{mode}, net of idle"] = _per_request_net(
                counted, _sender(client, mode), args.warmup, args.requests)
    procs.stop(counted.process.pid)
    return figures


def _gateway_rounds(procs: _Processes, trees: dict[str, Path], upstream: str,
                    args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Each tree's counted cells over `args.rounds` rounds, the trees' order alternating."""
    per_round: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    names = list(trees)
    for index in range(args.rounds):
        for name in (names if index % 2 == 0 else names[::-1]):
            for case, value in _gateway(procs, name, trees[name], upstream, args).items():
                per_round[name].setdefault(case, []).append(value)
    return per_round


def _cpu_rounds(procs: _Processes, trees: dict[str, Path], upstream: str,
                args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """CPU seconds a request of each tree's gateway (all running side by side), per mode and
    round: its process's utime + stime over `--cpu-requests` sequential requests, and the same
    less what it spent idle for as long afterwards (health checks, KV event polls)."""
    running = {}
    for name, tree in trees.items():
        module_args, data_dir, url = _serve_args(procs, name + "_cpu", tree, upstream, None)
        process = procs.start(name + "_cpu", [sys.executable, "-m", *module_args],
                              _gateway_env(tree), cwd=str(tree))
        _wait_http(url + "/health", 90, process)
        client = httpx.Client(base_url=url, headers=_auth_headers(data_dir), timeout=60)
        running[name] = (process, client)
    per_round: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    names = list(trees)
    try:
        for name in names:  # warm-up: imports, connections, first-use caches
            for mode in MODES:
                send = _sender(running[name][1], mode)
                for _ in range(args.warmup):
                    send()
        for index in range(args.rounds):
            for name in (names if index % 2 == 0 else names[::-1]):
                process, client = running[name]
                for mode in MODES:
                    send = _sender(client, mode)
                    before = _cpu_seconds(process.pid)
                    started = time.monotonic()
                    for _ in range(args.cpu_requests):
                        send()
                    elapsed_s = time.monotonic() - started
                    after = _cpu_seconds(process.pid)
                    time.sleep(elapsed_s)
                    idle = _cpu_seconds(process.pid) - after
                    cells = per_round[name]
                    cells.setdefault(mode, []).append((after - before) / args.cpu_requests)
                    cells.setdefault(f"{mode}, net of idle", []).append(
                        (after - before - idle) / args.cpu_requests)
    finally:
        for process, client in running.values():
            client.close()
            procs.stop(process.pid)
    return per_round


def _ratio_range(values: list[float], baselines: list[float]) -> str:
    """The per-round ratios (round i of ours over round i of the baseline): median [min, max]."""
    ratios = sorted(v / b for v, b in zip(values, baselines, strict=True) if b)
    if not ratios:
        return ""
    return f"{_median(ratios):.3f} [{ratios[0]:.3f}, {ratios[-1]:.3f}]"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _agent_body() -> dict[str, Any]:
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Does thing {i} to a file, carefully.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                        "line": {"type": "integer"}},
                       "required": ["path"]}}} for i in range(6)]
    return {"model": "m", "max_tokens": 1, "temperature": 0, "tools": tools, "messages": [
        {"role": "system", "content": "You are a coding agent working in a repository. " * 12},
        {"role": "user", "content": "Open main.py and fix the failing test."}]}


def _replica(procs: _Processes, args: argparse.Namespace) -> dict[str, float]:
    from contracts.default_model import default_model_path
    from gateway.routing.prompt_hashing import shared_prompt_hasher

    tree = Path(__file__).resolve().parent.parent
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIGW_")}
    counted = _Counted(procs, "replica", ["cli.main", "replica", "--port", str(port), "--no-auth",
                                          "--threads", "1", "--kv-cache-memory", str(64 << 20)],
                       tree, env)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/health", 300, counted.process)
    hasher = shared_prompt_hasher(str(default_model_path()), 32 << 20)
    with httpx.Client(base_url=url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        messages_body = {**_agent_body(), "model": model}
        ids_body = {**messages_body, "prompt_token_ids": hasher.token_ids(messages_body),
                    "prompt_render_id": hasher.renderer.render_id}
        figures = {}
        for name, body in (("messages", messages_body), ("prompt_token_ids", ids_body)):
            def send(body: dict[str, Any] = body) -> None:
                client.post("/v1/chat/completions", json=body).raise_for_status()

            figures[name] = _per_request(counted, send, args.warmup, args.requests)
        renders = [line for line in client.get("/metrics").text.splitlines()
                   if line.startswith("aigw_replica_prompt_renders_total")]
    procs.stop(counted.process.pid)
    figures["renders"] = renders  # type: ignore[assignment]
    return figures


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir).resolve()  # (each process runs in its own checkout)
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = _Processes(out_dir)
    parts = set(args.parts.split(","))
    rows: list[tuple[str, str, float, float | None]] = []
    spreads: dict[tuple[str, str], str] = {}  # (part, case) -> "[min, max]" of its ratio
    cpu_rows: list[tuple[str, float, float | None, str]] = []
    here = Path(__file__).resolve().parent.parent
    trees = {"aigw": here}
    if args.baseline_tree:
        trees["aigw_baseline"] = Path(args.baseline_tree).resolve()
    try:
        if parts & {"gateway", "fallbacks", "cpu"}:
            mock_port = _free_port()
            mock = procs.start("mock", [sys.executable, "-m", "bench.mock_upstream", "--port",
                                        str(mock_port), "--num-tokens", "16", "--model", MODEL])
            upstream = f"http://127.0.0.1:{mock_port}"
            _wait_http(upstream + "/health", 30, mock)
        if "fallbacks" in parts:
            chained = _gateway(procs, "aigw_chain", here, upstream, args, chain=True)
            plain = _gateway(procs, "aigw_no_chain", here, upstream, args, chain=False)
            for mode, value in chained.items():
                rows.append(("gateway", f"{mode}, chain unused", value, plain[mode]))
        if "gateway" in parts:
            counted = _gateway_rounds(procs, trees, upstream, args)
            ours, base = counted["aigw"], counted.get("aigw_baseline", {})
            for case, values in ours.items():
                rows.append(("gateway", case, _median(values),
                             _median(base[case]) if case in base else None))
                if case in base and args.rounds > 1:
                    spreads[("gateway", case)] = _ratio_range(values, base[case])
        if "cpu" in parts:
            timed = _cpu_rounds(procs, trees, upstream, args)
            ours, base = timed["aigw"], timed.get("aigw_baseline", {})
            for case, values in ours.items():
                cpu_rows.append((case, _median(values),
                                 _median(base[case]) if case in base else None,
                                 _ratio_range(values, base[case]) if case in base else ""))
        if "replica" in parts:
            replica = _replica(procs, args)
            rows.append(("replica", "agent chat, ids given", replica["prompt_token_ids"],
                         replica["messages"]))
            print("\n".join(replica["renders"]))  # type: ignore[arg-type]
    finally:
        procs.stop_all()
    if rows:
        rounds = (f", median of {args.rounds} rounds" if args.rounds > 1 and "gateway" in parts
                  else "")
        print(f"Python calls per request ({args.requests} counted after {args.warmup} warm-up"
              f"{rounds})")
        print(f"{'process':8} {'case':34} {'calls/req':>10} {'baseline':>10} {'ratio':>7}")
        for part, case, value, baseline in rows:
            ratio = f"{value / baseline:7.3f}" if baseline else "      -"
            shown = f"{baseline:10.0f}" if baseline else "         -"
            spread = spreads.get((part, case), "")
            print(f"{part:8} {case:34} {value:10.0f} {shown} {ratio} {spread}".rstrip())
        print("baseline: gateway = --baseline-tree (none given: -), or for 'chain unused' the "
              "same gateway without the chain; replica = the same request as messages, rendered "
              "by the replica")
    if cpu_rows:
        print(f"gateway CPU per request, timed: process utime+stime / {args.cpu_requests} "
              f"sequential requests, median of {args.rounds} rounds (ratio: median of the "
              "rounds' ratios [min, max])")
        print(f"{'case':34} {'cpu us/req':>10} {'baseline':>10} {'ratio':>7}")
        for case, value, baseline, spread in cpu_rows:
            shown = f"{baseline * 1e6:10.0f}" if baseline else "         -"
            print(f"{case:34} {value * 1e6:10.0f} {shown} {spread}".rstrip())
    if args.plot:
        from bench.plotting import BarPanel, write_bar_chart

        write_bar_chart(args.plot, "Python calls per request", [BarPanel(
            "calls per request", "calls", [f"{p} {c}" for p, c, _, _ in rows],
            {"this checkout": [v for _, _, v, _ in rows],
             "baseline": [b for _, _, _, b in rows]})], columns=1)
    return 0
