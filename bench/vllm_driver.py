"""vLLM's CPU build on `aigw bench engine`'s workloads: run by the interpreter of a separate venv
that has vLLM (`--vllm-python`), never imported by the project (it imports nothing of it).

    python bench/vllm_driver.py IN.json OUT.json

IN.json: {"model": HF directory (float32 weights), "threads": N, "kv_cache_gib": G,
"prefill": [[ids], ...] (the first is a warm-up), "decode": [ids], "decode_tokens": N,
"concurrent": {"C": [[ids], ...]}, "output_tokens": N, "shared_prefix": [[ids], ...],
"shared_prefix_output_tokens": N, "eager": bool (vLLM without torch.compile)}. OUT.json: the figures
in the shape of engine_bench.measure_ours.

Offline `LLM.generate` (greedy, ignore_eos, prompts as token ids, prefix caching on): prefill
tok/s = prompt tokens / the wall time of a 1-token generate (median after the warm-up); decode tok/s
= (N - 1) / (wall(N tokens) - wall(1 token)) on the same prompt; a concurrent row = all output
tokens / the wall time of one generate call holding every prompt (no per-request TTFT: offline
vLLM gives none here, so those cells are empty).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main(in_path: str, out_path: str) -> int:
    spec = json.loads(open(in_path).read())
    threads = int(spec["threads"])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype="float32", enable_prefix_caching=True,
              max_model_len=2048, seed=0, enforce_eager=bool(spec.get("eager", False)))

    def wall(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0,
                                ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        return elapsed

    wall([spec["decode"][:8]], 2)  # warm-up
    prefill = []
    for i, prompt in enumerate(spec["prefill"]):
        llm.reset_prefix_cache()  # every token computed, as ours runs prefill with caching off
        seconds = wall([prompt], 1)
        if i:
            prefill.append(len(prompt) / seconds)
    llm.reset_prefix_cache()
    one = wall([spec["decode"]], 1)
    llm.reset_prefix_cache()
    many = wall([spec["decode"]], spec["decode_tokens"])
    rows = {}
    for level, prompts in spec["concurrent"].items():
        llm.reset_prefix_cache()
        seconds = wall(prompts, spec["output_tokens"])
        rows[level] = _row(len(prompts) * spec["output_tokens"], seconds)
    llm.reset_prefix_cache()
    shared = spec["shared_prefix"]
    seconds = wall(shared, spec["shared_prefix_output_tokens"])
    result = {"prefill_tok_s": statistics.median(prefill),
              "decode_tok_s": (spec["decode_tokens"] - 1) / (many - one),
              "concurrency": rows,
              "shared_prefix": _row(len(shared) * spec["shared_prefix_output_tokens"], seconds)}
    open(out_path, "w").write(json.dumps(result))
    return 0


def _row(num_tokens: int, seconds: float) -> dict[str, float | None]:
    return {"output_tok_s": num_tokens / seconds, "wall_s": seconds, "ttft_p50_s": None,
            "ttft_p90_s": None, "tpot_p50_s": None, "tpot_p90_s": None}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
