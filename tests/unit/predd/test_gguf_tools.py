"""The GGUF tools of the GPU check (scripts/gguf_cut.py, scripts/gguf_random.py): a cut
grown back keeps the shape and cycles the source's blocks; a random model loads with
the shape asked for and the source's vocabulary."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from predd.model.loader import default_model_path, load_weights
from scripts import gguf_cut, gguf_random


def test_names_cut_and_grow():
    assert gguf_cut.names("token_embd.weight", 30, 4) == ["token_embd.weight"]
    assert gguf_cut.names("blk.3.attn_q.weight", 30, 4) == ["blk.3.attn_q.weight"]
    assert gguf_cut.names("blk.5.attn_q.weight", 30, 4) == []
    assert gguf_cut.names("blk.1.ffn_up.weight", 4, 10) == [
        "blk.1.ffn_up.weight", "blk.5.ffn_up.weight", "blk.9.ffn_up.weight"]


def test_a_cut_grown_back_cycles_its_blocks(tmp_path):
    cut, grown = str(tmp_path / "cut.gguf"), str(tmp_path / "grown.gguf")
    assert gguf_cut.cut(default_model_path(), cut, 2)[0] == 2 + 2 * 9   # embedding, output norm
    assert gguf_cut.cut(cut, grown, 5)[0] == 2 + 5 * 9
    source = {t.name: t for t in gguf.GGUFReader(default_model_path()).tensors}
    reader = gguf.GGUFReader(grown)
    assert reader.fields["llama.block_count"].contents() == 5
    tensors = {t.name: t for t in reader.tensors}
    for i, b in [(0, 0), (1, 1), (2, 0), (3, 1), (4, 0)]:
        got, want = tensors[f"blk.{i}.attn_q.weight"], source[f"blk.{b}.attn_q.weight"]
        assert got.tensor_type == want.tensor_type
        assert np.array_equal(got.data, want.data)


def test_a_cut_of_no_layers_is_refused(tmp_path):
    with pytest.raises(ValueError, match="EINVAL"):
        gguf_cut.cut(default_model_path(), str(tmp_path / "x.gguf"), 0)


def test_a_random_model_has_the_shape_asked_for(tmp_path):
    shape = gguf_random.Shape(hidden=64, ffn=96, layers=3, heads=4, kv_heads=2,
                              rope_theta=5000.0)
    out = str(tmp_path / "tiny.gguf")
    gguf_random.write(out, shape, default_model_path())
    config, weights = load_weights(out, torch.float32)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size,
            config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim,
            config.rope_theta, config.tie_word_embeddings) == (
        49152, 64, 96, 3, 4, 2, 16, 5000.0, True)
    assert weights["model.layers.2.self_attn.k_proj.weight"].shape == (32, 64)
    assert weights["model.layers.2.mlp.down_proj.weight"].shape == (64, 96)
    assert weights["model.embed_tokens.weight"].shape == (49152, 64)
    assert torch.equal(weights["model.layers.0.mlp.up_proj.weight"],
                       weights["model.layers.2.mlp.up_proj.weight"])
