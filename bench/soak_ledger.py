"""The soak's ledger check: the gateway's usage records (its SQLite meter) against what each
client received, request by request, and `aigw usage` against the records.

    records = read_ledger(data_dir)                 # after the gateway has drained
    result = compare(outcomes, records)             # {"mismatches": n, "problems": [...], ...}
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bench.soak_workload import Outcome


def read_ledger(data_dir: Path) -> list[dict[str, Any]]:
    from gateway.metering import SQLITE_FILE_NAME

    with sqlite3.connect(data_dir / SQLITE_FILE_NAME) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(row) for row in conn.execute(
            "SELECT request_id, project, prompt_tokens, cached_tokens, completion_tokens, status "
            "FROM usage")]


def record_totals(records: list[dict[str, Any]]) -> dict[str, tuple[int, int, int]]:
    totals: dict[str, tuple[int, int, int]] = {}
    for r in records:
        p, c, o = totals.get(r["project"], (0, 0, 0))
        totals[r["project"]] = (p + r["prompt_tokens"], c + r["cached_tokens"],
                                o + r["completion_tokens"])
    return totals


def aigw_usage_totals(data_dir: Path, projects: list[str], env: dict[str, str]
                ) -> dict[str, tuple[int, int, int]]:
    """`aigw usage --project P --group-by model` summed, per project."""
    totals = {}
    for project in projects:
        out = subprocess.run([sys.executable, "-m", "cli.main", "usage", "--project", project,
                              "--group-by", "model"], env={**env, "AIGW_DATA_DIR": str(data_dir)},
                             capture_output=True, text=True, check=True, timeout=120).stdout
        rows = json.loads(out)["data"]
        totals[project] = (sum(r["prompt_tokens"] for r in rows),
                           sum(r["cached_tokens"] for r in rows),
                           sum(r["completion_tokens"] for r in rows))
    return {p: t for p, t in totals.items() if t != (0, 0, 0)}


def compare(outcomes: list[Outcome], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Request by request: the records whose id starts with `soak-<i>/` (or is it) against what
    client i received."""
    by_request: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_request.setdefault(record["request_id"].split("/", 1)[0], []).append(record)
    problems: list[str] = []
    counts: Counter[str] = Counter()
    for outcome in outcomes:
        found = by_request.get(outcome.request_id, [])
        if outcome.usage is not None:
            counts["answered"] += 1
            got = [(r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"], r["status"])
                   for r in found]
            if got != [(*outcome.usage, outcome.status)]:
                problems.append(f"{outcome.request_id} ({outcome.kind}): client {outcome.usage}, "
                                f"ledger {got}")
        elif outcome.kind == "abort" and outcome.status == 200:
            counts["aborted"] += 1  # 499; 200 when the whole answer was out before the hang-up
            if len(found) != 1 or found[0]["status"] not in (200, 499):
                problems.append(f"{outcome.request_id} (aborted): ledger "
                                f"{[(r['status'], r['completion_tokens']) for r in found]}")
        else:
            counts["refused"] += 1
            if any(r["prompt_tokens"] or r["completion_tokens"] for r in found):
                problems.append(f"{outcome.request_id} ({outcome.kind}, {outcome.status}): "
                                f"billed {found}")
    return {"mismatches": len(problems), "problems": problems[:20], **counts,
            "records": len(records)}
