"""Launch-config tuning: fastest candidate wins, is persisted per GPU file, and reused untimed."""

import json

import torch

from engine.kernels import tuning

CANDIDATES = [{"BLOCK_M": 16, "num_warps": 4}, {"BLOCK_M": 64, "num_warps": 8}]


def test_fastest_candidate_is_chosen_saved_and_reused_without_timing(tmp_path):
    path = tmp_path / "NVIDIA_H200.json"
    timed = []

    def timer(fn):
        fn()
        timed.append(1)
        return {16: 2.0, 64: 1.0}[launched[-1]["BLOCK_M"]]

    launched = []
    best = tuning.pick_cached(path, "moe:8,4096", CANDIDATES, launched.append, timer)
    assert best == CANDIDATES[1] and len(timed) == 2
    assert json.loads(path.read_text()) == {"moe:8,4096": CANDIDATES[1]}

    tuning.forget_in_memory()  # a fresh process reads the file instead of timing again
    again = tuning.pick_cached(path, "moe:8,4096", CANDIDATES, launched.append, timer)
    assert again == CANDIDATES[1] and len(timed) == 2


def test_failing_candidates_are_skipped(tmp_path):
    def launch(cfg):
        if cfg["BLOCK_M"] == 64:
            raise RuntimeError("out of shared memory")

    best = tuning.pick_cached(tmp_path / "g.json", "k", CANDIDATES, launch, lambda fn: fn() or 1.0)
    assert best == CANDIDATES[0]


def test_off_cuda_the_first_candidate_is_used_untimed():
    def launch(cfg):
        raise AssertionError("must not be timed")

    assert tuning.pick_config("k", (1,), CANDIDATES, launch, torch.device("cpu")) == CANDIDATES[0]


def test_split_launch_options_separates_warps_and_stages():
    meta, opts = tuning.split_launch_options({"BLOCK_M": 16, "num_warps": 4, "num_stages": 2})
    assert meta == {"BLOCK_M": 16} and opts == {"num_warps": 4, "num_stages": 2}
