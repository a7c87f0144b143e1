"""Run a module as `__main__` with every Python function call counted (all threads), for
`aigw bench calls`. SIGUSR1 writes the count so far to the file named by the first argument.

    python bench/call_counter.py COUNT_FILE -m cli.main serve --config ...

Run as a script by path (not imported as `bench.call_counter`), so that it works with another
checkout's tree first on PYTHONPATH (a baseline commit). Counting calls, not seconds: the figure is
the same whatever else the machine is doing, which timed CPU on a shared 2-core VM is not.
"""

from __future__ import annotations

import itertools
import os
import runpy
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

_calls = itertools.count()  # next() is one C call: safe from any thread without a lock


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call":
        next(_calls)


def main() -> None:
    count_file = Path(sys.argv[1])
    if sys.argv[2] != "-m":
        raise SystemExit("usage: call_counter.py COUNT_FILE -m MODULE [ARGS...]")
    module = sys.argv[3]
    sys.path[0] = os.getcwd()  # the checkout being run, not bench/
    sys.argv = [module, *sys.argv[4:]]

    def dump(signum: int, frame: FrameType | None) -> None:
        count_file.write_text(str(next(_calls)))

    signal.signal(signal.SIGUSR1, dump)
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
