"""Projections with their weights packed once for the CPU's GEMM library (oneDNN).

A plain `nn.Linear` on CPU re-lays its weight out for the GEMM kernel on every call;
at decode's few rows per step that repacking is a large part of each projection's time
(measured: docs/kernels.md, "Weights packed once for oneDNN"). `pack_linears` swaps
every `nn.Linear` of a model for a `PackedLinear` holding the weight in oneDNN's blocked
layout, once, after checking on a probe that the packed op runs here and gives the same
result.
Where it cannot (no oneDNN in this torch build, a CUDA device, a dtype oneDNN refuses)
the model keeps its plain projections and the reason is reported.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACK_ROWS = 64          # the row count oneDNN tunes the layout for: a decode step's batch
PROBE_TOLERANCE = 1e-2  # relative: the same sum in a different order, not another result


class PackedLinear(nn.Module):
    """`y = x W^T + b` for x [T, in] with W packed by oneDNN; no autograd (inference)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packing_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why weights cannot be packed here, or None: a probe packs a small random
    projection and compares it with `F.linear`."""
    if device.type != "cpu":
        return f"packing is for the CPU, not {device.type}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    try:
        gen = torch.Generator().manual_seed(0)
        probe = nn.Linear(96, 80, bias=True).to(dtype)
        with torch.no_grad():
            probe.weight.copy_(torch.randn(80, 96, generator=gen))
            probe.bias.copy_(torch.randn(80, generator=gen))
        x = torch.randn(5, 96, generator=gen).to(dtype)
        with torch.inference_mode():
            want = F.linear(x, probe.weight, probe.bias).float()
            got = PackedLinear(probe)(x).float()
    except Exception as exc:      # an op this build lacks, a dtype oneDNN refuses
        return f"oneDNN's packed linear fails here ({type(exc).__name__}: {exc})"
    error = float((got - want).abs().max() / want.abs().max())
    if error > PROBE_TOLERANCE:
        return f"oneDNN's packed linear differs from F.linear by {error:.2g} here"
    return None


def pack_linears(model: nn.Module) -> int:
    """Replaces every `nn.Linear` under `model` by a `PackedLinear`; the count. A weight
    shared with another module (a tied `lm_head`) stays where the other one uses it."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
