"""Which build of the native CPU kernels (decode_ops.cpp) this process runs: chosen once, at start-up.

    selection() -> IsaSelection    # read /proc/cpuinfo's flags once; AIGW_CPU_ISA forces a variant

Variants, best first (each needs every flag of its row; decode_ops.cpp is one source, compiled once
per variant with that variant's flags and cached under TORCH_EXTENSIONS_DIR):

    avx512_vnni  AVX-512 (F, BW, VL, DQ) + VNNI: the Q4/Q8 block dot products in vpdpbusd
    avx_vnni     AVX2 + AVX-VNNI (the 256-bit vpdpbusd of Alder Lake and Zen 5 without AVX-512)
    avx512       AVX-512 (F, BW, VL, DQ): the compiler's loops 512 bits wide, the dot products AVX2's
    avx2         AVX2 + FMA + F16C: maddubs / madd dot products (the reference variant)

Every variant computes the same integers in the same order (vpdpbusd sums the four u8 x s8 products
that maddubs + madd sum, without saturation, which the AVX2 kernels never reach), so their outputs
agree bit for bit; a machine with the faster variant checks that by forcing `AIGW_CPU_ISA=avx2`.
`AIGW_CPU_ISA` names a variant (`avx2`, `avx512`, `avx_vnni`, `avx512_vnni`) or `native` (the
default: the best the CPU has); a variant the CPU lacks, or an unknown name, is a ValueError at
start-up. The CPU's other features (AVX512-BF16, AMX) are reported too: the float32 path's GEMMs run
in oneDNN, which dispatches on them itself.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

ENV = "AIGW_CPU_ISA"

# variant -> (CPU flags it needs, compiler flags, preprocessor defines), best first
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "avx512_vnni": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
                    ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                     "-mavx512vnni"), ("DECODE_OPS_VNNI",)),
    "avx_vnni": (("avx2", "fma", "f16c", "avx_vnni"), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
                 ("DECODE_OPS_VNNI",)),
    "avx512": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
               ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"), ()),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), ()),
}
# reported beside the variant (what the CPU has), in this order
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
            "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


@dataclass(frozen=True)
class IsaSelection:
    """The kernel variant this process uses (None: the CPU has none of them, the PyTorch paths run),
    whether AIGW_CPU_ISA forced it, the best variant the CPU has, and its features."""

    variant: str | None
    forced: bool
    native: str | None
    features: tuple[str, ...]

    def describe(self) -> str:
        chosen = self.variant or "none (PyTorch paths)"
        how = f"forced by {ENV}, native {self.native}" if self.forced else "native"
        return f"CPU kernels {chosen} ({how}; CPU features: {' '.join(self.features) or 'none'})"

    def as_dict(self) -> dict[str, object]:
        return {"isa": self.variant, "forced": self.forced, "native_isa": self.native,
                "features": list(self.features)}


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of /proc/cpuinfo's first processor (empty where there is none: not Linux x86)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def best_variant(flags: frozenset[str]) -> str | None:
    return next((name for name, (needs, _, _) in VARIANTS.items() if set(needs) <= flags), None)


def select(flags: frozenset[str], forced: str | None) -> IsaSelection:
    """The variant for a CPU with `flags` when AIGW_CPU_ISA is `forced` (None or "native": the best)."""
    native = best_variant(flags)
    features = tuple(f for f in FEATURES if f in flags)
    name = (forced or "").strip().lower()
    if name in ("", "native"):
        return IsaSelection(native, False, native, features)
    if name not in VARIANTS:
        raise ValueError(f"{ENV}={forced!r}: unknown (native, {', '.join(reversed(VARIANTS))})")
    missing = [f for f in VARIANTS[name][0] if f not in flags]
    if missing:
        raise ValueError(f"{ENV}={name}: this CPU lacks {', '.join(missing)} (it has {native or 'none'})")
    return IsaSelection(name, True, native, features)


@functools.cache
def selection() -> IsaSelection:
    """This process's choice: the CPU's flags and AIGW_CPU_ISA, read once."""
    return select(cpu_flags(), os.environ.get(ENV))
