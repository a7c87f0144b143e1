"""The soak's memory check: is each process's RSS flat once warm?

    trend = rss_trend(samples, process="replica", warmup_fraction=0.2)
    trend.ratio, trend.slope_mib_per_1k, trend.verdict(max_growth=0.05, min_requests=2000)

`samples` are (seconds since the start, requests done, gateway RSS bytes, replica RSS bytes), one
every 2 s. Warm-up ends at the first sample with `warmup_fraction` of the run's requests done (the
caches, the allocator's pools, the kernels for each shape fill there); the RSS there is the
baseline, and the run's last sample is measured against it: `ratio` = end / warm-up, and the
least-squares slope of RSS over the requests after warm-up, in MiB per 1,000 requests. Flat means
ratio <= 1 + max_growth; a run of fewer than `min_requests` requests is not judged (start-up growth
dominates it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

Sample = tuple[float, int, int, int]  # (s since start, requests done, gateway RSS, replica RSS)
PROCESSES = ("gateway", "replica")
_MIB = 1024 * 1024


@dataclass(frozen=True)
class RssTrend:
    process: str
    warmup_requests: int
    warmup_bytes: int
    end_requests: int
    end_bytes: int
    max_bytes: int
    slope_mib_per_1k: float  # after warm-up

    @property
    def ratio(self) -> float:
        return self.end_bytes / self.warmup_bytes

    def verdict(self, max_growth: float, min_requests: int) -> str:
        """"PASS", "FAIL" or "not judged"."""
        if self.end_requests < min_requests:
            return "not judged"
        return "PASS" if self.ratio <= 1.0 + max_growth else "FAIL"


def rss_trend(samples: list[Sample], process: str, warmup_fraction: float) -> RssTrend:
    column = 2 + PROCESSES.index(process)
    end = samples[-1]
    warm = next(s for s in samples if s[1] >= warmup_fraction * end[1])
    after = [s for s in samples if s[1] >= warm[1]]
    return RssTrend(process, warm[1], int(warm[column]), end[1], int(end[column]),
                    int(max(s[column] for s in samples)), _slope_mib_per_1k(after, column))


def _slope_mib_per_1k(samples: list[Sample], column: int) -> float:
    xs = [s[1] / 1000 for s in samples]
    ys = [s[column] / _MIB for s in samples]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


def render_trends(trends: list[RssTrend], max_growth: float, min_requests: int) -> list[str]:
    lines = ["| RSS (MiB) | after warm-up | end | end / warm-up | slope after warm-up "
             "(MiB per 1k requests) | max | flat |", "|---|---|---|---|---|---|---|"]
    for t in trends:
        lines.append(f"| {t.process} | {t.warmup_bytes / _MIB:.1f} (at {t.warmup_requests} "
                     f"requests) | {t.end_bytes / _MIB:.1f} (at {t.end_requests}) | "
                     f"{t.ratio:.3f} | {t.slope_mib_per_1k:+.2f} | {t.max_bytes / _MIB:.1f} | "
                     f"{t.verdict(max_growth, min_requests)} |")
    verdicts = {t.verdict(max_growth, min_requests) for t in trends}
    overall = "FAIL" if "FAIL" in verdicts else ("PASS" if verdicts == {"PASS"} else "not judged")
    lines.append(f"\nmemory flat: {overall} (end <= {1 + max_growth:.2f} x the RSS after warm-up; "
                 f"runs of {min_requests}+ requests are judged)")
    return lines


def plot_rss(samples: list[Sample], trends: list[RssTrend], path: str | Path, title: str) -> Path:
    """RSS of each process over the requests done, with the warm-up point marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(trends), figsize=(6 * len(trends), 4), squeeze=False)
    for ax, trend in zip(axes[0], trends, strict=True):
        column = 2 + PROCESSES.index(trend.process)
        ax.plot([s[1] for s in samples], [s[column] / _MIB for s in samples], label="RSS")
        ax.axvline(trend.warmup_requests, color="grey", linestyle="--", label="end of warm-up")
        ax.axhline(trend.warmup_bytes / _MIB, color="black", linestyle=":", linewidth=1,
                   label=f"after warm-up (end / warm-up {trend.ratio:.3f})")
        ax.set(title=f"{trend.process} RSS", xlabel="requests done", ylabel="MiB")
        ax.legend(loc="lower right")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return Path(path)
