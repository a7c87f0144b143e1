"""`aigw bench gateway`: what the gateway adds over calling the upstream directly.

One run starts a fast mock upstream (bench/mock_upstream.py) and, in front of it: a bare aiohttp
pass-through (bench/bare_proxy.py, the ceiling for a Python proxy), `aigw serve` with auth and
metering off and on (tracing on, as configured by default), the same with tracing off
(`aigw_trace_off`, AIGW_TRACING=0), and LiteLLM's proxy (installed into bench/out/litellm-venv;
skipped with a reason if that fails). On request (`--targets ...`):
    aigw_trace_all   `aigw` tracing every request (AIGW_TRACE_MAX_PER_S=0: no rate limit)
    aigw_twin        a second `aigw` configured the same: the difference two identical gateways
                     show, the noise floor of the tracing comparison
    aigw_baseline    `aigw` served from another checkout (`--baseline-tree PATH`, e.g. a git
                     worktree of an earlier commit) in this venv: two commits in one run
    aigw_fallbacks   `aigw` whose model has a fallback chain (`fallbacks = ["mock-model-b"]`, a
                     second model on the same mock) that no request takes: paired with `aigw`
                     (no chain), what configured chains cost on the path that does not use them
    aigw_logs_guards `aigw` logging every request of the project (request logs at 100%) with a
                     regex guard and a PII guard (masking) on requests and answers: paired with
                     `aigw` (both off), its cost per request as a CPU and req/s ratio
Cells run interleaved (for each mode and concurrency, every target in turn) for `--duration-s`
each. The load generator is a separate aiohttp process. Figures per cell: requests/s, latency
p50/p99 minus the direct p50/p99 ("added"), and the target's CPU ms per request (its whole process
tree, from /proc). `--targets` picks a subset while iterating (direct always runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL = "mock-model"
LITELLM_KEY = "sk-aigw-bench-0123456789"  # LiteLLM refuses to start without a master key
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TARGET_NAMES = ("bare_proxy", "aigw_auth_off", "aigw", "aigw_trace_off", "litellm",
                "aigw_twin", "aigw_trace_all", "aigw_baseline", "aigw_logs_guards")
DEFAULT_TARGETS = TARGET_NAMES[:-4]  # the last four on request only
# aigw_logs_guards: request logs at 100% for the default project, a deny-list and a PII guard
LOGS_GUARDS_CONFIG = """
[request_logs.projects.default]
sample_rate = 1.0
[[guardrails]]
name = "deny"
type = "regex"
[guardrails.options]
words = ["project zeus", "forbidden topic"]
patterns = ['\\bsk-[A-Za-z0-9]{20,}']
[[guardrails]]
name = "pii"
type = "pii"
"""

# (on request only)
TARGET_NAMES += ("aigw_fallbacks",)


@dataclass
class Target:
    name: str
    url: str
    pid: int
    headers: dict[str, str] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration-s", type=float, default=3.0, help="seconds per cell")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--modes", default="nonstream,stream")
    parser.add_argument("--num-tokens", type=int, default=16, help="tokens per mock answer")
    parser.add_argument("--workers", type=int, default=1, help="aigw serve --workers")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every cell this many times, interleaved (targets in turn "
                             "forwards and backwards), and report each figure's median (a noisy "
                             "machine's bursts then hit one round)")
    parser.add_argument("--fresh-gateways", action="store_true",
                        help="start every aigw target anew each round: a difference one process "
                             "shows throughout (its memory layout, where the scheduler put it) "
                             "then varies between rounds instead of biasing every round alike")
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help="comma-separated subset of " + ",".join(TARGET_NAMES)
                             + " (direct, the baseline of the added latency, always runs)")
    parser.add_argument("--baseline-tree", default=None,
                        help="a checkout of another commit: the aigw_baseline target (added to "
                             "--targets) serves from it, configured as aigw")
    parser.add_argument("--out-dir", default="bench/out")
    parser.add_argument("--plot", default=None, help="write a PNG here")


def _free_port() -> int:
    from infra.ports import free_port

    return free_port()


def _wait_http(url: str, timeout_s: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not up after {timeout_s:g}s")


def _wait_port(port: int, timeout_s: float) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"port {port} not listening after {timeout_s:g}s")


def _cpu_seconds(root_pid: int) -> float:
    """utime + stime of a process and all its descendants."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    total, frontier = 0.0, [root_pid]
    while frontier:
        pid = frontier.pop()
        total += stats.get(pid, (0, 0.0))[1]
        frontier += [child for child, (parent, _) in stats.items() if parent == pid]
    return total


class _Processes:
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.running: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen[bytes]:
        log = open(self.out_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        self.running.append(process)
        return process

    def stop(self, pid: int) -> None:
        for process in self.running:
            if process.pid == pid:
                process.terminate()
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.running = [process for process in self.running if process.pid != pid]

    def stop_all(self) -> None:
        for process in self.running:
            process.terminate()
        for process in self.running:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()


def _start_aigw(procs: _Processes, name: str, upstream: str, auth: bool, workers: int,
                extra_env: dict[str, str] | None = None, tree: str | None = None,
                extra_config: str = "") -> Target:
    """`aigw serve` in front of the mock; from the checkout `tree` when given (its own CLI
    module: cli.main, or gateway.cli before the CLI had a package of its own)."""
    port = _free_port()
    data_dir = procs.out_dir / f"{name}-data"
    config = procs.out_dir / f"{name}.toml"
    config.write_text(f'data_dir = "{data_dir}"\n[[models]]\nname = "{MODEL}"\nbackend = '
                      '"replica"\n'
                      f'endpoints = ["{upstream}"]\n[models.prices]\ninput_per_token = 1e-7\n'
                      'output_per_token = 2e-7\n' + extra_config)
    module = "cli.main"
    if tree is not None and not (Path(tree) / "cli" / "main.py").exists():
        module = "gateway.cli"
    command = [sys.executable, "-m", module, "serve", "--config", str(config), "--port",
               str(port), "--workers", str(workers)] + ([] if auth else ["--no-auth"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIGW_")} | (extra_env or {})
    if tree is not None:
        env["PYTHONPATH"] = str(Path(tree).resolve())
    process = procs.start(name, command, env, cwd=tree)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/health", 60, process)
    headers = {}
    if auth:  # the key file is written by whichever worker created the default project
        key_file = data_dir / "default-key.txt"
        deadline = time.monotonic() + 30
        while (not (key_file.exists() and key_file.read_text().strip())
               and time.monotonic() < deadline):
            time.sleep(0.1)
        headers["authorization"] = "Bearer " + key_file.read_text().strip()
    return Target(name, url, process.pid, headers)


def _start_litellm(procs: _Processes, upstream: str) -> Target | str:
    venv = procs.out_dir / "litellm-venv"
    binary = venv / "bin" / "litellm"
    if not binary.exists():
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "litellm[proxy]"],
                           check=True, timeout=900)
        except (subprocess.SubprocessError, OSError) as exc:
            return f"installing litellm[proxy] failed: {exc}"
    port = _free_port()
    config = procs.out_dir / "litellm.yaml"
    config.write_text(f"model_list:\n  - model_name: {MODEL}\n    litellm_params:\n"
                      f"      model: openai/{MODEL}\n      api_base: {upstream}/v1\n"
                      "      api_key: dummy\nlitellm_settings:\n  telemetry: false\n"
                      f"general_settings:\n  master_key: {LITELLM_KEY}\n")
    process = procs.start("litellm", [str(binary), "--config", str(config), "--host", "127.0.0.1",
                                      "--port", str(port), "--num_workers", "1"])
    try:
        _wait_http(f"http://127.0.0.1:{port}/health/liveliness", 180, process)
    except (TimeoutError, RuntimeError) as exc:
        return f"litellm did not start: {exc} (see {procs.out_dir / 'litellm.log'})"
    return Target("litellm", f"http://127.0.0.1:{port}", process.pid,
                  {"authorization": f"Bearer {LITELLM_KEY}"})


def _measure(target: Target, stream: bool, concurrency: int, duration_s: float) -> dict[str, Any]:
    spec = {"url": target.url + "/v1/chat/completions", "headers": target.headers, "stream": stream,
            "concurrency": concurrency, "duration_s": duration_s}
    cpu_before = _cpu_seconds(target.pid)
    done = subprocess.run([sys.executable, "-m", "bench.gateway_bench", "--loadgen",
                           json.dumps(spec)],
                          capture_output=True, timeout=duration_s + 120, check=True)
    cpu_s = _cpu_seconds(target.pid) - cpu_before
    result: dict[str, Any] = json.loads(done.stdout)
    result["cpu_ms_per_request"] = cpu_s * 1000 / max(1, result["num_requests"])
    return result


def _medians(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (target, mode, concurrency): each numeric figure's median over the rounds."""
    rounds: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for row in results:
        rounds.setdefault((row["target"], row["mode"], row["concurrency"]), []).append(row)
    merged = []
    for rows in rounds.values():
        row = dict(rows[0])
        for key, value in rows[0].items():
            if isinstance(value, int | float) and key != "concurrency":
                values = sorted(r[key] for r in rows if r[key] is not None)
                row[key] = values[len(values) // 2] if values else None
        row["num_rounds"] = len(rows)
        merged.append(row)
    return merged


async def _loadgen(spec: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    body: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "stream": spec["stream"],
                            "messages": [{"role": "user", "content": "Hello, how are you today?"}]}
    if spec["stream"]:
        body["stream_options"] = {"include_usage": True}
    latencies: list[float] = []
    num_errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one() -> None:
            nonlocal num_errors
            started = time.perf_counter()
            async with session.post(spec["url"], json=body, headers=spec["headers"]) as response:
                payload = await response.read()
            if response.status != 200 or (spec["stream"] and b"[DONE]" not in payload):
                num_errors += 1
            latencies.append(time.perf_counter() - started)

        for _ in range(min(20, spec["concurrency"] * 2)):  # warm the connections
            await one()
        latencies.clear()
        num_errors = 0
        deadline = time.perf_counter() + spec["duration_s"]

        async def worker() -> None:
            while time.perf_counter() < deadline:
                await one()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(spec["concurrency"])))
        elapsed = time.perf_counter() - started
    latencies.sort()
    n = len(latencies)
    return {"num_requests": n, "num_errors": num_errors, "requests_per_s": n / elapsed,
            "p50_ms": latencies[n // 2] * 1000 if n else None,
            "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1000 if n else None}


def _report(results: list[dict[str, Any]], skipped: dict[str, str]) -> None:
    direct = {(r["mode"], r["concurrency"]): r for r in results if r["target"] == "direct"}
    print(f"{'mode':9} {'conc':>4} {'target':14} {'req/s':>8} {'p50 ms':>8} {'+p50 ms':>8} "
          f"{'+p99 ms':>8} {'cpu ms/req':>10} {'errors':>6}")
    for r in results:
        base = direct[(r["mode"], r["concurrency"])]
        r["added_p50_ms"] = r["p50_ms"] - base["p50_ms"]
        r["added_p99_ms"] = r["p99_ms"] - base["p99_ms"]
        print(f"{r['mode']:9} {r['concurrency']:>4} {r['target']:14} {r['requests_per_s']:>8.0f} "
              f"{r['p50_ms']:>8.2f} {r['added_p50_ms']:>8.2f} {r['added_p99_ms']:>8.2f} "
              f"{r['cpu_ms_per_request']:>10.2f} {r['num_errors']:>6}")
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")


Pair = tuple[dict[str, Any], dict[str, Any]]


def _paired_cells(per_round: list[dict[str, Any]], first: str,
                  second: str) -> list[tuple[str, int, list[Pair]]]:
    """(mode, concurrency, [(first's row, second's row) per round]) for every cell where both
    targets ran the same number of rounds (the two run back to back within a round)."""
    cells: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = {}
    for row in per_round:
        if row["target"] in (first, second):
            cells.setdefault((row["mode"], row["concurrency"]), {first: [], second: []}
                             )[row["target"]].append(row)
    return [(mode, concurrency, list(zip(by[first], by[second], strict=True)))
            for (mode, concurrency), by in cells.items()
            if by[first] and len(by[first]) == len(by[second])]


def _spread(values: list[float], spec: str, unit: str = "") -> str:
    """`median [min, max]` of `values`, each formatted with `spec`, the median followed by
    `unit`."""
    ordered = sorted(values)
    return (f"{ordered[len(ordered) // 2]:{spec}}{unit} "
            f"[{ordered[0]:{spec}}, {ordered[-1]:{spec}}]")


def _cpu_differences_us(paired: list[Pair]) -> list[float]:
    """first's CPU ms a request minus second's, per round, in microseconds."""
    return [(a["cpu_ms_per_request"] - b["cpu_ms_per_request"]) * 1000 for a, b in paired]


def _ratios(paired: list[Pair], key: str) -> list[float]:
    """first's `key` over second's, per round (a zero second counts as 1e-9)."""
    return [a[key] / max(b[key], 1e-9) for a, b in paired]


def _rps_and_cpu_lines(per_round: list[dict[str, Any]], first: str, second: str,
                       label: str) -> list[str]:
    """Per cell: the req/s ratio first/second and the CPU difference a request, over the rounds."""
    return [f"{mode:9} {concurrency:>4}   req/s {label:8} "
            f"{_spread([a['requests_per_s'] / b['requests_per_s'] for a, b in paired], '.3f')}"
            f"   cpu difference "
            f"{_spread(_cpu_differences_us(paired), '+.0f', ' us')}"
            for mode, concurrency, paired in _paired_cells(per_round, first, second)]


def _print_section(title: str, lines: list[str]) -> None:
    if lines:
        print(f"{title}, paired per round: median [min, max] over the rounds")
        print("\n".join(lines))


def _report_tracing_cost(per_round: list[dict[str, Any]]) -> None:
    """Tracing as configured by default (`aigw`: new traces rate-limited) against off
    (`aigw_trace_off`). When in the run, also: tracing every request (`aigw_trace_all`) against
    off, and `aigw` against `aigw_twin` (a second `aigw` process configured the same): the
    difference two identical gateways show on this machine, the floor below which a tracing
    figure means nothing. With `aigw_baseline`: `aigw` against the other checkout's gateway. A
    range that spans 1.0 / 0 is a difference the run cannot tell from noise."""
    pairs = [("aigw", "aigw_trace_off", "on/off"), ("aigw_trace_all", "aigw_trace_off", "all/off"),
             ("aigw", "aigw_twin", "on/twin"), ("aigw", "aigw_baseline", "on/base")]
    _print_section("tracing on vs off (and vs an identical twin)",
                   [line for first, second, label in pairs
                    for line in _rps_and_cpu_lines(per_round, first, second, label)])


def _extra_config(name: str) -> str:
    return LOGS_GUARDS_CONFIG if name == "aigw_logs_guards" else ""


def _report_policy_cost(per_round: list[dict[str, Any]]) -> None:
    """Request logs at 100% and guardrails on (`aigw_logs_guards`) against both off (`aigw`): the
    CPU ms a request ratio (the cost per request) and the req/s ratio."""
    lines = [f"{mode:9} {concurrency:>4}   cpu/req on/off "
             f"{_spread(_ratios(paired, 'cpu_ms_per_request'), '.3f')}"
             f"   req/s on/off "
             f"{_spread(_ratios(paired, 'requests_per_s'), '.3f')}"
             for mode, concurrency, paired in _paired_cells(per_round, "aigw_logs_guards", "aigw")]
    _print_section("request logs at 100% + guardrails (regex, PII) vs both off", lines)


def _chain_env(upstream: str) -> dict[str, str]:
    """`aigw_fallbacks`' models (the environment wins over the config file): the bench's model
    with a fallback to a second model on the same mock, which every request leaves unused."""
    prices = {"input_per_token": 1e-7, "output_per_token": 2e-7}
    models = [{"name": MODEL, "backend": "replica", "endpoints": [upstream], "prices": prices,
               "fallbacks": [MODEL + "-b"]},
              {"name": MODEL + "-b", "backend": "replica", "endpoints": [upstream],
               "upstream_model": MODEL, "prices": prices}]
    return {"AIGW_MODELS": json.dumps(models)}


def _report_fallback_cost(per_round: list[dict[str, Any]]) -> None:
    """`aigw_fallbacks` (a chain configured, never taken) against `aigw` (none)."""
    _print_section("a fallback chain configured but unused vs none",
                   _rps_and_cpu_lines(per_round, "aigw_fallbacks", "aigw", "chain/none"))


def _plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in results})
    figure, axes = plt.subplots(2, len(modes), figsize=(6 * len(modes), 8), squeeze=False)
    for column, mode in enumerate(modes):
        for target in dict.fromkeys(r["target"] for r in results):
            rows = [r for r in results if r["mode"] == mode and r["target"] == target]
            xs = [r["concurrency"] for r in rows]
            axes[0][column].plot(xs, [r["requests_per_s"] for r in rows], marker="o", label=target)
            axes[1][column].plot(xs, [r["added_p50_ms"] for r in rows], marker="o", label=target)
        axes[0][column].set(title=f"{mode}: requests/s", xscale="log", yscale="log")
        axes[1][column].set(title=f"{mode}: added p50 latency (ms)", xscale="log",
                            xlabel="concurrency")
        axes[0][column].legend()
    figure.tight_layout()
    figure.savefig(path)


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = _Processes(out_dir)
    skipped: dict[str, str] = {}
    results: list[dict[str, Any]] = []
    try:
        mock_port = _free_port()
        mock = procs.start("mock", [sys.executable, "-m", "bench.mock_upstream", "--port",
                                    str(mock_port), "--num-tokens", str(args.num_tokens), "--model",
                                    MODEL])
        upstream = f"http://127.0.0.1:{mock_port}"
        _wait_http(upstream + "/health", 30, mock)
        wanted = set(args.targets.split(","))
        if args.baseline_tree:
            wanted.add("aigw_baseline")
        elif "aigw_baseline" in wanted:
            raise SystemExit("aigw_baseline needs --baseline-tree PATH")
        unknown = wanted - set(TARGET_NAMES)
        if unknown:
            raise SystemExit(f"unknown targets: {sorted(unknown)}")
        targets = [Target("direct", upstream, mock.pid)]
        if "bare_proxy" in wanted:
            bare_port = _free_port()
            bare = procs.start("bare_proxy", [sys.executable, "-m", "bench.bare_proxy", "--port",
                                              str(bare_port), "--upstream", upstream])
            _wait_port(bare_port, 30)
            targets.append(Target("bare_proxy", f"http://127.0.0.1:{bare_port}", bare.pid))
        # aigw sits between its two comparisons (tracing off, its twin), so that in either
        # direction each is measured right next to it
        gateways = [(name, auth, extra_env, tree) for name, auth, extra_env, tree in (
            ("aigw_auth_off", False, None, None),
            ("aigw_trace_all", True, {"AIGW_TRACE_MAX_PER_S": "0"}, None),
            ("aigw_trace_off", True, {"AIGW_TRACING": "0"}, None),
            ("aigw", True, None, None), ("aigw_baseline", True, None, args.baseline_tree),
            ("aigw_twin", True, None, None),
            ("aigw_fallbacks", True, _chain_env(upstream), None),
            ("aigw_logs_guards", True, None, None))
            if name in wanted]
        for name, auth, extra_env, tree in gateways:
            # each run starts from an empty store (a usage table grown by earlier runs would
            # make one target's writes costlier than another's)
            shutil.rmtree(out_dir / f"{name}-data", ignore_errors=True)
            targets.append(_start_aigw(procs, name, upstream, auth, args.workers, extra_env, tree,
                                       _extra_config(name)))
        if args.no_litellm or "litellm" not in wanted:
            skipped["litellm"] = "--no-litellm" if args.no_litellm else "not in --targets"
        else:
            litellm = _start_litellm(procs, upstream)
            if isinstance(litellm, str):
                skipped["litellm"] = litellm
            else:
                targets.append(litellm)
        for round_index in range(args.rounds):
            if args.fresh_gateways and round_index > 0:
                for index, target in enumerate(targets):
                    spec = next((g for g in gateways if g[0] == target.name), None)
                    if spec is not None:
                        procs.stop(target.pid)
                        name, auth, extra_env, tree = spec
                        targets[index] = _start_aigw(procs, name, upstream, auth, args.workers,
                                                     extra_env, tree, _extra_config(name))
            # direct first (the added latency's baseline), the others in turn forwards and
            # backwards: a target measured right after another is not always the same one
            ordered = targets if round_index % 2 == 0 else [targets[0], *targets[:0:-1]]
            for mode in args.modes.split(","):
                for concurrency in (int(c) for c in args.concurrency.split(",")):
                    for target in ordered:
                        cell = _measure(target, mode == "stream", concurrency, args.duration_s)
                        results.append({"target": target.name, "mode": mode,
                                        "concurrency": concurrency, **cell})
    finally:
        procs.stop_all()
    per_round = results
    results = _medians(results)
    _report(results, skipped)
    _report_tracing_cost(per_round)
    _report_fallback_cost(per_round)
    _report_policy_cost(per_round)
    (out_dir / "gateway_bench.json").write_text(json.dumps(results, indent=1))
    if args.plot:
        _plot(results, args.plot)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--loadgen":
        print(json.dumps(asyncio.run(_loadgen(json.loads(sys.argv[2])))))
    else:
        parser = argparse.ArgumentParser(prog="aigw bench gateway")
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
