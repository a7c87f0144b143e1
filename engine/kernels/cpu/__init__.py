"""Native CPU decode kernels (decode_ops.cpp), compiled on first use and cached by PyTorch.

    load() -> True when torch.ops.aigw_cpu.* are registered (AVX2/FMA/F16C CPU and a C++ compiler);
              False otherwise, once, with the reason logged. Callers then keep the PyTorch path.

The build is the variant engine/kernels/cpu/isa.py selects for this CPU (avx2, avx512, avx_vnni,
avx512_vnni; `AIGW_CPU_ISA` forces one), one extension per variant and version of the source
(`_build_name`): a process loads one of them, chosen once and logged.

at::parallel_for is OpenMP in PyTorch's CPU builds, so the extension is compiled with -fopenmp (it
then shares the libgomp.so.1 that torch has loaded, and torch.set_num_threads applies to it). The
build takes ~20 s the first time (then it is cached under TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions). `AIGW_NATIVE_KERNELS=0` turns the native kernels off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sysconfig
from pathlib import Path

import torch

from engine.kernels.cpu import isa

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("decode_ops.cpp")
_REQUIRED_FLAGS = ("avx2", "fma", "f16c")
WEIGHT_TYPES = {"Q8_0x8": 1, "Q4_1x8": 2}  # the kernel's weight layouts (see decode_ops.cpp)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the `ninja` wheel (a dependency) installs it beside
    this interpreter, which is not on PATH when the venv is not activated."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and scripts and Path(scripts, "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def _build_name(variant: str, flags: list[str]) -> str:
    """The extension's name (its cache directory): the variant and a digest of the source and
    flags, so processes running different versions of the source (an upgrade beside a running
    replica, two checkouts) never rebuild each other's library in one directory."""
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    return f"aigw_cpu_decode_ops_{variant}_{digest}"


def loaded_variant() -> str | None:
    """The kernel variant this process runs (isa.VARIANTS), None when the native kernels are off."""
    return isa.selection().variant if load() else None


@functools.cache
def load() -> bool:
    if os.environ.get("AIGW_NATIVE_KERNELS", "1") == "0":
        return False
    missing = [f for f in _REQUIRED_FLAGS if f not in _cpu_flags()]
    if missing:
        logger.warning("native CPU kernels off: the CPU lacks %s", ", ".join(missing))
        return False
    chosen = isa.selection()  # a ValueError for a bad AIGW_CPU_ISA: the replica refuses to start
    if chosen.variant is None:  # /proc lists AVX2 but the OS does not save the YMM state
        logger.warning("native CPU kernels off: the OS does not enable AVX2 (XCR0)")
        return False
    logger.info("%s", chosen.describe())
    _, cflags, defines = isa.VARIANTS[chosen.variant]
    _put_ninja_on_path()
    try:
        from torch.utils.cpp_extension import load as load_extension

        # -ffp-contract=off: GCC fuses a * b + c into an FMA where it sees fit, and may decide
        # differently for a 512-bit build; unfused, the scalar code rounds the same in every variant
        flags = ["-O3", *cflags, *(f"-D{d}" for d in defines), "-fopenmp", "-ffp-contract=off"]
        from torch.utils.cpp_extension import _get_build_directory

        from engine.kernels.cpu.build_lock import build_lock

        name = _build_name(chosen.variant, flags)
        with build_lock(Path(_get_build_directory(name, False))):  # (a killed build's lock goes)
            load_extension(name=name, sources=[str(_SOURCE)], is_python_module=False,
                           extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: keep the PyTorch path
        logger.warning("native CPU kernels off: the build failed (%s)", exc)
        return False
    ops = ("q_linear", "q_linear_add_", "decode_attention", "dequantize_bf16")
    missing_ops = [op for op in ops if not hasattr(torch.ops.aigw_cpu, op)]
    if missing_ops:  # a stale build in the cache (another checkout's source)
        logger.warning("native CPU kernels off: the build lacks %s", ", ".join(missing_ops))
        return False
    return True
