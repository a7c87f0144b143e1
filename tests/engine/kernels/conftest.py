"""Kernel tests run the Triton kernels in Triton's CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before triton is first imported (triton.language builds its own @jit
helpers, tl.sum, tl.sigmoid, ..., at import). The kernel modules import triton lazily, so setting
it here is enough, unless a test module collected earlier imported triton already; triton cannot
be re-imported in one process, so then the tests here are skipped with that reason (fix: set
TRITON_INTERPRET=1 in the root tests/conftest.py, or run tests/engine/kernels on its own).
"""

import os
import sys

import pytest
import torch

ON_CPU = not torch.cuda.is_available()
TRITON_IMPORTED_EARLY = ON_CPU and "triton" in sys.modules
if ON_CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(2)


def _interpreter_broken() -> bool:
    if not TRITON_IMPORTED_EARLY:
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(tl.sum, InterpretedFunction)


def pytest_collection_modifyitems(config, items):
    if not _interpreter_broken():
        return
    skip = pytest.mark.skip(reason="triton was imported before TRITON_INTERPRET=1 was set; "
                                   "run tests/engine/kernels alone or set it in tests/conftest.py")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
