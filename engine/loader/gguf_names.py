"""GGUF tensor names -> Hugging Face names, from a family's two tables (shared by the GGUF loaders).

    token_embd.weight          -> top["token_embd.weight"]
    blk.<i>.<module>.<kind>    -> model.layers.<i>.<modules[module]>.<kind>   (kind in `kinds`)
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(\w+)")


def hf_name_from_tables(gguf_name: str, top: Mapping[str, str], modules: Mapping[str, str],
                        kinds: Collection[str] = ("weight", "bias")) -> str:
    """The HF name of `gguf_name` by the tables; KeyError naming it for a tensor they lack."""
    if gguf_name in top:
        return top[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in modules or match.group(3) not in kinds:
        raise KeyError(f"unknown GGUF tensor {gguf_name!r}")
    layer, module, kind = match.groups()
    return f"model.layers.{layer}.{modules[module]}.{kind}"
