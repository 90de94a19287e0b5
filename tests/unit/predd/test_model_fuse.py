"""`predd.model.llama.fuse`: Hugging Face's q/k/v and gate/up weights become the model's one
GEMM each, concatenated in that order; a group with a part missing is refused."""
from __future__ import annotations

import pytest
import torch

from predd.model.llama import fuse


def weights(prefix: str, bias: bool) -> dict[str, torch.Tensor]:
    out = {}
    for i, name in enumerate(("q_proj", "k_proj", "v_proj", "o_proj")):
        out[f"{prefix}self_attn.{name}.weight"] = torch.full((2, 3), float(i))
        if bias and name != "o_proj":
            out[f"{prefix}self_attn.{name}.bias"] = torch.full((2,), float(i))
    for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        out[f"{prefix}mlp.{name}.weight"] = torch.full((2, 3), 10.0 + i)
    return out


def test_fuse_concatenates_in_order_and_passes_the_rest():
    fused = fuse({**weights("model.layers.0.", bias=True), "model.norm.weight": torch.ones(3)})
    assert sorted(fused) == [
        "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.qkv_proj.bias",
        "model.layers.0.self_attn.qkv_proj.weight", "model.norm.weight"]
    qkv = fused["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (6, 3) and qkv[:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert fused["model.layers.0.self_attn.qkv_proj.bias"].tolist() == [0, 0, 1, 1, 2, 2]
    assert fused["model.layers.0.mlp.gate_up_proj.weight"][:, 0].tolist() == [10, 10, 11, 11]


def test_fuse_refuses_a_partial_group():
    broken = weights("model.layers.3.", bias=False)
    del broken["model.layers.3.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.qkv_proj needs all of"):
        fuse(broken)
