"""Stopping the processes tests start: SIGTERM, then SIGKILL if it does not exit in time; and
the children a process started (`child_processes`, from Linux /proc)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def child_processes(pid: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of every live child process of `pid`."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"\nPPid:\t{pid}\n" in status:
            children.append((int(entry.name), [a.decode() for a in argv if a]))
    return children
