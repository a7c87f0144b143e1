"""`aigw bench engine --tiny` and `aigw bench agent --tiny` run end to end, print their tables and
write their PNG and JSON. Sizes are tiny and no figure is compared with a time: only what must hold
at any speed (cache hits only with the cache on, every request counted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_bench(argv: list[str]) -> int:
    from cli.bench import register

    parser = argparse.ArgumentParser(prog="aigw")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *argv])
    return int(args.func(args))


def test_engine_bench_tiny_prints_table_and_writes_png(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    png, out = tmp_path / "engine.png", tmp_path / "engine.json"
    assert run_bench(["engine", "--tiny", "--plot", str(png), "--json", str(out)]) == 0

    printed = capsys.readouterr().out
    assert "prefill tok/s" in printed and "TTFT p50 ms" in printed
    assert png.read_bytes().startswith(PNG_MAGIC)
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["ours[q4]"]  # the CPU default mode; --tiny skips transformers
    ours = results["ours[q4]"]
    assert ours["prefill_tok_s"] > 0 and ours["decode_tok_s"] > 0
    assert ours["shared_prefix"]["output_tok_s"] > 0  # the 16 x 898 row, 2 x 16 in --tiny
    assert sorted(ours["concurrency"]) == ["1", "2"]
    assert all(row["output_tok_s"] > 0 for row in ours["concurrency"].values())


def test_agent_bench_tiny_reports_hits_only_with_cache_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, out = tmp_path / "agent.png", tmp_path / "agent.json"
    assert run_bench(["agent", "--tiny", "--plot", str(png), "--json", str(out)]) == 0

    printed = capsys.readouterr().out
    assert "hit %" in printed and "of bound" in printed
    assert png.read_bytes().startswith(PNG_MAGIC)
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["agent", "shared-prefix", "hit30", "zero-reuse"]
    for name, modes in results.items():
        assert modes["off"]["hit_ratio"] == 0.0, name
        assert modes["on"]["num_requests"] == modes["off"]["num_requests"], name
    # later turns re-use the system prompt and history
    assert results["agent"]["on"]["hit_ratio"] > 0.3
    assert results["hit30"]["on"]["hit_ratio"] == pytest.approx(0.25)  # 16 of 64 tokens primed
    assert results["zero-reuse"]["on"]["hit_ratio"] == 0.0


@pytest.mark.slow  # four small engines (the block probe, two modes, the fan-out): ~60 s on 2 cores
def test_agent_pauses_tiny_runs_two_modes_on_virtual_clocks_and_the_fanout_computes_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, out, turns = tmp_path / "pauses.png", tmp_path / "pauses.json", tmp_path / "turns.json"
    assert run_bench(["agent", "--pauses", "--tiny", "--modes", "retention+tier,oracle", "--plot",
                      str(png), "--json", str(out), "--turns-json", str(turns)]) == 0

    printed = capsys.readouterr().out
    assert "tail turns" in printed and "fan-out:" in printed and "virtual clock" in printed
    assert png.read_bytes().startswith(PNG_MAGIC)
    document = json.loads(out.read_text())
    assert list(document["results"]) == ["retention+tier", "oracle"]
    records = json.loads(turns.read_text())
    for mode, rows in records.items():
        # 3 sessions x 2 turns
        assert len(rows) == document["results"][mode]["num_turns"] == 6, mode
        for row in rows:
            assert (0 <= row["num_host_tokens"] <= row["num_cached_tokens"]
                    < row["num_prompt_tokens"])
            assert row["ttft_s"] > 0 and row["queue_s"] >= 0
        assert (sorted((r["session"], r["turn"]) for r in rows)
                == [(s, t) for s in range(3) for t in range(2)])
    fanout = document["fanout"]  # 3 requests, a new 96-token prefix (6 blocks) + 8 tokens each
    assert fanout["num_computed_tokens"] == 96 + 3 * 8  # the prefix once, not three times


def test_gateway_bench_pairs_tracing_with_off_and_a_twin_on_fresh_gateways(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two short rounds, each gateway started anew for the second: every cell answered, and the
    tracing report pairs aigw with tracing off and with its identical twin per round."""
    assert run_bench(["gateway", "--duration-s", "0.3", "--rounds", "2", "--concurrency", "1",
                      "--modes", "nonstream", "--fresh-gateways", "--out-dir", str(tmp_path),
                      "--targets", "aigw,aigw_trace_off,aigw_twin,aigw_trace_all"]) == 0
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "gateway_bench.json").read_text())
    assert sorted(r["target"] for r in rows) == ["aigw", "aigw_trace_all", "aigw_trace_off",
                                                 "aigw_twin", "direct"]
    assert all(r["num_rounds"] == 2 and r["num_requests"] > 0 and r["num_errors"] == 0
               for r in rows)
    for label in ("on/off", "all/off", "on/twin"):
        assert f"req/s {label}" in printed, printed
