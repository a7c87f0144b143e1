"""`aigw bench slo --tiny --clock wall` end to end on the default model: both policies' replicas
serve every cell over HTTP (the virtual clock's in-process path: test_slo_virtual.py), the table
and the goodput PNG and raw results are written. No figure is compared with a time; only what
holds at any speed: the fixed budget never refuses, a refusal always
carries Retry-After, every request sent is refused or finished, goodput <= what was sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.test_bench_smoke import PNG_MAGIC, run_bench


def test_slo_bench_tiny_runs_both_policies_and_writes_plot_and_results(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, md, out = tmp_path / "slo.png", tmp_path / "slo.md", tmp_path / "slo.json"
    assert run_bench(["slo", "--tiny", "--clock", "wall", "--workloads", "mixed", "--plot",
                      str(png), "--results", str(md), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "goodput/s" in printed and "slo/fixed" in printed and "priority" in printed
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "slo vs fixed" in md.read_text()
    cells = json.loads(out.read_text())["results"]["mixed"]
    assert [c["rate_per_s"] for c in cells["fixed"]] == [c["rate_per_s"] for c in cells["slo"]]
    for policy, rows in cells.items():
        for cell in rows:
            assert cell["num_sent"] > 0, (policy, cell)
            assert cell["num_sent"] == (cell["num_refused"] + cell["num_finished"]
                                        + cell["num_unfinished"]), (policy, cell)
            assert cell["num_good"] <= cell["num_finished"]
            assert cell["num_refused_without_retry_after"] == 0
    assert all(cell["num_refused"] == 0 for cell in cells["fixed"])  # no admission control
    # the same arrivals for both policies
    assert [c["num_sent"] for c in cells["fixed"]] == [c["num_sent"] for c in cells["slo"]]
