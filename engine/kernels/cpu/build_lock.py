"""One native-kernel build at a time per build directory, and no start that waits forever on a
build that was killed.

torch.utils.cpp_extension guards a build with a plain `lock` file in the build directory that
its builder deletes when done; a builder killed midway (SIGKILL, the OOM killer, a SIGTERM to a
replica on its first start) leaves it behind, and every later `load()` of that extension then
polls for it to go away, forever: a replica (and `aigw serve` waiting on it) hangs at start with
nothing in its log. `build_lock(build_dir)` holds an flock on `<build_dir>/aigw.flock` across the
build instead; the kernel drops an flock with its process, so while it is held no other
process of ours is building there, and a `lock` file found then is stale and removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

TORCH_LOCK = "lock"  # cpp_extension's FileBaton, in the build directory
FLOCK = "aigw.flock"


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold `<build_dir>/aigw.flock` exclusively (waiting, with one log line, while another
    process holds it); inside, cpp_extension's `lock` left by a killed build is gone."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / FLOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process's build of the native CPU kernels in %s",
                        build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / TORCH_LOCK
            if stale.exists():
                logger.warning("removing %s, left by a build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
