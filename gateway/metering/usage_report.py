"""Usage read back per project: rows grouped by model and/or day, rendered as JSON or CSV."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import date

from gateway.metering.prices import NANOS_PER_USD

GROUP_FIELDS = ("day", "model")
CSV_COLUMNS = ("day", "model", "requests", "prompt_tokens", "cached_tokens", "completion_tokens",
               "total_tokens", "cost_usd")


@dataclass(frozen=True)
class UsageRow:
    day: str | None  # UTC "YYYY-MM-DD"; None when not grouped by day
    model: str | None  # None when not grouped by model
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_nanos: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cost_usd(self) -> float:
        return self.cost_nanos / NANOS_PER_USD

    def to_json_dict(self) -> dict[str, object]:
        data = asdict(self)
        data.pop("cost_nanos")
        data.update(total_tokens=self.total_tokens, cost_usd=self.cost_usd)
        return data


def validate_group_by(group_by: Sequence[str]) -> tuple[str, ...]:
    unknown = set(group_by) - set(GROUP_FIELDS)
    if unknown:
        raise ValueError(f"group_by must be a subset of {GROUP_FIELDS}, not {sorted(unknown)}")
    return tuple(f for f in GROUP_FIELDS if f in group_by)


def validate_day(value: str | None, name: str) -> str | None:
    """`since`/`until` must be UTC days "YYYY-MM-DD" (compared as strings, so a typo would
    silently select nothing); ValueError names the parameter otherwise."""
    if value is None:
        return None
    try:
        if date.fromisoformat(value).isoformat() == value:
            return value
    except ValueError:
        pass
    raise ValueError(f"{name} must be a day as YYYY-MM-DD, not {value!r}")


def in_range(day: str, since: str | None, until: str | None) -> bool:
    """Days compare as ISO strings; since and until are inclusive."""
    return (since is None or day >= since) and (until is None or day <= until)


def group_rows(base_rows: Iterable[UsageRow], group_by: Sequence[str]) -> list[UsageRow]:
    """Sum per-(day, model) rows into the requested grouping, sorted by day then model."""
    fields = validate_group_by(group_by)
    sums: dict[tuple[str | None, str | None], list[int]] = {}
    for row in base_rows:
        key = (row.day if "day" in fields else None, row.model if "model" in fields else None)
        acc = sums.setdefault(key, [0, 0, 0, 0, 0])
        for i, value in enumerate((row.requests, row.prompt_tokens, row.cached_tokens,
                                   row.completion_tokens, row.cost_nanos)):
            acc[i] += value
    return [UsageRow(day, model, *acc)
            for (day, model), acc in sorted(sums.items(), key=lambda kv: (kv[0][0] or "",
                                                                            kv[0][1] or ""))]


def render_json(project: str, rows: Sequence[UsageRow]) -> str:
    return json.dumps({"project": project, "data": [row.to_json_dict() for row in rows]})


def render_csv(rows: Sequence[UsageRow]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        data = row.to_json_dict()
        writer.writerow(["" if data[c] is None else data[c] for c in CSV_COLUMNS])
    return out.getvalue()
