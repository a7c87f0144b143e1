"""The native CPU kernels' build lock (engine/kernels/cpu/build_lock.py): a build killed midway
left cpp_extension's `lock` file behind and every later replica start waited on it forever; an
flock, dropped by the kernel with its process, now serializes the builds and clears that file."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from engine.kernels.cpu.build_lock import FLOCK, TORCH_LOCK, build_lock

_HOLDER = """
import fcntl, sys, time
from pathlib import Path
build = Path(sys.argv[1])
handle = open(build / "aigw.flock", "a")
fcntl.flock(handle, fcntl.LOCK_EX)
(build / "lock").touch()  # cpp_extension's baton, as a build in progress holds it
print("building", flush=True)
time.sleep(120)
"""


def test_a_lock_file_a_killed_build_left_is_removed(tmp_path: Path) -> None:
    (tmp_path / TORCH_LOCK).touch()
    with build_lock(tmp_path):
        assert not (tmp_path / TORCH_LOCK).exists()
        assert (tmp_path / FLOCK).exists()


def test_a_start_waits_for_a_live_build_then_goes_on_once_its_process_is_killed(
        tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    entered = threading.Event()
    seen_lock: list[bool] = []

    def start() -> None:
        with build_lock(tmp_path):
            seen_lock.append((tmp_path / TORCH_LOCK).exists())
            entered.set()

    try:
        assert holder.stdout is not None and holder.stdout.readline() == "building\n"
        waiter = threading.Thread(target=start)
        waiter.start()
        assert not entered.wait(0.5)  # the live build's lock is respected
        holder.kill()  # killed mid-build: its `lock` file stays, its flock goes with it
        holder.wait()
        assert entered.wait(10)
        waiter.join()
        assert seen_lock == [False]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
