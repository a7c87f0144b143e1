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

Each process runs under bench/call_counter.py (a profile hook counting every Python call, all
threads); counts are read after a warm-up, over `--requests` sequential requests. Background work
(health checks, the KV event loop) is counted too, so a slower run counts more of it a request;
each gateway cell is therefore also given "net of idle": the gateway then idles as long as the
requests took, and the calls it makes meanwhile are subtracted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.gateway_bench import MODEL, _free_port, _Processes, _wait_http

COUNTER = Path(__file__).with_name("call_counter.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=200, help="counted requests per cell")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--baseline-tree", default=None,
                        help="an earlier checkout (git archive) to count the gateway against")
    parser.add_argument("--parts", default="gateway,replica")
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


def _gateway(procs: _Processes, name: str, tree: Path, upstream: str, args: argparse.Namespace,
             chain: bool | None = None) -> dict[str, float]:
    """`chain` None: the bench's one model; False: a second model too; True: the first falls
    back to the second."""
    data_dir = procs.out_dir / f"{name}-data"
    config = procs.out_dir / f"{name}.toml"
    fallbacks = f'fallbacks = ["{MODEL}-b"]\n' if chain else ""
    second = "" if chain is None else (f'[[models]]\nname = "{MODEL}-b"\nbackend = "replica"\n'
                                       f'upstream_model = "{MODEL}"\nendpoints = ["{upstream}"]\n')
    config.write_text(f'data_dir = "{data_dir}"\n[[models]]\nname = "{MODEL}"\nbackend = "replica"\n'
                      f'endpoints = ["{upstream}"]\n{fallbacks}[models.prices]\n'
                      'input_per_token = 1e-7\noutput_per_token = 2e-7\n' + second)
    module = "cli.main" if (tree / "cli" / "main.py").exists() else "gateway.cli"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIGW_")}
    counted = _Counted(procs, name, [module, "serve", "--config", str(config), "--port", str(port),
                                     "--workers", "1"], tree, env)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/health", 90, counted.process)
    key_file = data_dir / "default-key.txt"
    deadline = time.monotonic() + 30
    while not (key_file.exists() and key_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    headers = {"authorization": "Bearer " + key_file.read_text().strip()}
    figures = {}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for mode in ("nonstream", "stream"):
            body = {"model": MODEL, "max_tokens": 16, "stream": mode == "stream",
                    "messages": [{"role": "user", "content": "Hello, how are you today?"}]}

            def send(body: dict[str, Any] = body) -> None:
                response = client.post("/v1/chat/completions", json=body)
                response.raise_for_status()
                response.read()

            figures[mode], figures[f"{mode}, net of idle"] = _per_request_net(
                counted, send, args.warmup, args.requests)
    procs.stop(counted.process.pid)
    return figures


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
    try:
        if parts & {"gateway", "fallbacks"}:
            mock_port = _free_port()
            mock = procs.start("mock", [sys.executable, "-m", "bench.mock_upstream", "--port",
                                        str(mock_port), "--num-tokens", "16", "--model", MODEL])
            upstream = f"http://127.0.0.1:{mock_port}"
            _wait_http(upstream + "/health", 30, mock)
        if "fallbacks" in parts:
            here = Path(__file__).resolve().parent.parent
            chained = _gateway(procs, "aigw_chain", here, upstream, args, chain=True)
            plain = _gateway(procs, "aigw_no_chain", here, upstream, args, chain=False)
            for mode, value in chained.items():
                rows.append(("gateway", f"{mode}, chain unused", value, plain[mode]))
        if "gateway" in parts:
            ours = _gateway(procs, "aigw", Path(__file__).resolve().parent.parent, upstream, args)
            base = (_gateway(procs, "aigw_baseline", Path(args.baseline_tree).resolve(), upstream,
                             args) if args.baseline_tree else {})
            for mode, value in ours.items():
                rows.append(("gateway", mode, value, base.get(mode)))
        if "replica" in parts:
            replica = _replica(procs, args)
            rows.append(("replica", "agent chat, ids given", replica["prompt_token_ids"],
                         replica["messages"]))
            print("\n".join(replica["renders"]))  # type: ignore[arg-type]
    finally:
        procs.stop_all()
    print(f"Python calls per request ({args.requests} counted after {args.warmup} warm-up)")
    print(f"{'process':8} {'case':34} {'calls/req':>10} {'baseline':>10} {'ratio':>7}")
    for part, case, value, baseline in rows:
        ratio = f"{value / baseline:7.3f}" if baseline else "      -"
        shown = f"{baseline:10.0f}" if baseline else "         -"
        print(f"{part:8} {case:34} {value:10.0f} {shown} {ratio}")
    print("baseline: gateway = --baseline-tree (none given: -), or for 'chain unused' the same "
          "gateway without the chain; replica = the same request as messages, rendered by the "
          "replica")
    if args.plot:
        from bench.plotting import BarPanel, write_bar_chart

        write_bar_chart(args.plot, "Python calls per request", [BarPanel(
            "calls per request", "calls", [f"{p} {c}" for p, c, _, _ in rows],
            {"this checkout": [v for _, _, v, _ in rows],
             "baseline": [b for _, _, _, b in rows]})], columns=1)
    return 0
