"""predd/model/linear.py: projections packed once for oneDNN give F.linear's result; every
nn.Linear of a model is swapped, a tied head included; where packing cannot run the
reason says why. (On a torch without oneDNN the packing tests skip, saying so.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from predd.model import linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    plain = nn.Linear(48, 40, bias=bias)
    x = torch.randn(rows, 48, generator=gen)
    with torch.inference_mode():
        want = F.linear(x, plain.weight, plain.bias)
        got = linear.PackedLinear(plain)(x)
    assert got.shape == (rows, 40)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_onednn
def test_pack_linears_swaps_every_projection_and_keeps_a_tied_embedding():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8, bias=False))
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight

    model = Tiny().eval()
    ids = torch.tensor([1, 4, 9])
    with torch.inference_mode():
        want = model.head(model.body(model.embed(ids)))
    assert linear.pack_linears(model) == 3
    assert [type(m).__name__ for m in (model.body[0], model.body[2], model.head)] == \
        ["PackedLinear"] * 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    with torch.inference_mode():
        got = model.head(model.body(model.embed(ids)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert model.embed.weight.shape == (10, 8)      # the embedding keeps its weight


@needs_onednn
def test_packing_runs_on_this_cpu_in_float32():
    assert linear.packing_problem(torch.device("cpu"), torch.float32) is None


def test_packing_is_refused_off_the_cpu():
    assert linear.packing_problem(torch.device("meta"), torch.float32) == \
        "packing is for the CPU, not meta"


def test_packing_problem_names_a_failing_probe(monkeypatch):
    def broken(*args):
        raise RuntimeError("no such kernel")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(linear.PackedLinear, "forward", lambda self, x: broken())
    assert linear.packing_problem(torch.device("cpu"), torch.float32) == \
        "oneDNN's packed linear fails here (RuntimeError: no such kernel)"
