"""Fixtures for model tests: the default model's checkpoint (SmolLM2-135M GGUF), read once per
session."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.models._deepseek_v3 import deepseek_v3_checkpoints  # noqa: F401 (session fixture)
from tests.engine.models._gemma3 import gemma3_checkpoint  # noqa: F401 (a session fixture)
from tests.engine.models._gpt_oss import gpt_oss_checkpoints  # noqa: F401 (a session fixture)
from tests.engine.models._llama4 import llama4_checkpoints  # noqa: F401 (a session fixture)
from tests.engine.models._qwen3 import qwen3_checkpoints  # noqa: F401 (a session fixture)


@pytest.fixture(scope="session")
def default_checkpoint(checkpoint: Any) -> Any:
    """The default model in float32: the engine tests' session checkpoint (tests/engine/conftest.py,
    read only), not a second copy of its ~540 MB."""
    return checkpoint


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)
