"""Stopping the processes tests start: SIGTERM, then SIGKILL if it does not exit in time."""

from __future__ import annotations

import subprocess


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
