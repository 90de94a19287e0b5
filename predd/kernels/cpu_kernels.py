"""predd's own CPU kernels: `kernels()`, the library built for this machine
(predd/kernels/build.py), loaded and typed (library.py, bindings.py) and checked against
torch (probes.py), once per process; and `CpuOps`, a layer's small ops on it.

torch's CPU ops cannot read K and V where they lie in the paged pool: attention over a
page table costs a gather (a copy of every entry, each layer, each step) before its
matmuls. `paged_attention` (csrc/paged_attention.c) reads them in place. And at decode's
few rows a step, a layer's small ops (RMSNorm, RoPE, SwiGLU's product: some twenty torch
ops a layer) cost more in dispatch than in arithmetic; csrc/layer_ops.c does each in one
pass (`CpuOps`, the same interface as predd.model.llama.TorchOps). csrc/quant_linear.c,
quant_tiles.c, quant_lanes.c and quant_int8.c compute decode's projections from a GGUF's
own blocks (predd/model/quant_linear.py), and csrc/greedy.c picks greedy tokens without a
written-out log-softmax (predd/engine/outputs.py). OpenMP in the library is the libgomp
torch already loaded, so it runs on torch's threads (`--threads`). The attention backend
`cpu` (predd/attention/backends.py) uses it, and a runner with that backend gives its
model `CpuOps`.

Where it cannot build or load (no compiler, no OpenMP, a read-only cache and /tmp), its
structs disagree with the bindings, or its probe disagrees with torch, `problem()` says
why and predd keeps the torch backend.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from predd.kernels import build, probes
from predd.kernels.library import Kernels

ROTARY_ROWS = 16384     # positions whose RoPE angles CpuOps.rotary_at looks up (4 MB at
ROTARY_PIECE = 256      # head_dim 64), made this many at a time
@functools.cache
def kernels() -> Kernels:
    """The library, built (or found in the cache), loaded and probed; build.KernelUnavailable
    with the reason where it cannot run here. Built once per process."""
    lib = Kernels(build.build())
    error = probes.probe(lib, CpuOps)
    if error > probes.PROBE_TOLERANCE:
        raise build.KernelUnavailable(f"its probe differs from torch by {error:.2g}")
    return lib


def problem() -> str | None:
    """Why the kernels cannot run here, or None."""
    try:
        kernels()
    except build.KernelUnavailable as exc:
        return str(exc)
    return None


class CpuOps:
    """predd.model.llama.TorchOps in one kernel call each: the residual add and RMSNorm
    together, RoPE in place on q and k, silu and the product together."""

    def __init__(self, lib: Kernels) -> None:
        self.lib = lib
        self._rows: tuple[torch.Tensor, np.ndarray | None] | None = None   # embed
        self._table: tuple[torch.Tensor, np.ndarray, np.ndarray] | None = None   # rotary_at

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """As TorchOps.add_norm, but x takes delta in place (x is the model's own
        residual stream, made by the embedding lookup)."""
        return x, self.lib.add_rms_norm(x, delta, norm.weight, norm.eps)

    def rotary(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return freqs.cos().contiguous(), freqs.sin().contiguous()     # [T, D/2] each

    # A step's few torch ops around the C layers cost several times what they cost
    # alone: the embedding and RoPE's angles are looked up in numpy instead (measured:
    # docs/kernels.md, "Embedding and RoPE angles looked up in numpy").

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """TorchOps.embed by a numpy lookup: the rows themselves, a new tensor."""
        at = ids.numpy()
        if self._rows is None or self._rows[0] is not weight:
            ints = {2: torch.int16, 4: torch.int32}.get(weight.element_size())
            self._rows = (weight, None if ints is None or not weight.is_contiguous()
                          else weight.detach().view(ints).numpy())
        rows = self._rows[1]
        if rows is None or (at.size and (at.min() < 0 or at.max() >= len(rows))):
            return torch.nn.functional.embedding(ids, weight)   # (raises out of range)
        return torch.from_numpy(rows[at]).view(weight.dtype)

    def rotary_at(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """rotary of the positions' angles, looked up below ROTARY_ROWS: the cos and sin
        of those positions made once, by the same float32 ops (the same values)."""
        at = positions.numpy()
        if self._table is None or self._table[0] is not inv_freq:
            freqs = torch.arange(ROTARY_ROWS).float()[:, None] * inv_freq[None, :]
            # in pieces of a step's size: none split over torch's threads (where a split
            # leaves a tail to scalar code, its last bit may differ)
            pieces = [self.rotary(f, dtype) for f in freqs.split(ROTARY_PIECE)]
            self._table = (inv_freq, torch.cat([c for c, _ in pieces]).numpy(),
                           torch.cat([s for _, s in pieces]).numpy())
        _, cos, sin = self._table
        if at.size and (at.max() >= ROTARY_ROWS or at.min() < 0):   # outside the table
            return self.rotary(positions.float()[:, None] * inv_freq[None, :], dtype)
        return torch.from_numpy(cos[at]), torch.from_numpy(sin[at])

    def rope(self, qkv: torch.Tensor, heads: int, rotary: tuple[torch.Tensor, torch.Tensor]
             ) -> torch.Tensor:
        """Turns q and k where they are, in qkv; returns qkv (its first `heads` heads)."""
        self.lib.rope(qkv, heads, *rotary)
        return qkv

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.lib.silu_mul(gate_up)
