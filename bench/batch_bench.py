"""`aigw bench batch`: what running a batch's lines in prefix order buys, beside the file's own
order, in one run on one real replica.

The batch: `--num-prefixes` agent-like system prompts of ~`--prefix-words` words, each shared by
`--lines-per-prefix` lines, interleaved in the file (prompt 0, 1, 2, ..., 0, 1, 2, ...), as a
log of several agents' turns would be. The replica's KV cache (`--kv-cache-memory`) holds fewer
prompts than the batch has, so the order decides what the prefix cache can serve. The same file
goes through an in-process gateway (the Batch API, `batch.order` = `file`, then `prefix`; the
replica's cache emptied before each) and the figures are read from the output file: prompt
tokens served from the cache (`cached_tokens`) and the batch's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.plotting import BarPanel, fmt, format_table, write_bar_chart

ORDERS = ("file", "prefix")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="replica model path (default: the bundled one)")
    parser.add_argument("--kv-cache-memory", type=int, default=32 << 20,
                        help="the replica's KV cache bytes (smaller than the batch's prompts)")
    parser.add_argument("--num-prefixes", type=int, default=4, help="distinct system prompts")
    parser.add_argument("--lines-per-prefix", type=int, default=5)
    parser.add_argument("--prefix-words", type=int, default=300, help="words per system prompt")
    parser.add_argument("--max-tokens", type=int, default=1, help="completion tokens per line")
    parser.add_argument("--concurrency", type=int, default=2, help="batch.max_concurrent_lines")
    parser.add_argument("--plot", default=None, help="write a PNG here")
    parser.add_argument("--json", default=None, help="write the figures as JSON here")


def batch_lines(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    words = ("read edit test explain small change file repository agent tool call result plan "
             "step careful review").split()
    systems = [f"Agent {p}. " + " ".join(words[(p * 7 + i) % len(words)] for i in
                                         range(args.prefix_words))
                                         for p in range(args.num_prefixes)]
    return [{"custom_id": f"p{p}-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "max_tokens": args.max_tokens, "temperature": 0,
                      "messages": [{"role": "system", "content": systems[p]},
                                   {"role": "user", "content": f"Task {i}."}]}}
            for i in range(args.lines_per_prefix) for p in range(args.num_prefixes)]


async def run_batch(model: Any, replica_url: str, order: str, lines: list[dict[str, Any]],
                    concurrency: int) -> dict[str, float]:
    from aiohttp import web

    from gateway.settings import GatewaySettings
    from gateway.web.app import create_app

    async with httpx.AsyncClient(timeout=60) as http:  # an empty prefix cache for each order
        (await http.post(replica_url + "/kv/reset")).raise_for_status()
    with tempfile.TemporaryDirectory() as data_dir:
        settings = GatewaySettings(auth_enabled=False, data_dir=Path(data_dir), models=[model],
                                   first_token_timeout_s=300, response_timeout_s=600,
                                   batch={"order": order, "poll_interval_s": 0.1,
                                          "max_concurrent_lines": concurrency})
        runner = web.AppRunner(create_app(settings))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        base = f"http://127.0.0.1:{port}/v1"
        try:
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                content = b"".join(orjson.dumps(line) + b"\n" for line in lines)
                upload = (await http.post("/files", data={"purpose": "batch"}, files={
                    "file": ("bench.jsonl", io.BytesIO(content))})).json()
                started = time.perf_counter()
                batch = (await http.post("/batches", json={
                    "input_file_id": upload["id"], "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"})).json()
                while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
                    await asyncio.sleep(0.1)
                    batch = (await http.get(f"/batches/{batch['id']}")).json()
                wall_s = time.perf_counter() - started
                if batch["status"] != "completed" or not batch["output_file_id"]:
                    raise SystemExit(f"the batch ended {batch['status']}: {batch}")
                output = (await http.get(f"/files/{batch['output_file_id']}/content")).content
        finally:
            await runner.cleanup()
    usage = [orjson.loads(line)["response"]["body"]["usage"] for line in output.splitlines()]
    num_prompt = sum(u["prompt_tokens"] for u in usage)
    num_cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    return {"wall_s": wall_s, "num_prompt_tokens": num_prompt, "num_cached_tokens": num_cached,
            "cached_ratio": num_cached / num_prompt if num_prompt else 0.0,
            "num_lines": len(usage)}


def run(args: argparse.Namespace) -> int:
    from gateway.fleet import embedded

    replicas = embedded.start_replicas(1, args.model, args.kv_cache_memory)
    try:
        embedded.wait_healthy(replicas, timeout_s=600)
        model = embedded.model_settings_for(replicas)
        lines = batch_lines(model.name, args)
        results = {order: asyncio.run(run_batch(model, replicas[0].url, order, lines,
                                                args.concurrency)) for order in ORDERS}
    finally:
        embedded.stop_replicas(replicas)
    base = results["file"]
    rows = [[order, fmt(r["wall_s"], 2), f"{r['num_cached_tokens']}/{r['num_prompt_tokens']}",
             fmt(100 * r["cached_ratio"]), fmt(base["wall_s"] / r["wall_s"], 2)]
            for order, r in results.items()]
    print(f"{len(lines)} lines, {args.num_prefixes} system prompts of ~{args.prefix_words} words "
          f"interleaved, KV cache {args.kv_cache_memory >> 20} MiB, {args.concurrency} lines at a "
          f"time (a shared, noisy machine: wall times are rough, token counts exact):")
    print(format_table(["order", "wall s", "cached/prompt tokens", "cached %",
                        "speed vs file order"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        write_bar_chart(args.plot, "Batch lines: prefix order vs file order", [
            BarPanel("prompt tokens from the cache", "%", ["cached"],
                     {o: [100 * results[o]["cached_ratio"]] for o in ORDERS}),
            BarPanel("batch wall time", "s", ["wall"],
                     {o: [results[o]["wall_s"]] for o in ORDERS})])
    return 0
