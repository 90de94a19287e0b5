"""The runner on Hugging Face directories of each Llama-family architecture it claims
(Llama with Llama-3 RoPE scaling, Qwen2 with q/k/v biases, Mistral), against
transformers' own model on the same random weights: same logits for a prefill split
across two chunks, and for a decode step over the paged cache. On CUDA too (`gpu`: the
runner's device path against the same CPU reference)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from predd.engine.chunk import Chunk
from predd.worker.runner import Runner, RunnerConfig  # noqa: E402

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5)
FAMILIES = {
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        rope_theta=1000000.0, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None)),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers(family, device, tmp_path):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    ref = model_cls(config_cls(**COMMON, **extra)).eval()
    ref.save_pretrained(tmp_path)
    runner = Runner(RunnerConfig(str(tmp_path), device=device, kv_pages=16, page_size=4))
    if family == "qwen2":
        assert runner.model_config.attention_bias
    tokens = np.random.default_rng(0).integers(0, 512, size=23).astype(np.int32)
    with torch.no_grad():
        expected = ref(torch.tensor(tokens[None].astype(np.int64))).logits[0].numpy()

    pages = np.array([5, 2, 7, 0, 3, 9], np.int32)   # the object's page table, out of order
    first = Chunk(tokens[:10], np.arange(10, dtype=np.int32), pages[:3], 10, np.arange(10))
    (a,) = runner.execute([first])
    second = Chunk(tokens[10:22], np.arange(10, 22, dtype=np.int32), pages[:6], 22,
                   np.arange(12))
    (b,) = runner.execute([second])
    decode = Chunk(tokens[22:23], np.array([22], np.int32), pages, 23, np.array([0]))
    (c,) = runner.execute([decode])
    got = np.concatenate([a.numpy(), b.numpy(), c.numpy()])
    assert np.abs(got - expected).max() <= 1e-4
