"""Usage read back per project: rows grouped, rendered as JSON or CSV.

Grouping by day and/or model reads the per-day sums (`group_rows`); by hour, key, tag or session
it reads the per-request records of the range (`group_records`). A request with several tags is
counted once under each of them (so rows grouped by tag sum to the ledger only when each request
has at most one tag); one without a tag or session falls under null.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import date

from gateway.metering.contract import UsageRecord
from gateway.metering.prices import NANOS_PER_USD

GROUP_FIELDS = ("day", "hour", "model", "key", "tag", "session")
DAILY_FIELDS = frozenset({"day", "model"})  # what the per-day sums can answer
# a group field -> the UsageRow attribute (and JSON/CSV name) holding it
_ROW_FIELD = {"day": "day", "hour": "hour", "model": "model", "key": "key_id", "tag": "tag",
              "session": "session_id"}
METRIC_COLUMNS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens",
                  "total_tokens", "cost_usd")
CSV_COLUMNS = ("day", "model", *METRIC_COLUMNS)


@dataclass(frozen=True)
class UsageRow:
    day: str | None  # UTC "YYYY-MM-DD"; None when not grouped by day
    model: str | None  # None when not grouped by model
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_nanos: int
    hour: str | None = None  # UTC "YYYY-MM-DDTHH" when grouped by hour
    key_id: str | None = None
    tag: str | None = None
    session_id: str | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cost_usd(self) -> float:
        return self.cost_nanos / NANOS_PER_USD

    def to_json_dict(self, group_by: Sequence[str] = ()) -> dict[str, object]:
        """day and model always (null when not grouped by them), the other group fields when
        grouped by them, then the sums."""
        data = asdict(self)
        data.pop("cost_nanos")
        for name in ("hour", "key", "tag", "session"):
            if name not in group_by:
                data.pop(_ROW_FIELD[name])
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
    return [UsageRow(day, model, acc[0], acc[1], acc[2], acc[3], acc[4])
            for (day, model), acc in sorted(sums.items(), key=lambda kv: (kv[0][0] or "",
                                                                            kv[0][1] or ""))]


def group_records(records: Iterable[UsageRecord], group_by: Sequence[str]) -> list[UsageRow]:
    """Sum per-request records into the requested grouping (any of GROUP_FIELDS), sorted."""
    fields = validate_group_by(group_by)
    sums: dict[tuple[str | None, ...], list[int]] = {}
    for record in records:
        day = usage_day_of(record.created_at)
        base = {"day": day, "hour": time.strftime("%Y-%m-%dT%H", time.gmtime(record.created_at)),
                "model": record.model, "key": record.key_id, "session": record.session_id}
        for tag in (record.tags or (None,)) if "tag" in fields else (None,):
            key = tuple(tag if f == "tag" else base[f] for f in GROUP_FIELDS if f in fields)
            acc = sums.setdefault(key, [0, 0, 0, 0, 0])
            acc[0] += 1
            acc[1] += record.prompt_tokens
            acc[2] += record.cached_tokens
            acc[3] += record.completion_tokens
            acc[4] += round(record.cost_usd * NANOS_PER_USD)
    rows = []
    for key, acc in sorted(sums.items(), key=lambda kv: tuple(v or "" for v in kv[0])):
        named = dict(zip((_ROW_FIELD[f] for f in GROUP_FIELDS if f in fields), key, strict=True))
        day_value, model_value = named.pop("day", None), named.pop("model", None)
        rows.append(UsageRow(day_value, model_value, acc[0], acc[1], acc[2], acc[3], acc[4],
                             hour=named.get("hour"), key_id=named.get("key_id"),
                             tag=named.get("tag"), session_id=named.get("session_id")))
    return rows


def usage_day_of(created_at: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(created_at))


def render_json(project: str, rows: Sequence[UsageRow], group_by: Sequence[str] = ()) -> str:
    return json.dumps({"project": project, "data": [row.to_json_dict(group_by) for row in rows]})


def csv_columns(group_by: Sequence[str] = ()) -> tuple[str, ...]:
    extra = tuple(_ROW_FIELD[f] for f in ("hour", "key", "tag", "session") if f in group_by)
    return ("day", "model", *extra, *METRIC_COLUMNS)


def render_csv(rows: Sequence[UsageRow], group_by: Sequence[str] = ()) -> str:
    columns = csv_columns(group_by)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        data = row.to_json_dict(group_by)
        writer.writerow([_cell(data[c]) for c in columns])
    return out.getvalue()


_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: object) -> object:
    """A CSV cell; a text one that a spreadsheet would run as a formula (a client's tag or
    session "=HYPERLINK(...)") gets a leading apostrophe, as OWASP advises for CSV exports."""
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(_FORMULA_STARTS):
        return "'" + value
    return value
