"""Keeping embedded replicas up: a thread in `aigw serve`'s main process restarts a replica whose
process exited (a crash, the OOM killer, SIGKILL) on the same port, so the gateway's endpoint
for it stays valid and the health checker takes it back in once it answers /health again.

    supervisor = ReplicaSupervisor(replicas, SupervisorSettings(), restarts_file)
    supervisor.start()
    ...
    supervisor.stop()          # before stopping the replicas: a stopped replica is not restarted

Backoff: the n-th restart in a row of one replica waits min(initial_backoff_s * 2**(n-1),
max_backoff_s) after its exit is seen; once a restarted replica has stayed up for
`reset_after_s`, its next exit waits initial_backoff_s again. Every restart is one log line
(`embedded replica <url> exited with <code>; restart <n> in <wait>s`) and counted: the counts,
{url: n}, are written (atomically) to `restarts_file`, which each gateway worker, another process
with `--workers N`, reads when scraped (`RestartsCollector`: aigw_embedded_replica_restarts_total).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.fleet.embedded import ReplicaProcess

log = logging.getLogger("aigw.gateway.supervisor")

RESTARTS_FILE_ENV = "AIGW_EMBEDDED_RESTARTS_FILE"  # set by `aigw serve` for its workers


@dataclass(frozen=True)
class SupervisorSettings:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    reset_after_s: float = 60.0  # up this long: the backoff starts over
    poll_interval_s: float = 0.25

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 < initial_backoff_s <= max_backoff_s")
        if self.reset_after_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("reset_after_s and poll_interval_s must be positive")

    def backoff_s(self, num_restarts_in_a_row: int) -> float:
        """The wait before restart number `num_restarts_in_a_row` (1-based) of a streak."""
        return min(self.initial_backoff_s * 2.0 ** (num_restarts_in_a_row - 1), self.max_backoff_s)


@dataclass
class _Watch:
    replica: ReplicaProcess
    started_at_s: float
    num_in_a_row: int = 0
    restart_at_s: float | None = None  # set once its exit is seen


class ReplicaSupervisor:
    """Owns restarting; `num_restarts` (url -> count) is read by tests and the restarts file."""

    def __init__(self, replicas: Sequence[ReplicaProcess], settings: SupervisorSettings,
                 restarts_file: Path | None = None) -> None:
        now = time.monotonic()
        self.settings = settings
        self.restarts_file = restarts_file
        self.num_restarts = {replica.url: 0 for replica in replicas}
        self._watches = [_Watch(replica, now) for replica in replicas if replica.command]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-supervisor", daemon=True)
        self._write_restarts()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop supervising (no restart starts after this returns)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.settings.poll_interval_s):
            for watch in self._watches:
                try:
                    self._check(watch, time.monotonic())
                except OSError:  # the restart itself failed: try again after the next backoff
                    log.exception("restarting embedded replica %s failed", watch.replica.url)
                    watch.restart_at_s = time.monotonic() + self.settings.max_backoff_s

    def _check(self, watch: _Watch, now: float) -> None:
        returncode = watch.replica.process.poll()
        if returncode is None:
            return
        if watch.restart_at_s is None:  # its exit, seen for the first time
            if now - watch.started_at_s >= self.settings.reset_after_s:
                watch.num_in_a_row = 0
            watch.num_in_a_row += 1
            wait_s = self.settings.backoff_s(watch.num_in_a_row)
            watch.restart_at_s = now + wait_s
            log.warning("embedded replica %s exited with %s; restart %d in %gs",
                        watch.replica.url, returncode, self.num_restarts[watch.replica.url] + 1,
                        wait_s)
            return
        if now < watch.restart_at_s:
            return
        watch.replica.restart()
        watch.started_at_s, watch.restart_at_s = now, None
        self.num_restarts[watch.replica.url] += 1
        self._write_restarts()

    def _write_restarts(self) -> None:
        if self.restarts_file is None:
            return
        partial = self.restarts_file.with_suffix(".tmp")
        partial.write_text(json.dumps(self.num_restarts))
        os.replace(partial, self.restarts_file)  # a reader sees the old or the new, never half


class RestartsCollector(Collector):
    """aigw_embedded_replica_restarts_total{endpoint}, read from the supervisor's file at scrape
    time (no samples without embedded replicas: no file, or one that cannot be read)."""

    def __init__(self, restarts_file: Path | None) -> None:
        self.restarts_file = restarts_file

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("aigw_embedded_replica_restarts",
                                     "Restarts of an embedded replica after its process exited.",
                                     labels=["endpoint"])
        for url, count in self._counts().items():
            family.add_metric([str(url).split("://", 1)[-1]], float(count))
        yield family

    def _counts(self) -> dict[str, int]:
        if self.restarts_file is None:
            return {}
        try:
            counts = json.loads(self.restarts_file.read_text())
        except (OSError, ValueError):
            return {}
        return counts if isinstance(counts, dict) else {}


def restarts_collector_from_env() -> RestartsCollector:
    path = os.environ.get(RESTARTS_FILE_ENV)
    return RestartsCollector(Path(path) if path else None)
