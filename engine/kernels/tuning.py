"""Launch-config tuning for Triton kernels, persisted per GPU model.

A kernel offers a short list of candidate configs (dicts of constexpr meta-parameters plus
`num_warps` / `num_stages`). On CUDA the first launch for a shape bucket times every candidate with
`triton.testing.do_bench` and remembers the fastest, in memory and in
`~/.cache/aigw/kernels/<gpu name>.json`; later processes on the same GPU model reuse it without
timing. Off CUDA (the Triton interpreter in tests) the first candidate is used and nothing is
written.

Only out-of-place kernels are tuned: timing launches a kernel several times on the caller's tensors.
Set `AIGW_KERNEL_TUNE=0` to skip timing and always use the first candidate.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

Config = dict[str, Any]

_LOCK = threading.Lock()
_MEMORY: dict[str, Config] = {}
_FILE_LOADED: set[str] = set()
# (kernel, key, device index) -> config: the per-launch fast path
_PICKED: dict[tuple[Any, ...], Config] = {}
# AIGW_KERNEL_TUNE=0: the first candidate, untimed; read once at import, not per launch
TUNING = os.environ.get("AIGW_KERNEL_TUNE") != "0"


def cache_path(device: torch.device) -> Path:
    """The JSON file holding tuned configs for the GPU model of `device`."""
    name = torch.cuda.get_device_name(device)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "gpu"
    root = Path(os.environ.get("AIGW_KERNEL_CACHE_DIR",
                               Path.home() / ".cache" / "aigw" / "kernels"))
    return root / f"{safe}.json"


def _load_file(path: Path) -> None:
    if str(path) in _FILE_LOADED:
        return
    _FILE_LOADED.add(str(path))
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    for key, cfg in stored.items():
        _MEMORY.setdefault(f"{path}|{key}", cfg)


def _save_file(path: Path, key: str, cfg: Config) -> None:
    try:
        stored = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        stored = {}
    stored[key] = cfg
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home only costs re-tuning in the next process


def pick_config(
    kernel_name: str,
    key: Sequence[Any],
    candidates: Sequence[Config],
    launch: Callable[[Config], None],
    device: torch.device,
) -> Config:
    """Return the fastest of `candidates` for (`kernel_name`, `key`) on `device`.

    `launch(cfg)` must run the kernel once with `cfg`, writing only scratch/output tensors.
    `key` must be a small tuple of ints/strings that buckets the shapes the kernel sees.
    """
    if not candidates:
        raise ValueError("no candidate configs")
    if not TUNING or device.type != "cuda" or len(candidates) == 1:
        return dict(candidates[0])
    fast_key = (kernel_name, tuple(key), device.index)
    picked = _PICKED.get(fast_key)  # a dict lookup per launch: launches of small shapes are ~10 us
    if picked is not None:
        return picked
    from triton.testing import do_bench

    full_key = f"{kernel_name}:{','.join(str(k) for k in key)}"
    timer = functools.partial(do_bench, warmup=5, rep=20)
    picked = pick_cached(cache_path(device), full_key, candidates, launch, timer)
    _PICKED[fast_key] = picked
    return picked


def pick_cached(
    path: Path,
    full_key: str,
    candidates: Sequence[Config],
    launch: Callable[[Config], None],
    timer: Callable[[Callable[[], None]], float],
) -> Config:
    """The tuning core: memory, then the JSON file at `path`, then time every candidate."""
    with _LOCK:
        _load_file(path)
        found = _MEMORY.get(f"{path}|{full_key}")
    if found is not None:
        return found
    timings: list[tuple[float, int]] = []
    for i, cfg in enumerate(candidates):
        try:
            timings.append((timer(lambda c=cfg: launch(c)), i))
        except Exception:  # a config may exceed shared memory on some GPUs
            continue
    if not timings:
        raise RuntimeError(f"{full_key}: no candidate config could be launched")
    best = dict(candidates[min(timings)[1]])
    with _LOCK:
        _MEMORY[f"{path}|{full_key}"] = best
        _save_file(path, full_key, best)
    return best


def forget_in_memory() -> None:
    """Drop the in-process cache (tests: simulate a fresh process)."""
    with _LOCK:
        _MEMORY.clear()
        _FILE_LOADED.clear()
        _PICKED.clear()


def split_launch_options(cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a config into (constexpr meta-parameters, launch options num_warps/num_stages)."""
    meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    opts = {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}
    return meta, opts
