"""Which float type the model runs in: the machine decides (`--dtype auto`).

bfloat16 halves memory traffic, but only where the hardware computes it: on an
AVX2-only CPU torch emulates bf16 matmuls (measured ~0.3 GFLOPS against ~150 in
float32), so there `auto` means float32. A CUDA device gets bf16 when it supports it.
"""
from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo has none, e.g. not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve(requested: str, device: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(dtype name, why) for `--dtype requested` on `device`."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {requested!r}")
        return requested, "asked for"
    if device.startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: the GPU supports bf16"
        return "float32", "auto: the GPU lacks bf16"
    flags = cpu_flags() if flags is None else flags
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if native:
        return "bfloat16", f"auto: the CPU computes bf16 natively ({', '.join(native)})"
    return "float32", ("auto: the CPU has no avx512_bf16/amx_bf16, so bf16 would be "
                       "emulated; float32 is faster")
