"""Which build of the native CPU kernels (decode_ops.cpp) this process runs: chosen once, at
start-up.

    selection() -> IsaSelection    # read /proc/cpuinfo's flags once; AIGW_CPU_ISA forces a variant

Variants, best first (each needs every flag of its row; decode_ops.cpp is one source, compiled once
per variant with that variant's flags and cached under TORCH_EXTENSIONS_DIR):

    avx512_vnni  AVX-512 (F, BW, VL, DQ) + VNNI: the Q4/Q8 block dot products in vpdpbusd
    avx_vnni     AVX2 + AVX-VNNI (the 256-bit vpdpbusd of Alder Lake and Zen 5 without AVX-512)
    avx512       AVX-512 (F, BW, VL, DQ): the compiler's loops 512 bits wide, the dot products
                 AVX2's
    avx2         AVX2 + FMA + F16C: maddubs / madd dot products (the reference variant)

Every variant computes the same integers in the same order (vpdpbusd sums the four u8 x s8 products
that maddubs + madd sum, without saturation, which the AVX2 kernels never reach), so their outputs
agree bit for bit; a machine with the faster variant checks that by forcing `AIGW_CPU_ISA=avx2`.
A variant is chosen only when /proc/cpuinfo lists every flag of its row and PyTorch's cpuinfo
(which reads XCR0: the OS saves the YMM / ZMM / tile state) agrees, so neither the CPU nor the OS
can lack what the loaded build executes.

Prefill in bfloat16 (the q4 mode's prompt chunks, engine/models/llama_prefill.py), best first:

    amx_bf16     AMX-BF16 tiles: oneDNN's bf16 GEMMs on AMX
    avx512_bf16  AVX512-BF16 (vdpbf16ps): the same GEMMs on AVX-512 without AMX

where the CPU has one, prompt rows run their linears as bf16 GEMMs (float32 accumulation) over
weights dequantized into a bounded scratch, attention on the native kernel; decode rows stay on the
integer kernels; without either, prompt rows take the integer kernels too.

`AIGW_CPU_ISA` is `native` (the default: the best variant and the best bf16 prefill the CPU has),
a variant name (`avx2`, `avx512`, `avx_vnni`, `avx512_vnni`: that build, integer prefill; a variant
the CPU lacks is a ValueError at start-up), or a bf16 prefill name (`amx_bf16`, `avx512_bf16`: the
best variant plus that prefill). A bf16 name is accepted on a CPU without it: the bf16 GEMMs are
PyTorch's, which dispatch on what the CPU has (without BF16 hardware they are correct and slow),
so tests run that path anywhere; `avx512_bf16` on an AMX CPU also caps oneDNN below AMX
(ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, unless set) so the two bf16 paths can be compared. An unknown
name is a ValueError.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

ENV = "AIGW_CPU_ISA"

# variant -> (CPU flags it needs, compiler flags, preprocessor defines), best first
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "avx512_vnni": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                     "avx512_vnni"),
                    ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                     "-mavx512dq", "-mavx512vnni"), ("DECODE_OPS_VNNI",)),
    "avx_vnni": (("avx2", "fma", "f16c", "avx_vnni"), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
                 ("DECODE_OPS_VNNI",)),
    "avx512": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
               ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
               ()),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), ()),
}
# bf16 prefill ISA -> the CPU flags it needs, best first
PREFILL_ISAS: dict[str, tuple[str, ...]] = {
    "amx_bf16": ("amx_bf16", "amx_tile"),
    "avx512_bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
}
# PyTorch's cpuinfo names (torch._C._cpu._get_cpu_capability(), OS support checked) -> /proc names
_CPUINFO_NAMES = {"avx2": "avx2", "fma3": "fma", "f16c": "f16c", "avx512_f": "avx512f",
                  "avx512_bw": "avx512bw", "avx512_vl": "avx512vl", "avx512_dq": "avx512dq",
                  "avx512_vnni": "avx512_vnni", "avx_vnni": "avx_vnni",
                  "avx512_bf16": "avx512_bf16",
                  "amx_bf16": "amx_bf16", "amx_tile": "amx_tile", "amx_int8": "amx_int8"}
# reported beside the variant (what the CPU has), in this order
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
            "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


@dataclass(frozen=True)
class IsaSelection:
    """The kernel variant this process uses (None: the CPU has none of them, the PyTorch paths run),
    whether AIGW_CPU_ISA forced it, the best variant the CPU has, its features, and the bf16
    prefill ISA (None: prompt rows on the integer kernels; `prefill_emulated`: forced on a CPU
    without it, so PyTorch computes the bf16 GEMMs without BF16 hardware)."""

    variant: str | None
    forced: bool
    native: str | None
    features: tuple[str, ...]
    prefill: str | None = None
    prefill_emulated: bool = False

    def describe(self) -> str:
        chosen = self.variant or "none (PyTorch paths)"
        how = f"forced by {ENV}, native {self.native}" if self.forced else "native"
        prefill = "integer kernels" if self.prefill is None else f"bf16 {self.prefill}"
        if self.prefill_emulated:
            prefill += " (this CPU lacks it: PyTorch's bf16 without BF16 hardware, slow)"
        return (f"CPU kernels {chosen} ({how}); prefill {prefill}; "
                f"CPU features: {' '.join(self.features) or 'none'}")

    def as_dict(self) -> dict[str, object]:
        return {"isa": self.variant, "forced": self.forced, "native_isa": self.native,
                "features": list(self.features), "prefill_isa": self.prefill}


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


def os_enabled_flags() -> frozenset[str] | None:
    """The features PyTorch's cpuinfo finds usable, in /proc names: it checks CPUID and XCR0 (the
    OS saves YMM / opmask / ZMM / tile state). None when this PyTorch does not say (then the
    kernel's /proc flags alone decide: Linux clears a flag whose XSAVE state it does not enable)."""
    try:
        import torch

        capability = torch._C._cpu._get_cpu_capability()
    except (ImportError, AttributeError, RuntimeError):
        return None
    return frozenset(name for key, name in _CPUINFO_NAMES.items() if capability.get(key) is True)


def best_variant(flags: frozenset[str]) -> str | None:
    return next((name for name, (needs, _, _) in VARIANTS.items() if set(needs) <= flags), None)


def best_prefill(flags: frozenset[str]) -> str | None:
    return next((name for name, needs in PREFILL_ISAS.items() if set(needs) <= flags), None)


def select(flags: frozenset[str], forced: str | None, os_flags: frozenset[str] | None = None
           ) -> IsaSelection:
    """The choice for a CPU with `flags` (/proc/cpuinfo's; `os_flags`: what the OS enables, None:
    all of them) when AIGW_CPU_ISA is `forced` (None or "native": the best)."""
    usable = flags if os_flags is None else flags & os_flags
    native = best_variant(usable)
    features = tuple(f for f in FEATURES if f in usable)
    name = (forced or "").strip().lower()
    if name in ("", "native"):
        return IsaSelection(native, False, native, features,
                            best_prefill(usable) if native else None)
    if name in PREFILL_ISAS:
        if native is None:
            raise ValueError(f"{ENV}={name}: bf16 prefill runs beside the native kernels, and this "
                             f"CPU has none of their variants (AVX2 + FMA + F16C at least)")
        emulated = not set(PREFILL_ISAS[name]) <= usable
        return IsaSelection(native, True, native, features, name, emulated)
    if name not in VARIANTS:
        names = ", ".join([*reversed(VARIANTS), *reversed(PREFILL_ISAS)])
        raise ValueError(f"{ENV}={forced!r}: unknown (native, {names})")
    missing = [f for f in VARIANTS[name][0] if f not in usable]
    if missing:
        lacks = ", ".join(missing)
        raise ValueError(f"{ENV}={name}: this CPU (or its OS) lacks {lacks} (it has "
                         f"{native or 'none'})")
    return IsaSelection(name, True, native, features)


@functools.cache
def selection() -> IsaSelection:
    """This process's choice: the CPU's flags, what the OS enables, and AIGW_CPU_ISA, read once.
    Forcing avx512_bf16 on an AMX CPU caps oneDNN at AVX512_CORE_BF16 (before its first use)."""
    chosen = select(cpu_flags(), os.environ.get(ENV), os_enabled_flags())
    cap = onednn_cap(chosen)
    if cap is not None:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", cap)
    return chosen


def onednn_cap(chosen: IsaSelection) -> str | None:
    """The ONEDNN_MAX_CPU_ISA a choice needs: AVX512_CORE_BF16 when avx512_bf16 is forced on a CPU
    with AMX (oneDNN would take AMX for bf16 otherwise), else None (oneDNN takes the best)."""
    if chosen.forced and chosen.prefill == "avx512_bf16" and "amx_bf16" in chosen.features:
        return "AVX512_CORE_BF16"
    return None
