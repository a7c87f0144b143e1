"""`aigw bench soak` end to end with a tiny N (every kind of the mix once) on a tiny random
Llama with the default model's tokenizer (tests/tiny_llama.py: what the soak checks, the ledger,
KV blocks and RSS, does not depend on what the model says; the default model made this ~2.5 min): it
passes its own checks and reports what it measured; and its ledger check catches a record that
differs from the client's usage (so a PASS means something)."""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import pytest

from bench.soak_ledger import compare
from bench.soak_rss import plot_rss, render_trends, rss_trend
from bench.soak_workload import MIX, Outcome, mix
from tests.tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow


def run_bench(argv: list[str]) -> int:
    from cli.bench import register

    parser = argparse.ArgumentParser(prog="aigw")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *argv])
    return int(args.func(args))


def test_a_tiny_soak_passes_and_reports_rss_kv_and_the_ledger(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.md"
    model = write_tiny_llama(tmp_path)
    status = run_bench(["soak", "--requests", str(len(MIX)), "--concurrency", "4",
                        "--threads", "1", "--replica-args", f"--model {model}",
                        "--kv-cache-memory", str(32 << 20), "--out", str(out)])
    printed = capsys.readouterr().out
    if logs := re.search(r"^logs: (\S+)$", printed, re.MULTILINE):  # the run's work directory
        shutil.rmtree(logs[1], ignore_errors=True)
    assert status == 0, printed
    assert printed.startswith("# aigw bench soak: PASS") and out.read_text() in printed
    assert f"requests {len(MIX)} of {len(MIX)} planned" in printed
    assert "| gateway |" in printed and "| replica |" in printed
    assert "kv_blocks_used 0.0 of" in printed and "mismatches 0" in printed
    assert "memory flat: not judged" in printed  # 8 requests: start-up growth, not a trend
    for kind in MIX:  # each kind was sent
        assert f"- {kind}: " in printed


def test_the_mix_sends_every_kind_first() -> None:
    assert mix(len(MIX) + 5, seed=3)[:len(MIX)] == list(MIX)
    assert mix(3, seed=3) == list(MIX)[:3]


def test_the_ledger_check_catches_a_differing_missing_or_double_record() -> None:
    outcomes = [Outcome(0, "chat", "p", 200, (10, 0, 3)), Outcome(1, "abort", "p", 200, None),
                Outcome(2, "bad", "p", 400, None)]
    good = [{"request_id": "soak-0/gw1", "project": "p", "prompt_tokens": 10, "cached_tokens": 0,
             "completion_tokens": 3, "status": 200},
            {"request_id": "soak-1/gw2", "project": "p", "prompt_tokens": 10, "cached_tokens": 0,
             "completion_tokens": 1, "status": 499}]
    assert compare(outcomes, good)["mismatches"] == 0
    off_by_one = [{**good[0], "completion_tokens": 4}, good[1]]
    assert compare(outcomes, off_by_one)["mismatches"] == 1
    assert compare(outcomes, [good[1]])["mismatches"] == 1  # an answered request unrecorded
    assert compare(outcomes, [*good, good[0]])["mismatches"] == 1  # recorded twice
    billed_refusal = [*good, {**good[0], "request_id": "soak-2/gw3", "status": 400}]
    assert compare(outcomes, billed_refusal)["mismatches"] == 1


def test_the_rss_check_finds_growth_after_warm_up_and_passes_a_level_curve(
        tmp_path: Path) -> None:
    mib = 1 << 20
    # (s, requests done, gateway RSS, replica RSS): the replica grows 1 MiB per 100 requests
    # throughout; the gateway grows in warm-up (the first 20%), then stays level
    samples = [(i * 2.0, i * 100, (80 + min(i, 10)) * mib, (500 + i) * mib) for i in range(51)]
    gateway, replica = (rss_trend(samples, p, warmup_fraction=0.2) for p in ("gateway", "replica"))
    assert (gateway.warmup_requests, gateway.end_requests) == (1000, 5000)
    assert gateway.ratio == 1.0 and abs(gateway.slope_mib_per_1k) < 1e-9
    assert gateway.verdict(max_growth=0.05, min_requests=2000) == "PASS"
    assert replica.ratio == 550 / 510 and abs(replica.slope_mib_per_1k - 10.0) < 1e-9
    assert replica.verdict(max_growth=0.05, min_requests=2000) == "FAIL"
    assert replica.verdict(max_growth=0.05, min_requests=10_000) == "not judged"
    lines = "\n".join(render_trends([gateway, replica], 0.05, 2000))
    assert "memory flat: FAIL" in lines and "| replica | 510.0 (at 1000 requests) | 550.0" in lines
    assert plot_rss(samples, [gateway, replica], tmp_path / "rss.png", "t").stat().st_size > 0
